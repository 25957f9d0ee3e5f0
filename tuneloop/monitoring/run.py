"""One monitoring run: a window of the request log against the champion's reference and
the SLOs; reports written; the events to emit decided (and emitted by the caller's
`emit`). Used by flows/monitoring.py and `tuneloop monitor`."""

from __future__ import annotations

import json
import shutil
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from tuneloop.data.formats import load_file
from tuneloop.monitoring.drift import compute_drift, drift_report_html
from tuneloop.monitoring.exporter import LATEST  # the scores the bento exports as Prometheus gauges
from tuneloop.monitoring.reference import load_reference
from tuneloop.monitoring.slo import GENERATION_ROUTES, service_health
from tuneloop.monitoring.texts import record_text
from tuneloop.registry import ModelRegistry
from tuneloop.requestlog.feedback import export_feedback_dataset, export_preference_dataset
from tuneloop.requestlog.store import parse_since, read_records

RETRAIN_EVENT = "tuneloop.retrain.requested"
SLO_EVENT = "tuneloop.slo.breached"


def _stamp(t: datetime) -> str:
    return t.strftime("%Y%m%dT%H%M%SZ")


def _state(cfg) -> dict:
    path = cfg.monitoring_dir / "state.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _save_state(cfg, state: dict) -> None:
    cfg.monitoring_dir.mkdir(parents=True, exist_ok=True)
    tmp = cfg.monitoring_dir / "state.json.tmp"
    tmp.write_text(json.dumps(state, indent=2))
    tmp.replace(cfg.monitoring_dir / "state.json")


def retrain_dataset(cfg, folder: Path, since: datetime | None) -> dict:
    """The data a triggered retrain uses, in folder/data: the base training set plus the
    candidate rows from feedback given since `since` (the champion's registration), side by
    side (prepare_dataset reads a folder's files in name order, each in its own format);
    their lineage in folder/lineage.json. A base set of preference pairs (OpenAI's DPO format:
    a retrain with training.objective dpo) takes the feedback's preference pairs instead."""
    data = folder / "data"
    data.mkdir(parents=True, exist_ok=True)
    base = cfg.resolve(cfg.data.train_path)
    copied, kinds = [], set()
    for f in [base] if base.is_file() else sorted(p for p in base.iterdir() if p.is_file()):
        shutil.copyfile(f, data / f"0-base-{f.name}")
        copied.append(str(f))
        fmt = load_file(f, cfg.data.format).format
        kinds.add(fmt if fmt in ("legacy", "dpo") else "chat")
    # Feedback rows join the base set only in its kind (raw prompt/completion, conversations or
    # preference pairs); the others are counted in the lineage's `rejected`, with the reason.
    kind = kinds.pop() if len(kinds) == 1 else None
    feedback = data / "1-feedback.jsonl"
    if kind == "dpo":
        lineage = export_preference_dataset(cfg, feedback, since, lineage_path=folder / "lineage.json")
    else:
        lineage = export_feedback_dataset(cfg, feedback, since, lineage_path=folder / "lineage.json", kind=kind)
    if not lineage["rows"]:
        feedback.unlink()
    out = {
        "path": str(data),
        "base": copied,
        "feedback_rows": lineage["rows"],
        "feedback_ids": lineage["feedback_ids"],
        "feedback_since": since.isoformat() if since else None,
    }
    (folder / "lineage.json").write_text(json.dumps({**lineage, **out}, indent=2))
    return out


def _champion_since(cfg) -> datetime | None:
    from mlflow.tracking import MlflowClient

    champion = ModelRegistry.from_config(cfg).champion()
    if champion is None:
        return None
    mv = MlflowClient(cfg.mlflow_tracking_uri, registry_uri=cfg.mlflow_tracking_uri).get_model_version(
        champion.name, champion.version
    )
    return datetime.fromtimestamp(mv.creation_timestamp / 1000, timezone.utc)


def summary_markdown(result: dict) -> str:
    d, s = result["drift"], result["slo"]
    lines = [
        f"# Monitoring {result['window']['since']} → {result['window']['until']}",
        "",
        f"{result['window']['requests']} logged requests; reference: {result['reference'].get('source')} "
        f"(model version {result['reference'].get('version')})",
        "",
    ]
    verdict = ("**drift detected**" if d["detected"] else "no drift") if d["judged"] else f"not judged: {d['reason']}"
    lines += [f"## Drift: {verdict}", "", "| score | value | threshold | drifted |", "|---|---|---|---|"]
    for k, v in d["scores"].items():
        lines.append(f"| {k} | {v} | {d['thresholds'][k]} | {'yes' if k in d['drifted'] else ''} |")
    verdict = (
        ("**SLO breached: " + ", ".join(s["breached"]) + "**" if s["breached"] else "within SLOs")
        if s["judged"]
        else f"not judged: {s['reason']}"
    )
    lines += ["", f"## Service: {verdict}", "", "| measure | value | objective |", "|---|---|---|"]
    for k, v in s["values"].items():
        lines.append(f"| {k} | {v} | {s['objectives'].get(k, '')} |")
    lines += [
        "",
        "counts: " + ", ".join(f"{k} {v}" for k, v in s["counts"].items()),
        "",
        "events: " + (", ".join(e["event"] for e in result["events"]) or "none"),
    ]
    if result.get("report"):
        lines += ["", f"Evidently report: {result['report']}"]
    return "\n".join(lines) + "\n"


def monitor(
    cfg,
    since: datetime | None = None,
    until: datetime | None = None,
    emit: Callable[[str, dict], None] | None = None,
    progress: Callable[[str], None] = print,
    report: bool = True,
) -> dict:
    """Run once over [since, until) (default: the last monitoring.window); returns the result
    (also written as JSON and markdown under <home>/monitoring/<stamp>/)."""
    started = time.perf_counter()
    m = cfg.monitoring
    until = until or datetime.now(timezone.utc)
    since = since or parse_since(m.window, until)
    records = read_records(cfg.request_log.url, cfg.home, "requests", since, until)
    progress(f"monitoring: {len(records)} logged requests from {since.isoformat()} to {until.isoformat()}")
    texts = [t for t in (record_text(r) for r in records if r.get("route") in GENERATION_ROUTES) if t]
    reference, ref_info = load_reference(cfg)
    progress(f"monitoring: reference {len(reference)} prompts ({ref_info['source']}); {len(texts)} served prompts")
    drift = compute_drift(reference, texts, m.drift)
    slo = service_health(records, m.slo)
    out = cfg.monitoring_dir / _stamp(until)
    out.mkdir(parents=True, exist_ok=True)
    result = {
        "window": {
            "since": since.isoformat(),
            "until": until.isoformat(),
            "requests": len(records),
            "prompts": len(texts),
        },
        "reference": ref_info,
        "drift": drift.to_dict(),
        "slo": slo.to_dict(),
        "events": [],
        "report": None,
        "dir": str(out),
    }
    if report and drift.judged:
        progress("monitoring: writing the Evidently report ...")
        result["report"] = str(drift_report_html(reference, texts, out / "drift-report.html", m.drift))
    state = _state(cfg)
    if drift.detected:
        last = state.get("last_retrain_requested")
        quiet = last is None or time.time() - float(last) >= m.retrain_debounce_s
        if quiet:
            data = retrain_dataset(cfg, cfg.home / "retrain" / _stamp(until), _champion_since(cfg))
            payload = {
                "scores": drift.scores,
                "drifted": drift.drifted,
                "window": result["window"],
                "data_path": data["path"],
                "feedback_rows": data["feedback_rows"],
                "feedback_ids": data["feedback_ids"],
                "reference_version": ref_info.get("version"),
                "init_from": m.retrain_init_from,
                "report": result["report"],
            }
            result["events"].append({"event": RETRAIN_EVENT, "payload": payload})
            state["last_retrain_requested"] = time.time()
        else:
            result["debounced"] = (
                f"drift again, but a retrain was requested {time.time() - float(last):.0f} s ago "
                f"(monitoring.retrain_debounce_s {m.retrain_debounce_s:g})"
            )
            progress(f"monitoring: {result['debounced']}")
    if slo.breached:
        result["events"].append(
            {
                "event": SLO_EVENT,
                "payload": {
                    "breached": slo.breached,
                    "values": slo.values,
                    "objectives": slo.objectives,
                    "window": result["window"],
                },
            }
        )
    if emit is not None and m.emit_events:
        for e in result["events"]:
            emit(e["event"], e["payload"])
    _save_state(cfg, state)
    result["seconds"] = round(time.perf_counter() - started, 2)
    (out / "result.json").write_text(json.dumps(result, indent=2, default=str))
    (out / "summary.md").write_text(summary_markdown(result))
    latest = {
        "time": until.isoformat(),
        "drift_detected": drift.detected,
        "drift_judged": drift.judged,
        "scores": drift.scores,
        "slo": slo.values,
        "slo_breached": slo.breached,
        "reference_version": ref_info.get("version"),
    }
    (cfg.monitoring_dir / LATEST).write_text(json.dumps(latest, indent=2))
    return result
