"""Fine-tuning's plan, before any job runs: candidate expansion, the continued schedule and
the auto recipe. The real multi-process jobs: tests/integration/test_training_jobs.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import ROOT
from tests.support.training import sentiment_dataset
from tuneloop.config import ConfigError, load_config
from tuneloop.training import TrainSpec, candidate_specs


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory) -> Path:
    return sentiment_dataset(tmp_path_factory.mktemp("dataset"))


# ---------------------------------------------------------------------------------------
# candidates


def write_config(tmp_path: Path, training: dict) -> Path:
    path = tmp_path / "run.yaml"
    import yaml

    path.write_text(yaml.safe_dump({"paths": {"home": str(tmp_path / "home")}, "training": training}))
    return path


def test_candidates_expand_to_one_spec_each(tmp_path, dataset_dir):
    cfg = load_config(
        write_config(
            tmp_path,
            {
                "learning_rate": 1e-3,
                "candidates": [{"learning_rate": 3e-3}, {"method": "lora", "lora": {"r": 4}, "num_processes": 1}],
            },
        ),
        environ={},
    )
    specs = candidate_specs(cfg, dataset_dir, tmp_path / "runs")

    assert [s.name for s in specs] == ["cand-0", "cand-1"]
    assert specs[0].config.learning_rate == 3e-3 and specs[0].config.method == "full"
    assert specs[1].config.learning_rate == 1e-3  # not overridden: the section's value
    assert specs[1].config.lora.r == 4 and specs[1].config.lora.alpha == 16  # nested merge keeps alpha
    assert specs[1].num_processes == 1 and specs[0].num_processes == 2
    assert specs[1].overrides == {"method": "lora", "lora": {"r": 4}, "num_processes": 1}
    for spec in specs:
        assert Path(spec.deepspeed_config).is_file()  # resolved against the project root
        assert spec.train_path == str(dataset_dir / "train.jsonl")
        assert spec.eval_path == str(dataset_dir / "eval.jsonl")
        assert spec.base_model == cfg.base_model_ref
        assert Path(spec.output_dir) == tmp_path / "runs" / spec.name
        assert "candidates" not in spec.training
        # what the training process reads back is what was planned
        assert TrainSpec.load(spec.save()) == spec


def test_no_candidates_is_one_candidate(tmp_path, dataset_dir):
    cfg = load_config(write_config(tmp_path, {"max_steps": 7}), environ={})
    (spec,) = candidate_specs(cfg, dataset_dir, tmp_path / "runs")
    assert spec.name == "cand-0" and spec.config.max_steps == 7 and spec.overrides == {}


@pytest.mark.parametrize(
    "bad, key",
    [
        ({"learning_rte": 1e-3}, "learning_rte"),
        ({"lora": {"rank": 4}}, "lora.rank"),
        ({"max_steps": 0}, "max_steps"),
    ],
)
def test_bad_candidate_override_is_a_config_error(tmp_path, dataset_dir, bad, key):
    cfg = load_config(write_config(tmp_path, {"candidates": [{"learning_rate": 1e-3}, bad]}), environ={})
    with pytest.raises(ConfigError) as err:
        candidate_specs(cfg, dataset_dir, tmp_path / "runs")
    assert "training.candidates[1]" in str(err.value) and key in str(err.value)


def test_a_run_from_the_champion_takes_the_continued_schedule(tmp_path, dataset_dir):
    """training.continued applies only when the weights start from the champion, under each
    candidate's own overrides; a run from the base keeps the section's schedule."""
    cfg = load_config(
        write_config(
            tmp_path,
            {
                "max_steps": 150,
                "learning_rate": 1e-3,
                "method": "lora",
                "lora": {"r": 16, "alpha": 32},
                "continued": {"max_steps": 40, "learning_rate": 2e-4, "lora": {"r": 8}},
                "candidates": [{}, {"learning_rate": 5e-4}],
            },
        ),
        environ={},
    )
    fresh = candidate_specs(cfg, dataset_dir, tmp_path / "runs")
    assert [(s.config.max_steps, s.config.learning_rate, s.config.lora.r) for s in fresh] == [
        (150, 1e-3, 16),
        (150, 5e-4, 16),
    ]
    champion = tmp_path / "champion"
    continued = candidate_specs(cfg, dataset_dir, tmp_path / "runs", start_from=str(champion))
    assert [(s.config.max_steps, s.config.learning_rate, s.config.lora.r) for s in continued] == [
        (40, 2e-4, 8),
        (40, 5e-4, 8),
    ]
    assert all(s.base_model == str(champion) and "continued" not in s.training for s in continued)
    assert continued[0].config.lora.alpha == 32  # nested merge keeps the rest of lora


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"max_stepz": 40}, "unknown training keys"),
        ({"max_steps": 0}, "max_steps"),
        ({"init_from": "base"}, "may not set"),
    ],
)
def test_a_bad_continued_schedule_fails_when_the_config_loads(tmp_path, bad, message):
    with pytest.raises(ConfigError, match=message):
        load_config(write_config(tmp_path, {"continued": bad}), environ={})


# ---------------------------------------------------------------------------------------
# the auto recipe


def test_auto_recipe_sizes_the_run_from_the_data_and_explicit_values_win(tmp_path, dataset_dir):
    from tuneloop.training.recipe import auto_recipe

    cfg = load_config(
        write_config(tmp_path, {"recipe": "auto", "method": "lora", "num_processes": 2, "per_device_batch_size": 4}),
        environ={},
    )
    chosen, candidates, notes = auto_recipe(cfg.training, 368, "no-such-model")
    assert chosen["max_steps"] == 138  # 3 epochs of 368 rows at 8 rows a step
    assert chosen["save_steps"] == 18 and chosen["early_stopping"] == {"patience": 3, "keep_best": True}
    assert chosen["lora"]["target_modules"] == "all-linear" and chosen["learning_rate"] == 1e-3
    assert candidates == [] and any(n.startswith("max_steps=138: 3 epochs of 368 rows") for n in notes)
    # a tiny set is seen at least 100 times; a long run is capped
    assert auto_recipe(cfg.training, 10, "x")[0]["max_steps"] == 13
    assert auto_recipe(cfg.training, 100_000, "x")[0]["max_steps"] == 400

    cfg = load_config(
        write_config(
            tmp_path,
            {
                "recipe": "auto",
                "method": "lora",
                "max_steps": 40,
                "lora": {"target_modules": ["q_proj"]},
                "recipe_search": 3,
            },
        ),
        environ={"TUNELOOP__TRAINING__LEARNING_RATE": "0.0002"},
    )
    chosen, candidates, notes = auto_recipe(cfg.training, 368, "x")
    assert "max_steps" not in chosen and "learning_rate" not in chosen and "target_modules" not in chosen["lora"]
    assert chosen["save_steps"] == 5  # sized from the explicit 40 steps
    assert any(n.startswith("max_steps=40: set in the config") for n in notes)
    assert [c["learning_rate"] for c in candidates] == [0.0002, 6.67e-05, 0.0006]
    # the specs carry the chosen schedule and the notes
    specs = candidate_specs(cfg, dataset_dir, tmp_path / "runs")
    assert len(specs) == 3 and specs[0].config.max_steps == 40 and specs[0].config.early_stopping.keep_best
    assert specs[0].notes[0].startswith("max_steps=40: set in the config") and "of 256 rows" in specs[0].notes[0]


def test_a_retrain_from_the_champion_keeps_the_recipe_choosing():
    """The loop's retrain sets init_from on the preset's config; the recipe must still see only
    the keys the file set as explicit."""
    from flows.training import with_init_from
    from tuneloop.training.recipe import auto_recipe

    cfg = with_init_from(load_config(ROOT / "configs" / "smollm2.yaml", environ={}), "champion")
    assert cfg.training.init_from == "champion" and cfg.training.recipe == "auto"
    chosen, _, _ = auto_recipe(cfg.training, 1987, "x")
    assert chosen["lora"] == {"target_modules": "all-linear", "r": 16, "alpha": 32}
    with pytest.raises(Exception, match="init_from"):
        with_init_from(cfg, "nowhere")
