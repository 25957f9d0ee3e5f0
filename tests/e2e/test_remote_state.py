"""Same flows, remote state: a real PostgreSQL and a real `mlflow server` on it (runs and
registry in Postgres, artifacts uploaded and downloaded over HTTP with `--serve-artifacts`,
`--allowed-hosts` on), all on 127.0.0.1, nothing mocked.

- `tuneloop train` pointed at the server (TUNELOOP_MLFLOW_URI=http://...) registers and
  promotes there, and the deploy step builds the bento from the champion downloaded over
  HTTP; the gateway's key store lives in the same Postgres, and a key made with
  `tuneloop keys create` opens the served bento.
- Promotion stays compare-and-set between machines: two processes that share only the
  server (each its own lock file, as on two machines) promote different versions against
  the same champion, round after round; exactly one wins each round, the other gets
  PromotionConflict, and the history is one chain.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import sys
from pathlib import Path

import pytest

from tests.support import ROOT
from tests.support.servers import BIN, free_port, mlflow_server, postgres_server, prefect_home, service
from tests.support.servers import last_json as _last_json
from tests.support.servers import run_ok as _run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]
TUNELOOP = str(BIN / "tuneloop")
PEPPER = "remote-state-test-pepper-0123456789abcdef"


@pytest.fixture(scope="module")
def remote(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("remote")
    with postgres_server(tmp, databases=("mlflow", "gateway")) as pg:
        with mlflow_server(tmp, f"{pg}/mlflow") as uri:
            yield {"pg": pg, "mlflow": uri, "tmp": tmp, "artifacts": tmp / "mlflow-artifacts"}


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_train_promote_deploy_and_keys_on_remote_state(remote, demo_base_model):
    import httpx
    from mlflow.tracking import MlflowClient

    home = remote["tmp"] / "home"
    keys_url = f"{remote['pg']}/gateway"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TUNELOOP", "MLFLOW_"))}
    env.update(
        {
            "TUNELOOP_HOME": str(home),
            "TUNELOOP__BOOTSTRAP__OUTPUT_DIR": str(demo_base_model),
            "BENTOML_HOME": str(home / "bentoml"),
            "PREFECT_HOME": str(prefect_home(remote["tmp"] / "prefect")),
            "TUNELOOP_MLFLOW_URI": remote["mlflow"],
            "TUNELOOP__GATEWAY__KEY_STORE_URL": keys_url,
            "TUNELOOP_KEY_PEPPER": PEPPER,
            # what is tested is where state lives, not the model: one quick process, always blessed
            "TUNELOOP__TRAINING__MAX_STEPS": "20",
            "TUNELOOP__TRAINING__NUM_PROCESSES": "1",
            "TUNELOOP__TRAINING__DEEPSPEED_CONFIG": "null",
            "TUNELOOP__BLESSING__THRESHOLDS": "[{metric: eval_loss, value_threshold: {upper_bound: 1000}}]",
            "TUNELOOP__SERVING__COMPILE": "false",
            "TUNELOOP__SERVING__NUM_THREADS": "1",
        }
    )
    summary = _last_json(_run([TUNELOOP, "train", "--json"], env).stdout)
    assert summary["promoted"] and summary["deployment"]["deployed"], summary
    version = summary["champion_after"]

    # Registered and promoted on the server, with the aliases and the history there.
    client = MlflowClient(tracking_uri=remote["mlflow"], registry_uri=remote["mlflow"])
    name = "tuneloop-chat"
    model = client.get_registered_model(name)
    assert str(model.aliases["champion"]) == version
    mv = client.get_model_version(name, version)
    assert mv.source.startswith("mlflow-artifacts:/"), mv.source  # not a path on this machine
    assert mv.tags["blessed"] == "true"
    record = json.loads(model.tags["promotion.000001"])
    assert (record["action"], record["from_version"], record["to_version"]) == ("promote", None, version)
    log = client.get_model_version(f"{name}.promotion-log", "1")
    assert json.loads(log.tags["tuneloop.request"])["to_version"] == version and log.tags["outcome"] == "applied"
    # The run's lineage and the model files went over HTTP into the server's artifact store;
    # this machine's state folder holds none.
    assert not (home / "mlartifacts").exists()
    served_weights = sorted(remote["artifacts"].rglob("model/model.safetensors"))
    assert served_weights, sorted(p.name for p in remote["artifacts"].rglob("*"))[:50]

    # The bento was built from the champion downloaded over HTTP: its BentoML model says
    # where it came from, and its weights are the server's bytes.
    deployed = json.loads((home / "deployed.json").read_text())
    assert deployed["version"] == version, deployed
    store = home / "bentoml" / "models"
    [meta] = [p for p in store.rglob("model.yaml") if f"v{version}-" in str(p)]
    import yaml

    info = yaml.safe_load(meta.read_text())
    assert info["labels"]["mlflow.version"] == version
    assert info["metadata"]["mlflow_tracking_uri"] == remote["mlflow"]
    assert info["metadata"]["mlflow_source"] == mv.source
    assert _sha(meta.parent / "model.safetensors") in {_sha(p) for p in served_weights}

    # The key store lives in the same Postgres: a key made with the CLI is a row there ...
    row = json.loads(_run([TUNELOOP, "keys", "create", "--name", "remote", "--tier", "paid", "--json"], env).stdout)
    from tuneloop.gateway.keys import KeyStore

    store = KeyStore(keys_url, PEPPER.encode())
    try:
        assert store.verify(row["key"]).id == row["id"]
    finally:
        store.close()
    import psycopg

    with psycopg.connect(remote["pg"].replace("postgresql+psycopg", "postgresql") + "/gateway") as conn:
        assert conn.execute("SELECT name, tier FROM api_keys WHERE id = %s", (row["id"],)).fetchone() == (
            "remote",
            "paid",
        )

    # ... and it opens the deployed bento, served with the deployment's state (tuneloop serve).
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with service(
        [TUNELOOP, "serve", "--port", str(port)],
        f"{url}/readyz",
        remote["tmp"] / "serve.log",
        env=env,
        timeout=300,
        cwd=ROOT,
    ):
        assert httpx.get(f"{url}/v1/models", timeout=10).status_code == 401
        r = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {row['key']}"}, timeout=10)
        assert r.status_code == 200, r.text
        assert f"{name}:{version}" in json.dumps(r.json())
        _run([TUNELOOP, "keys", "revoke", row["id"]], env)
        r = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {row['key']}"}, timeout=10)
        assert r.status_code == 401 and "revoked" in r.json()["error"]["message"]


# ---- promotion across machines -------------------------------------------------------------


def _promoter(uri: str, name: str, lock_path: str, tasks, results, start, hold) -> None:
    """One "machine": its own process and lock file; shares only the MLflow server."""
    from tuneloop.registry import ModelRegistry, PromotionConflict

    reg = ModelRegistry(uri, name, lock_path=Path(lock_path))
    settled = reg._settled
    forced = {"on": False}

    def settled_then_hold():
        state = settled()
        if forced["on"]:  # both promoters have seen the same champion before either writes
            hold.wait(timeout=120)
        return state

    reg._settled = settled_then_hold
    while (task := tasks.get(timeout=600)) is not None:
        version, expected, forced["on"] = task
        start.wait(timeout=120)
        try:
            reg.promote(version, expected_champion=expected, reason=f"race {version}", actor=f"pid-{os.getpid()}")
            results.put(("promoted", version, None))
        except PromotionConflict as exc:
            results.put(("refused", version, exc.actual))
        except Exception as exc:  # noqa: BLE001 - reported to the test, which fails on it
            results.put(("error", version, repr(exc)))


def test_promotion_is_compare_and_set_across_machines(remote):
    from mlflow.tracking import MlflowClient

    from tuneloop.registry import ModelRegistry

    uri, name, rounds = remote["mlflow"], "remote-race", 6
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    experiment = client.create_experiment("remote-race")  # artifacts: the server's, over HTTP
    run = client.create_run(experiment)
    model_dir = remote["tmp"] / "race-model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text('{"model_type": "gpt2"}')
    reg = ModelRegistry(uri, name, lock_path=remote["tmp"] / "parent.lock")
    first = reg.register(run.info.run_id, model_dir, tags={"blessed": "true"})
    source = reg.version(first).source
    versions = [first] + [
        str(client.create_model_version(name, source, run.info.run_id, tags={"blessed": "true"}).version)
        for _ in range(2 * rounds)
    ]
    reg.promote(first, expected_champion=None, reason="first", actor="test")

    ctx = mp.get_context("spawn")
    start, hold, results = ctx.Barrier(2), ctx.Barrier(2), ctx.Queue()
    tasks = [ctx.Queue(), ctx.Queue()]
    procs = [
        ctx.Process(
            target=_promoter, args=(uri, name, str(remote["tmp"] / f"machine-{i}.lock"), tasks[i], results, start, hold)
        )
        for i in range(2)
    ]
    for p in procs:
        p.start()
    champion, chain = first, [(None, first)]
    try:
        for r in range(rounds):
            mine = versions[1 + 2 * r : 3 + 2 * r]
            forced = r % 2 == 0  # even rounds: both past the pre-check, the log decides
            for q, v in zip(tasks, mine):
                q.put((v, champion, forced))
            outcomes = sorted([results.get(timeout=300) for _ in procs])
            assert not [o for o in outcomes if o[0] == "error"], outcomes
            promoted = [o for o in outcomes if o[0] == "promoted"]
            refused = [o for o in outcomes if o[0] == "refused"]
            assert len(promoted) == 1 and len(refused) == 1, (r, outcomes)
            winner = promoted[0][1]
            assert refused[0][2] == winner, f"round {r}: the loser saw {refused[0][2]}, the winner is {winner}"
            assert reg.champion().version == winner and reg.previous().version == champion
            chain.append((champion, winner))
            champion = winner
    finally:
        for q in tasks:
            q.put(None)
        for p in procs:
            p.join(timeout=60)
    assert [p.exitcode for p in procs] == [0, 0]

    history = reg.history()
    assert [(h.action, h.from_version, h.to_version) for h in history] == [("promote", f, t) for f, t in chain]
    assert [h.seq for h in history] == list(range(1, rounds + 2))
    assert reg.champion().version == champion and reg.repair().champion == champion
    log = {str(mv.version): mv.tags for mv in client.search_model_versions(f"name = '{name}.promotion-log'")}
    outcomes = sorted(t.get("outcome") for t in log.values())
    # every forced round left its loser's request in the log, refused by the replay
    assert outcomes.count("applied") == rounds + 1 and outcomes.count("refused") >= (rounds + 1) // 2, outcomes
    print(
        f"\n{rounds} rounds across 2 processes: {outcomes.count('refused')} requests refused by the log, "
        f"{rounds - outcomes.count('refused')} before it (the champion had already moved)"
    )


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
