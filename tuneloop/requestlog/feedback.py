"""Feedback -> candidate training examples.

A corrected completion (POST /v1/feedback `correction`) for a logged request becomes one
training row in the training set's own format: chat requests give `{"messages": [...the
logged prompt..., {"role": "assistant", "content": correction}]}`, completions give
`{"prompt", "completion"}`. It is only a candidate: the rows go through the same data
preparation and validation gate (Great Expectations) as any training file before training
sees them. Joined on the request id (x-request-id or the response id) and kept only when the
feedback came from the key that made the request (one tenant cannot teach the model with
another's traffic); the latest correction per request wins. Ratings alone make no rows.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from tuneloop.requestlog.store import read_records

# A training set is either legacy prompt/completion rows (raw text) or conversations: rows of
# the other kind cannot join it (tuneloop/data/dataset.py refuses the mix).
_OTHER_KIND = {
    "legacy": "a chat request, and the training set is legacy prompt/completion rows",
    "chat": "a completions request, and the training set is conversations",
}


def feedback_examples(requests: list[dict], feedback: list[dict], kind: str | None = None) -> tuple[list[dict], dict]:
    """(rows, lineage {feedback_ids, request_ids, rejected: {reason: n}}). kind "legacy" or
    "chat": only rows of that kind (the training set they are to join); the others are
    counted as rejected, with the reason."""
    by_id: dict[str, dict] = {}
    for r in requests:
        by_id[r["request_id"]] = r
        if r.get("response_id"):
            by_id[r["response_id"]] = r
    latest: dict[str, dict] = {}
    rejected: Counter[str] = Counter()
    for fb in sorted(feedback, key=lambda f: f.get("time", "")):
        if fb.get("correction") is None:
            rejected["no correction (rating only)" if fb.get("texts_omitted") is None else "texts not logged"] += 1
            continue
        req = by_id.get(fb.get("request_id", ""))
        if req is None:
            rejected["unknown request"] += 1
            continue
        if req.get("key_id") != fb.get("key_id"):
            rejected["from another key than the request"] += 1
            continue
        if req.get("prompt") is None:
            rejected["the request's prompt was not logged"] += 1
            continue
        if req.get("status") != 200 or req.get("route") not in ("/v1/chat/completions", "/v1/completions"):
            rejected["not a successful generation"] += 1
            continue
        if req["request_id"] in latest:
            rejected["superseded by a later correction"] += 1
        latest[req["request_id"]] = {"feedback": fb, "request": req}
    rows, feedback_ids, seen = [], [], set()
    for item in latest.values():
        req, fb = item["request"], item["feedback"]
        prompt = req["prompt"]
        if req["route"] == "/v1/chat/completions":
            row = {"messages": [*prompt, {"role": "assistant", "content": fb["correction"]}]}
        elif isinstance(prompt, str):
            row = {"prompt": prompt, "completion": fb["correction"]}
        else:
            rejected["a multi-prompt completion request"] += 1
            continue
        if kind is not None and ("prompt" in row) != (kind == "legacy"):
            rejected[_OTHER_KIND[kind]] += 1
            continue
        # The same correction to the same prompt on two requests is one example (the gate
        # refuses duplicate rows); the other is counted out.
        same = json.dumps(row, sort_keys=True, ensure_ascii=False)
        if same in seen:
            rejected["the same row as another correction"] += 1
            continue
        seen.add(same)
        rows.append(row)
        feedback_ids.append(fb["feedback_id"])
    lineage = {
        "feedback_ids": feedback_ids,
        "request_ids": [i for i in latest],
        "rows": len(rows),
        "rejected": dict(rejected),
    }
    return rows, lineage


def export_feedback_dataset(
    cfg, output: Path, since=None, lineage_path: Path | None = None, kind: str | None = None
) -> dict:
    """Write the candidate rows of feedback given since `since` to output (JSONL) and its
    lineage to lineage_path (default <output>.lineage.json); returns the lineage. kind: as
    feedback_examples (None: rows of both kinds)."""
    requests = read_records(cfg.request_log.url, cfg.home, "requests")
    fb = read_records(cfg.request_log.url, cfg.home, "feedback", since)
    rows, lineage = feedback_examples(requests, fb, kind)
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    lineage["since"] = since.isoformat() if since is not None else None
    lineage["path"] = str(output)
    Path(lineage_path or f"{output}.lineage.json").write_text(json.dumps(lineage, indent=2), encoding="utf-8")
    return lineage
