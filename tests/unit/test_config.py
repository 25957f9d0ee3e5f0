"""The config schema: defaults, env overrides, and errors that name the key and the file."""

from pathlib import Path

import pytest

from tuneloop.config import REPO_ROOT, ConfigError, load_config


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def test_repo_default_config_is_valid_and_local():
    cfg = load_config(REPO_ROOT / "configs" / "default.yaml", environ={})
    assert cfg.home == REPO_ROOT / ".tuneloop"
    assert cfg.mlflow_tracking_uri == f"sqlite:///{REPO_ROOT / '.tuneloop' / 'mlflow.db'}"
    assert cfg.mlflow_artifact_location == (REPO_ROOT / ".tuneloop" / "mlartifacts").as_uri()
    assert cfg.prefect.api_url is None  # ephemeral Prefect
    assert cfg.gateway.redis_url is None  # in-process cache
    assert cfg.bentoml_home == REPO_ROOT / ".tuneloop" / "bentoml"
    assert cfg.base_model_ref == str(cfg.bootstrap_dir)
    assert cfg.blessing.thresholds, "the shipped config must bless on something"


def test_empty_file_gives_embedded_defaults(tmp_path):
    cfg = load_config(write(tmp_path, ""), environ={})
    assert cfg.data.on_bad_rows == "quarantine"
    assert cfg.home == tmp_path / ".tuneloop"  # relative paths resolve against the file's folder


def test_unknown_key_names_key_and_file(tmp_path):
    path = write(tmp_path, "data:\n  eval_fractoin: 0.2\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, environ={})
    assert "data.eval_fractoin: unknown key" in str(err.value)
    assert str(path) in str(err.value)


def test_unknown_section_and_wrong_type(tmp_path):
    path = write(tmp_path, "trainning: {}\ntraining:\n  max_steps: lots\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, environ={})
    msg = str(err.value)
    assert "trainning: unknown key" in msg
    assert "training.max_steps" in msg and "'lots'" in msg


def test_out_of_range_and_cross_field_errors(tmp_path):
    with pytest.raises(ConfigError, match="data.eval_fraction"):
        load_config(write(tmp_path, "data: {eval_fraction: 1.5}\n"), environ={})
    with pytest.raises(ConfigError, match="divisible"):
        load_config(write(tmp_path, "bootstrap: {n_embd: 100, n_head: 3}\n"), environ={})


def test_not_a_mapping_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(write(tmp_path, "- a\n- b\n"), environ={})
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "data: [unclosed\n"), environ={})
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml", environ={})


def test_environment_overrides(tmp_path):
    path = write(tmp_path, "data: {seed: 1}\n")
    cfg = load_config(
        path,
        environ={
            "TUNELOOP_MLFLOW_URI": "http://127.0.0.1:5000",
            "TUNELOOP_REDIS_URL": "redis://127.0.0.1:6379/0",
            "TUNELOOP_HOME": str(tmp_path / "state"),
            "TUNELOOP__DATA__SEED": "7",
            "TUNELOOP__TRAINING__METHOD": "lora",
        },
    )
    assert cfg.mlflow_tracking_uri == "http://127.0.0.1:5000"
    assert cfg.mlflow_artifact_location is None  # a tracking server's artifacts are its own, not a folder here
    assert cfg.gateway.redis_url == "redis://127.0.0.1:6379/0"
    assert cfg.home == tmp_path / "state"
    assert cfg.data.seed == 7
    assert cfg.training.method == "lora"


def test_bad_environment_override_names_the_variable(tmp_path):
    with pytest.raises(ConfigError, match="training.max_steps"):
        load_config(write(tmp_path, ""), environ={"TUNELOOP__TRAINING__MAX_STEPS": "-3"})
    with pytest.raises(ConfigError, match="TUNELOOP__DATA"):
        load_config(write(tmp_path, ""), environ={"TUNELOOP__DATA": "x"})


def test_blessing_thresholds_are_typed(tmp_path):
    path = write(
        tmp_path,
        "blessing:\n  thresholds:\n    - metric: exact_match\n      change_threshold: {direction: sideways}\n",
    )
    with pytest.raises(ConfigError, match="direction"):
        load_config(path, environ={})


def test_gateway_switches_read_as_written_in_yaml(tmp_path):
    # YAML 1.1 turns a bare `off` into False: the schema takes it back as "off"
    path = tmp_path / "gw.yaml"
    path.write_text("gateway:\n  auth: off\n  pii: {mode: block, outputs: off}\n  filter: {prompts: off}\n")
    cfg = load_config(path, environ={})
    assert (cfg.gateway.auth, cfg.gateway.pii.mode, cfg.gateway.pii.outputs, cfg.gateway.filter.prompts) == (
        "off",
        "block",
        "off",
        "off",
    )
    path.write_text("gateway:\n  pii: {mode: on}\n")  # `on` is no PII mode: the error names the key
    with pytest.raises(ConfigError, match="gateway.pii.mode"):
        load_config(path, environ={})
    path.write_text("gateway:\n  tiers: {free: {requests_per_minute: 0, tokens_per_minute: 10}}\n")
    with pytest.raises(ConfigError, match="gateway.tiers.free.requests_per_minute"):
        load_config(path, environ={})


SHIPPED = sorted((REPO_ROOT / "configs").glob("*.yaml"))


def _paths(section, where: str = ""):
    """(dotted key, Path) of every path-valued setting in a config section, nested ones included."""
    from pydantic import BaseModel

    for name in type(section).model_fields:
        value = getattr(section, name)
        key = f"{where}.{name}" if where else name
        if isinstance(value, BaseModel):
            yield from _paths(value, key)
        elif isinstance(value, Path):
            yield key, value
        elif isinstance(value, list) and value and all(isinstance(v, Path) for v in value):
            for i, v in enumerate(value):
                yield f"{key}[{i}]", v


@pytest.mark.parametrize("config", SHIPPED, ids=[p.name for p in SHIPPED])
def test_a_shipped_config_reads_nothing_outside_the_clone_and_its_home(config):
    """A user's clone has nothing beside it: every path a shipped config names (data, suites,
    DeepSpeed configs, the filter's labelled set, ...) is inside the repository or the state
    folder, and the ones that must exist do."""
    cfg = load_config(config, environ={})
    assert SHIPPED and cfg.home.is_relative_to(REPO_ROOT)
    keys = []
    for key, path in _paths(cfg):
        resolved = cfg.resolve(path)
        keys.append(key)
        assert resolved.is_relative_to(REPO_ROOT) or resolved.is_relative_to(cfg.home), f"{config.name}: {key} = {path}"
        if key.split("[")[0] in {
            "data.train_path",
            "gateway.filter_training.train_path",
            "evaluation.behaviour_suite",
            "evaluation.behaviour_suites",
            "training.deepspeed_config",
        }:
            assert resolved.exists(), f"{config.name}: {key} = {resolved} does not exist in the clone"
    assert "data.train_path" in keys and "gateway.filter_training.train_path" in keys
    assert "../shared" not in config.read_text()


def test_no_make_target_reads_beside_the_clone():
    makefile = (REPO_ROOT / "Makefile").read_text()
    assert "../shared" not in makefile and "shared/data" not in makefile


def test_nested_environment_overrides_and_errors_that_name_the_variable(tmp_path):
    cfg = load_config(
        write(tmp_path, ""),
        environ={
            "TUNELOOP__GATEWAY__CACHE__ENABLED": "false",
            "TUNELOOP__GATEWAY__ON_REDIS_ERROR": "closed",
            "TUNELOOP__GATEWAY__TIERS__FREE__REQUESTS_PER_MINUTE": "7",
        },
    )
    assert cfg.gateway.cache.enabled is False and cfg.gateway.on_redis_error == "closed"
    assert cfg.gateway.tiers["free"].requests_per_minute == 7 and cfg.gateway.tiers["free"].tokens_per_minute == 40_000
    with pytest.raises(ConfigError) as err:  # a key that does not exist: an error, never dropped
        load_config(write(tmp_path, ""), environ={"TUNELOOP__GATEWAY__CACHE__ENABLD": "false"})
    assert "gateway.cache.enabld: unknown key" in str(err.value) and "TUNELOOP__GATEWAY__CACHE__ENABLD" in str(
        err.value
    )
    with pytest.raises(ConfigError) as err:  # a value the key does not take
        load_config(write(tmp_path, ""), environ={"TUNELOOP__GATEWAY__ON_REDIS_ERROR": "sometimes"})
    assert "gateway.on_redis_error" in str(err.value) and "TUNELOOP__GATEWAY__ON_REDIS_ERROR" in str(err.value)
    with pytest.raises(ConfigError, match="TUNELOOP__GATEWAY"):
        load_config(write(tmp_path, ""), environ={"TUNELOOP__GATEWAY": "x"})
    with pytest.raises(ConfigError, match="(?s)data.seed: .*TUNELOOP__DATA__SEED__X"):  # a number has no keys
        load_config(write(tmp_path, ""), environ={"TUNELOOP__DATA__SEED__X": "1"})
    with pytest.raises(ConfigError, match="is not a mapping"):
        load_config(write(tmp_path, "data: {seed: 3}\n"), environ={"TUNELOOP__DATA__SEED__X": "1"})
