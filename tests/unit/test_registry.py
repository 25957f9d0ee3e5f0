"""ModelRegistry against a real MLflow sqlite backend: aliases, blessing tags, CAS promotion,
a real two-process race, rollback and the audit trail."""

import json
import multiprocessing as mp
from pathlib import Path

import pytest

from tuneloop.blessing import bless
from tuneloop.config import MetricThreshold
from tuneloop.registry import (
    CHALLENGER,
    CHAMPION,
    PREVIOUS,
    ModelRegistry,
    NotBlessed,
    PromotionConflict,
    RegistryError,
    lock_path_for,
)

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    """One sqlite database + artifact store for the module (creating the tables costs seconds)."""
    from mlflow.tracking import MlflowClient

    root = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)  # not the process-wide registry URI
    experiment_id = client.create_experiment("tests", artifact_location=(root / "artifacts").as_uri())
    model_dir = root / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text('{"model_type": "gpt2"}')
    (model_dir / "model.safetensors").write_bytes(b"\0" * 64)
    return {"uri": uri, "client": client, "experiment_id": experiment_id, "model_dir": model_dir, "root": root}


def new_version(backend, reg: ModelRegistry, blessed: bool | None = True) -> str:
    run = backend["client"].create_run(backend["experiment_id"])
    version = reg.register(run.info.run_id, backend["model_dir"], tags={"candidate": "lr=1e-3"})
    if blessed is not None:
        threshold = MetricThreshold.model_validate({"metric": "exact_match", "value_threshold": {"lower_bound": 0.5}})
        reg.record_blessing(version, bless({"exact_match": 0.9 if blessed else 0.1}, None, [threshold]))
    return version


def test_register_points_back_to_run_and_logs_artifacts(backend):
    reg = ModelRegistry(backend["uri"], "register")
    run = backend["client"].create_run(backend["experiment_id"])
    v1 = reg.register(run.info.run_id, backend["model_dir"], tags={"base": "tiny"})
    info = reg.version(v1)
    assert v1 == "1" and info.run_id == run.info.run_id and info.tags["base"] == "tiny"
    local = Path(info.source.removeprefix("file://"))
    assert (local / "config.json").exists() and (local / "model.safetensors").exists()
    assert info.uri == "models:/register/1"
    # A second version of the same model, no aliases yet.
    assert new_version(backend, reg, blessed=None) == "2"
    assert reg.champion() is None and reg.challenger() is None and reg.history() == []
    with pytest.raises(RegistryError, match="no config.json"):
        reg.register(run.info.run_id, backend["root"])


def test_challenger_and_blessing_tags(backend):
    reg = ModelRegistry(backend["uri"], "tags")
    v1 = new_version(backend, reg)
    reg.set_challenger(v1)
    assert reg.challenger().version == v1 and CHALLENGER in reg.challenger().aliases
    t = MetricThreshold.model_validate(
        {"metric": "exact_match", "change_threshold": {"direction": "higher_is_better", "absolute": 0.0}}
    )
    b = bless(
        {"exact_match": 0.25, "eval_loss": 2.0}, {"exact_match": 0.5, "eval_loss": 2.5}, [t], baseline_version="9"
    )
    reg.record_blessing(v1, b)
    tags = reg.version(v1).tags
    assert tags["blessed"] == "false" and tags["blessing.baseline_version"] == "9"
    assert float(tags["blessing.delta.exact_match.absolute"]) == -0.25
    assert float(tags["blessing.delta.eval_loss.relative"]) == -0.2
    assert json.loads(tags["blessing.reasons"]) == b.reasons
    reg.mark_deployed(v1, "tuneloop-chat:abc123")
    assert reg.version(v1).tags["deployed.bento"] == "tuneloop-chat:abc123"
    with pytest.raises(RegistryError, match="no version 99"):
        reg.set_challenger(99)


def test_promote_compare_and_set_and_rollback(backend):
    reg = ModelRegistry(backend["uri"], "promote")
    v1, v2, v3 = (new_version(backend, reg) for _ in range(3))
    unblessed = new_version(backend, reg, blessed=False)

    with pytest.raises(NotBlessed, match="not blessed"):
        reg.promote(unblessed, expected_champion=None, reason="x", actor="t")

    r = reg.promote(v1, expected_champion=None, reason="first model", actor="alice")
    assert r.promoted and r.previous is None and reg.champion().version == v1 and reg.previous() is None

    reg.set_challenger(v2)
    r = reg.promote(v2, expected_champion=v1, reason="beats champion", actor="bob")
    assert reg.champion().version == v2 and reg.previous().version == v1
    assert reg.challenger() is None, "the challenger alias goes once it has won"

    # Someone evaluated v3 against v1, but v2 is champion now: refused, nothing changes.
    with pytest.raises(PromotionConflict) as conflict:
        reg.promote(v3, expected_champion=v1, reason="stale", actor="carol")
    assert conflict.value.expected == v1 and conflict.value.actual == v2
    assert reg.champion().version == v2 and len(reg.history()) == 2
    with pytest.raises(RegistryError, match="already the champion"):
        reg.promote(v2, expected_champion=v2, reason="again", actor="bob")

    r = reg.rollback(reason="bad answers in prod", actor="oncall")
    assert r.version == v1 and r.previous == v2
    assert reg.champion().version == v1 and reg.previous().version == v2
    # Rolling back twice swaps back: rollback is itself undoable.
    reg.rollback(reason="false alarm", actor="oncall")
    assert reg.champion().version == v2

    history = reg.history()
    assert [(h.seq, h.action, h.from_version, h.to_version, h.actor) for h in history] == [
        (1, "promote", None, v1, "alice"),
        (2, "promote", v1, v2, "bob"),
        (3, "rollback", v2, v1, "oncall"),
        (4, "rollback", v1, v2, "oncall"),
    ]
    assert history[0].reason == "first model" and history[2].at.endswith("+00:00")

    forced = reg.promote(unblessed, expected_champion=v2, reason="manual", actor="admin", require_blessed=False)
    assert forced.record.extra == {"override": "promoted without blessing"}


def test_rollback_without_previous_is_a_clear_error(backend):
    reg = ModelRegistry(backend["uri"], "norollback")
    with pytest.raises(RegistryError, match="no previous champion"):
        reg.rollback(reason="x", actor="t")
    v1 = new_version(backend, reg)
    reg.promote(v1, expected_champion=None, reason="first", actor="t")
    with pytest.raises(RegistryError, match=r"no previous champion \(current champion: v1\)"):
        reg.rollback(reason="x", actor="t")


def _promote_in_other_process(uri, name, version, expected, barrier, results):
    reg = ModelRegistry(uri, name)  # imports mlflow, opens its own connection
    barrier.wait()  # both processes reach promote() at the same moment
    try:
        reg.promote(version, expected_champion=expected, reason=f"race {version}", actor=f"proc-{version}")
        results.put(("promoted", version))
    except PromotionConflict as exc:
        results.put(("refused", version, exc.actual))


def test_two_processes_race_one_wins_one_is_refused(backend):
    name = "race"
    reg = ModelRegistry(backend["uri"], name)
    v1, v2, v3 = (new_version(backend, reg) for _ in range(3))
    reg.promote(v1, expected_champion=None, reason="first", actor="t")

    ctx = mp.get_context("spawn")  # fresh interpreters: no sqlite connection shared by fork
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [
        ctx.Process(target=_promote_in_other_process, args=(backend["uri"], name, v, v1, barrier, results))
        for v in (v2, v3)
    ]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=180) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0

    promoted = [o for o in outcomes if o[0] == "promoted"]
    refused = [o for o in outcomes if o[0] == "refused"]
    assert len(promoted) == 1 and len(refused) == 1, outcomes
    winner = promoted[0][1]
    assert refused[0][2] == winner, "the loser saw the winner as champion"
    assert reg.champion().version == winner and reg.previous().version == v1
    history = reg.history()
    assert [(h.action, h.from_version, h.to_version) for h in history] == [
        ("promote", None, v1),
        ("promote", v1, winner),
    ], "exactly one promotion recorded, never doubled"


def test_lock_lives_next_to_the_database(tmp_path):
    assert lock_path_for(f"sqlite:///{tmp_path}/x/mlflow.db", "chat") == tmp_path / "x" / ".registry-chat.lock"
    assert lock_path_for(tmp_path.as_uri(), "a/b") == tmp_path / ".registry-a_b.lock"
    remote = lock_path_for("http://mlflow:5000", "chat")
    assert remote.name.startswith("chat-") and remote != lock_path_for("http://other:5000", "chat")


# ---- the promotion log: what holds promotion together across machines -----------------------


def _log_outcomes(backend, name: str) -> list[tuple[str, str]]:
    versions = backend["client"].search_model_versions(f"name = '{name}.promotion-log'")
    return [
        (json.loads(mv.tags["tuneloop.request"])["action"], mv.tags.get("outcome"))
        for mv in sorted(versions, key=lambda mv: int(mv.version))
    ]


def test_the_log_decides_when_both_promoters_passed_the_precheck(backend, tmp_path):
    """Two machines (two lock files): both saw v1 as champion, both write; the log's replay
    refuses the second request, whatever the order of their later alias writes."""
    a = ModelRegistry(backend["uri"], "twomachines", lock_path=tmp_path / "a.lock")
    b = ModelRegistry(backend["uri"], "twomachines", lock_path=tmp_path / "b.lock")
    v1, v2, v3 = (new_version(backend, a) for _ in range(3))
    a.promote(v1, expected_champion=None, reason="first", actor="a")
    seen_by_b = b._settled()  # b has read the log (champion v1) ...
    a.promote(v2, expected_champion=v1, reason="a wins", actor="a")  # ... and a promotes meanwhile
    b._settled = lambda: seen_by_b  # b's pre-check passes on what it read
    with pytest.raises(PromotionConflict) as conflict:
        b.promote(v3, expected_champion=v1, reason="b loses", actor="b")
    assert conflict.value.actual == v2
    assert a.champion().version == v2 and a.previous().version == v1
    assert [(h.from_version, h.to_version) for h in a.history()] == [(None, v1), (v1, v2)]
    assert _log_outcomes(backend, "twomachines") == [
        ("promote", "applied"),
        ("promote", "applied"),
        ("promote", "refused"),
    ]


def test_a_late_copy_of_an_older_decision_is_corrected(backend, tmp_path):
    """A promoter that stalled after reading the log writes the older champion over the newer
    one; it re-reads the log after writing and puts the newer one back."""
    reg = ModelRegistry(backend["uri"], "stalled")
    v1, v2 = (new_version(backend, reg) for _ in range(2))
    reg.promote(v1, expected_champion=None, reason="first", actor="t")
    stale = reg._replay(reg._read_log())
    reg.promote(v2, expected_champion=v1, reason="second", actor="t")
    latest = reg._copy_to_aliases(stale)
    assert latest.champion == v2 and reg.champion().version == v2 and reg.previous().version == v1


def test_a_crash_between_the_decision_and_the_aliases_is_repaired(backend):
    reg = ModelRegistry(backend["uri"], "crashed")
    v1, v2 = (new_version(backend, reg) for _ in range(2))
    reg.promote(v1, expected_champion=None, reason="first", actor="t")
    copy = reg._copy_to_aliases

    def crash_on_the_new_champion(state, *a, **kw):
        if state.champion == v2:
            raise RuntimeError("killed")
        return copy(state, *a, **kw)

    reg._copy_to_aliases = crash_on_the_new_champion
    with pytest.raises(RuntimeError, match="killed"):
        reg.promote(v2, expected_champion=v1, reason="second", actor="t")
    del reg._copy_to_aliases
    assert reg.champion().version == v1 and len(reg.history()) == 1  # the copy is behind the log ...
    with pytest.raises(PromotionConflict):  # ... which decided: v1 is no longer the champion
        reg.promote(v1, expected_champion=v1, reason="stale view", actor="t")
    assert reg.champion().version == v2 and reg.previous().version == v1  # that promote repaired first
    assert [(h.from_version, h.to_version) for h in reg.history()] == [(None, v1), (v1, v2)]
    assert reg.repair().champion == v2


def test_a_registry_from_before_the_log_is_adopted(backend):
    """Aliases and history written without a log (an older tuneloop): the first promotion
    adopts them and goes on from there."""
    reg = ModelRegistry(backend["uri"], "adopted")
    v1, v2, v3 = (new_version(backend, reg) for _ in range(3))
    client = backend["client"]
    client.set_registered_model_alias("adopted", CHAMPION, v2)
    client.set_registered_model_alias("adopted", PREVIOUS, v1)
    old = {
        "seq": 7,
        "action": "promote",
        "to_version": v2,
        "from_version": v1,
        "actor": "old",
        "reason": "x",
        "at": "2026-01-01T00:00:00+00:00",
        "extra": {},
    }
    client.set_registered_model_tag("adopted", "promotion.000007", json.dumps(old))
    with pytest.raises(PromotionConflict):
        reg.promote(v3, expected_champion=v1, reason="stale", actor="t")
    r = reg.promote(v3, expected_champion=v2, reason="after adoption", actor="t")
    assert r.record.seq == 8 and reg.champion().version == v3 and reg.previous().version == v2
    assert [h.seq for h in reg.history()] == [7, 8]
    assert _log_outcomes(backend, "adopted") == [("adopt", "applied"), ("promote", "applied")]
    assert reg.rollback(reason="back", actor="t").version == v2


def test_a_copy_written_by_a_concurrent_promoter_first_is_not_an_error(backend, tmp_path):
    """Two processes copying the same decision at once: MLflow's SQL store sets a tag or an
    alias by read-then-insert, so one of them gets the database's unique-key error (seen in
    CI against PostgreSQL behind `mlflow server`). That row was written by the other one;
    the promotion goes on and the copy agrees with the log. A mock simulates the fault: the
    other process's write lands, then this one's insert fails."""
    from mlflow.exceptions import MlflowException

    reg = ModelRegistry(backend["uri"], "copyclash", lock_path=tmp_path / "copyclash.lock")
    v1, v2 = (new_version(backend, reg) for _ in range(2))
    reg.promote(v1, expected_champion=None, reason="first", actor="t")
    for method in ("set_registered_model_tag", "set_registered_model_alias"):
        real = getattr(reg.client, method)
        clashes = []

        def clash(*args, real=real, clashes=clashes):
            if not clashes:
                real(*args)  # the other promoter's copy ...
                clashes.append(args)  # ... and then this one's insert of the same row
                raise MlflowException(
                    "BAD_REQUEST: (psycopg.errors.UniqueViolation) duplicate key value violates unique constraint",
                    error_code="BAD_REQUEST",
                )
            return real(*args)

        setattr(reg.client, method, clash)
    reg.promote(v2, expected_champion=v1, reason="second", actor="t")
    assert reg.champion().version == v2 and reg.previous().version == v1
    assert [(h.from_version, h.to_version) for h in reg.history()] == [(None, v1), (v1, v2)]

    def broken(*args):  # any other error still stops the promotion
        raise MlflowException("INTERNAL_ERROR: the server is down", error_code="INTERNAL_ERROR")

    reg.client.set_registered_model_alias = broken
    v3 = new_version(backend, reg)
    with pytest.raises(MlflowException, match="server is down"):
        reg.promote(v3, expected_champion=v2, reason="third", actor="t")
