"""The monitoring components on real text: drift calibration (no alarm on traffic from the
training distribution over seeds and window sizes; a real topic shift caught), service
health against SLOs, and one monitoring run over a request log: reports, the champion's
reference, the retrain event with its data (base set + feedback rows) and its debounce."""

from __future__ import annotations

import json
import random
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from tests.support import ROOT
from tests.support.servers import prefect_home

SAMPLE = ROOT / "data" / "sample" / "train.jsonl"
INJECTIONS = ROOT.parent / "shared" / "data" / "prompt-injections" / "train.parquet"
needs_shift = pytest.mark.skipif(not INJECTIONS.exists(), reason=f"{INJECTIONS} is absent (the shifted traffic)")


def sample_prompts() -> list[str]:
    rows = [json.loads(line)["messages"] for line in SAMPLE.read_text().splitlines() if line.strip()]
    return [[m["content"] for m in r if m["role"] == "user"][-1] for r in rows]


def shifted_prompts() -> list[str]:
    import pandas as pd

    df = pd.read_parquet(INJECTIONS)
    return df[df.label == 0].text.astype(str).tolist()  # benign, everyday questions: another topic


def drift_cfg(**kw):
    from tuneloop.config import DriftConfig

    return DriftConfig(**kw)


@needs_shift
def test_drift_thresholds_raise_no_false_alarm_and_catch_a_topic_shift():
    from tuneloop.monitoring.drift import compute_drift

    texts = sample_prompts()
    random.Random(0).shuffle(texts)
    reference, held_out = texts[:800], texts[800:]  # held-out: unseen rows of the training distribution
    shift = shifted_prompts()
    cfg = drift_cfg()
    false_alarms, detections, rows = 0, 0, []
    for n in (50, 100, 200):
        for seed in range(3):
            rng = random.Random(seed)
            same = compute_drift(reference, rng.sample(held_out, n), cfg, seed)
            moved = compute_drift(reference, rng.sample(shift, n), cfg, seed)
            false_alarms += same.detected
            detections += moved.detected
            rows.append((n, seed, same.scores, moved.scores))
    for n, seed, same, moved in rows:
        print(f"n={n} seed={seed}\n  same  {same}\n  shift {moved}")
    print(f"false alarms {false_alarms}/9, detections {detections}/9")
    assert false_alarms == 0
    assert detections == 9


def test_too_few_prompts_are_not_judged():
    from tuneloop.monitoring.drift import compute_drift

    r = compute_drift(sample_prompts()[:100], ["hello"] * 10, drift_cfg())
    assert not r.judged and not r.detected and "fewer than" in r.reason


def test_service_health_against_slos():
    from tuneloop.config import SloConfig
    from tuneloop.monitoring.slo import service_health

    ok = [
        {
            "route": "/v1/chat/completions",
            "status": 200,
            "ttft_s": 0.1 * (i % 10 + 1),
            "latency_s": 1.0 + i % 5,
            "error_code": None,
        }
        for i in range(90)
    ]
    bad = [{"route": "/v1/chat/completions", "status": 500, "error_code": "internal_error"}] * 4
    filtered = [{"route": "/v1/completions", "status": 400, "error_code": "content_filter"}] * 3
    limited = [{"route": "/v1/models", "status": 429, "error_code": "rate_limit_exceeded"}] * 3
    r = service_health(ok + bad + filtered + limited, SloConfig(ttft_p95_s=0.5))
    assert r.judged and r.counts["generations"] == 97 and r.counts["errors"] == 4
    assert r.values["error_rate"] == round(4 / 97, 4) and r.values["ttft_p95_s"] == 1.0
    assert set(r.breached) == {"ttft_p95_s", "error_rate"}
    assert not service_health(ok[:5], SloConfig()).judged


def write_log(home: Path, prompts: list[str], start: datetime, key_id: str = "k1") -> list[dict]:
    from tuneloop.requestlog.record import utc_iso
    from tuneloop.requestlog.store import SegmentSink

    sink = SegmentSink(home / "requests", 1 << 24, 3600)
    records = []
    for i, p in enumerate(prompts):
        t = start + timedelta(seconds=i)
        records.append(
            {
                "kind": "request",
                "request_id": f"req_{random.getrandbits(128):032x}",
                "response_id": f"chatcmpl-{random.getrandbits(128):032x}",
                "time": utc_iso(t.timestamp()),
                "route": "/v1/chat/completions",
                "status": 200,
                "key_id": key_id,
                "prompt": [{"role": "user", "content": p}],
                "completions": ["ok"],
                "ttft_s": 0.05,
                "latency_s": 0.4,
                "error_code": None,
                "prompt_tokens": 10,
                "completion_tokens": 2,
            }
        )
    sink.write("requests", records)
    sink.close()
    return records


def test_a_retrain_set_takes_feedback_only_in_its_own_kind(tmp_path):
    """A legacy prompt/completion base set (e.g. T0) with corrections to a chat request and to
    a completions request: the completions one joins it, the chat one is counted out with the
    reason, and the set prepares (mixing the kinds is refused by prepare_dataset; make
    demo-smollm2's retrain once stopped on that, then on two identical corrections)."""
    from tuneloop.config import TuneloopConfig
    from tuneloop.data.dataset import prepare_dataset
    from tuneloop.monitoring.run import retrain_dataset
    from tuneloop.requestlog.store import SegmentSink

    base = tmp_path / "legacy.jsonl"
    base.write_text(
        "".join(
            json.dumps({"prompt": f"Review {i}: fine. Positive or negative?", "completion": " Positive"}) + "\n"
            for i in range(30)
        )
    )
    cfg = TuneloopConfig.model_validate({"paths": {"home": str(tmp_path / "home")}, "data": {"train_path": str(base)}})
    chat = write_log(cfg.home, ["Plan a weekend in Rome."], datetime.now(timezone.utc))[0]
    sink = SegmentSink(cfg.home / "requests", 1 << 20, 3600)
    raw = {
        **chat,
        "request_id": "req_legacy",
        "response_id": "cmpl-1",
        "route": "/v1/completions",
        "prompt": "Review 99: broke in a day. Positive or negative?",
    }
    again = {**raw, "request_id": "req_legacy_2", "response_id": "cmpl-2"}  # the same prompt, asked twice
    sink.write("requests", [raw, again])
    sink.write(
        "feedback",
        [
            {
                "kind": "feedback",
                "feedback_id": f"fb_{i}",
                "time": r["time"],
                "request_id": r["request_id"],
                "key_id": "k1",
                "rating": -1,
                "correction": text,
                "comment": None,
            }
            for i, (r, text) in enumerate([(chat, "Book the museum early."), (raw, " Negative"), (again, " Negative")])
        ],
    )
    sink.close()

    out = retrain_dataset(cfg, tmp_path / "retrain", since=None)
    assert out["feedback_rows"] == 1 and out["feedback_ids"] == ["fb_1"]
    rows = [json.loads(line) for line in (Path(out["path"]) / "1-feedback.jsonl").read_text().splitlines()]
    assert rows == [{"prompt": raw["prompt"], "completion": " Negative"}]
    lineage = json.loads((tmp_path / "retrain" / "lineage.json").read_text())
    assert lineage["rejected"] == {
        "a chat request, and the training set is legacy prompt/completion rows": 1,
        "the same row as another correction": 1,
    }  # the gate refuses duplicates
    prepared = prepare_dataset(cfg, train_path=Path(out["path"]))
    assert len(prepared.train) + len(prepared.eval) == 31


@needs_shift
def test_a_monitoring_run_reports_and_requests_one_retrain_with_feedback_data(tmp_path):
    from tuneloop.config import TuneloopConfig
    from tuneloop.monitoring.run import RETRAIN_EVENT, monitor
    from tuneloop.requestlog.store import SegmentSink

    cfg = TuneloopConfig.model_validate(
        {"paths": {"home": str(tmp_path / "home")}, "data": {"train_path": str(SAMPLE)}}
    )
    now = datetime.now(timezone.utc).replace(microsecond=0)
    texts = sample_prompts()
    write_log(cfg.home, random.Random(1).sample(texts, 150), now - timedelta(hours=3))
    emitted = []
    calm = monitor(
        cfg, since=now - timedelta(hours=4), until=now - timedelta(hours=2), emit=lambda e, p: emitted.append(e)
    )
    assert calm["drift"]["judged"] and not calm["drift"]["detected"], calm["drift"]
    assert calm["reference"]["source"] == "data.train_path"  # no champion yet: the configured set, said so
    assert calm["events"] == [] and emitted == []
    assert Path(calm["report"]).exists() and Path(calm["dir"], "summary.md").exists()

    shifted = write_log(cfg.home, random.Random(2).sample(shifted_prompts(), 150), now - timedelta(minutes=50))
    feedback = SegmentSink(cfg.home / "requests", 1 << 20, 3600)
    feedback.write(
        "feedback",
        [
            {
                "kind": "feedback",
                "feedback_id": "fb_1",
                "time": shifted[0]["time"],
                "request_id": shifted[0]["request_id"],
                "key_id": "k1",
                "rating": -1,
                "correction": "A better answer.",
                "comment": None,
            }
        ],
    )
    feedback.close()
    result = monitor(cfg, emit=lambda e, p: emitted.append((e, p)))
    assert result["drift"]["detected"], result["drift"]
    assert [e["event"] for e in result["events"]] == [RETRAIN_EVENT] and emitted[0][0] == RETRAIN_EVENT
    payload = emitted[0][1]
    assert payload["feedback_rows"] == 1 and payload["feedback_ids"] == ["fb_1"]
    data = Path(payload["data_path"])
    files = sorted(p.name for p in data.iterdir())
    assert files == ["0-base-train.jsonl", "1-feedback.jsonl"]
    assert json.loads((data.parent / "lineage.json").read_text())["feedback_ids"] == ["fb_1"]
    from tuneloop.data.dataset import prepare_dataset

    prepared = prepare_dataset(cfg, train_path=data)  # the triggered run's data loads as any training set
    assert len(prepared.train) + len(prepared.eval) == len(texts) + 1
    latest = json.loads((cfg.monitoring_dir / "latest.json").read_text())
    assert latest["drift_detected"] and latest["scores"] == result["drift"]["scores"]
    again = monitor(cfg, emit=lambda e, p: emitted.append((e, p)))  # the next window drifts too: debounced
    assert again["drift"]["detected"] and again["events"] == [] and "debounced" in again
    assert len(emitted) == 1

    # the same through the CLI (the Prefect flow on an ephemeral server; MLflow run logged)
    import os
    import subprocess
    import sys

    env = {
        **os.environ,
        "TUNELOOP_HOME": str(cfg.home),
        "TUNELOOP__DATA__TRAIN_PATH": str(SAMPLE),
        "TUNELOOP__MONITORING__RETRAIN_DEBOUNCE_S": "0",
        "PREFECT_HOME": str(prefect_home(tmp_path / "prefect")),
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    }
    out = subprocess.run(
        [sys.executable, "-m", "tuneloop.cli", "monitor", "--since", "1h", "--json"],
        env=env,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    cli = json.loads(out.stdout[out.stdout.index("{\n") :])
    assert cli["drift"]["detected"] is True and set(cli["drift"]["scores"]) >= {"embeddings", "text_length"}
    assert cli["events"] == [RETRAIN_EVENT] and cli["slo"]["judged"] is True and cli["mlflow_run_id"]
    import mlflow

    run = mlflow.tracking.MlflowClient(cfg.mlflow_tracking_uri, registry_uri=cfg.mlflow_tracking_uri).get_run(
        cli["mlflow_run_id"]
    )
    assert run.data.metrics["drift_detected"] == 1.0
    artifacts = [
        a.path
        for a in mlflow.tracking.MlflowClient(
            cfg.mlflow_tracking_uri, registry_uri=cfg.mlflow_tracking_uri
        ).list_artifacts(cli["mlflow_run_id"], "monitoring")
    ]
    assert "monitoring/drift-report.html" in artifacts and "monitoring/summary.md" in artifacts
