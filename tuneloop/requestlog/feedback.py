"""Feedback -> candidate training examples.

A corrected completion (POST /v1/feedback `correction`) for a logged request becomes one
training row in the training set's own format: chat requests give `{"messages": [...the
logged prompt..., {"role": "assistant", "content": correction}]}`, completions give
`{"prompt", "completion"}`. It is only a candidate: the rows go through the same data
preparation and validation gate (Great Expectations) as any training file before training
sees them. Joined on the request id (x-request-id or the response id) and kept only when the
feedback came from the key that made the request (one tenant cannot teach the model with
another's traffic); the latest correction per request wins. Ratings alone make no rows.

Preference pairs (export_preference_dataset: OpenAI's DPO format, what a retrain with
training.objective dpo trains on) come from chat requests, under the same join and key rule:

- a `preference` (POST /v1/feedback {"request_id", "preference": {"chosen", "rejected"}}): the
  logged prompt with the two completions as given;
- a `correction`: the correction preferred to the completion the request got (one choice);
- `rating`s: two requests from the same key with the same prompt whose answers (one choice
  each) were rated differently make a pair, the higher-rated answer preferred; every higher
  with every lower one.

The latest feedback of each kind per request wins; the same pair twice is one row; every row
meets the data contract (tuneloop/data/formats.py) before it is written, and what is left
out is counted in the lineage's `rejected`, with the reason.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

from tuneloop.data.formats import row_problem
from tuneloop.requestlog.store import read_records

# A training set is either legacy prompt/completion rows (raw text) or conversations: rows of
# the other kind cannot join it (tuneloop/data/dataset.py refuses the mix).
_OTHER_KIND = {
    "legacy": "a chat request, and the training set is legacy prompt/completion rows",
    "chat": "a completions request, and the training set is conversations",
}


# routes whose logged prompt is chat messages (the Responses API is logged as the chat it means)
CHAT_ROUTES = ("/v1/chat/completions", "/v1/responses")


def _by_id(requests: list[dict]) -> dict[str, dict]:
    """Each request by its request id and, when it has one, its response id."""
    by_id: dict[str, dict] = {}
    for r in requests:
        by_id[r["request_id"]] = r
        if r.get("response_id"):
            by_id[r["response_id"]] = r
    return by_id


def _generation(fb: dict, by_id: dict[str, dict]) -> tuple[dict | None, str | None]:
    """(the logged generation the feedback is about, None) or (None, why it cannot be used)."""
    req = by_id.get(fb.get("request_id", ""))
    if req is None:
        return None, "unknown request"
    if req.get("key_id") != fb.get("key_id"):
        return None, "from another key than the request"
    if req.get("prompt") is None:
        return None, "the request's prompt was not logged"
    if req.get("status") != 200 or req.get("route") not in CHAT_ROUTES + ("/v1/completions",):
        return None, "not a successful generation"
    return req, None


def feedback_examples(requests: list[dict], feedback: list[dict], kind: str | None = None) -> tuple[list[dict], dict]:
    """(rows, lineage {feedback_ids, request_ids, rejected: {reason: n}}). kind "legacy" or
    "chat": only rows of that kind (the training set they are to join); the others are
    counted as rejected, with the reason."""
    by_id = _by_id(requests)
    latest: dict[str, dict] = {}
    rejected: Counter[str] = Counter()
    for fb in sorted(feedback, key=lambda f: f.get("time", "")):
        if fb.get("correction") is None:
            if fb.get("texts_omitted") is not None:
                rejected["texts not logged"] += 1
            elif fb.get("chosen") is not None:
                rejected["no correction (a preference pair: export_preference_dataset)"] += 1
            else:
                rejected["no correction (rating only)"] += 1
            continue
        req, why = _generation(fb, by_id)
        if req is None:
            rejected[str(why)] += 1
            continue
        if req["request_id"] in latest:
            rejected["superseded by a later correction"] += 1
        latest[req["request_id"]] = {"feedback": fb, "request": req}
    rows, feedback_ids, seen = [], [], set()
    for item in latest.values():
        req, fb = item["request"], item["feedback"]
        prompt = req["prompt"]
        if req["route"] in CHAT_ROUTES:
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
    return _write(rows, lineage, output, since, lineage_path)


def _usable(fb: dict, by_id: dict[str, dict]) -> tuple[dict | None, str | None]:
    """(the chat request the feedback is about, None) or (None, why it cannot make a pair)."""
    req, why = _generation(fb, by_id)
    if req is not None and req["route"] not in CHAT_ROUTES:
        return None, "a completions request: preference pairs are conversations"
    return req, why


def _answer(req: dict) -> str | None:
    """The completion the request got, when it asked for one and it was logged."""
    completions = req.get("completions") or []
    return completions[0] if len(completions) == 1 and isinstance(completions[0], str) else None


def _pair(prompt: list, chosen: str, rejected: str) -> dict:
    return {
        "input": {"messages": prompt},
        "preferred_output": [{"role": "assistant", "content": chosen}],
        "non_preferred_output": [{"role": "assistant", "content": rejected}],
    }


def preference_examples(requests: list[dict], feedback: list[dict]) -> tuple[list[dict], dict]:
    """(rows in OpenAI's DPO format, lineage {feedback_ids, request_ids, rows, sources:
    {preference, correction, ratings: n rows}, rejected: {reason: n}}): see the module doc."""
    by_id = _by_id(requests)
    rejected: Counter[str] = Counter()
    latest: dict[str, dict[str, dict]] = {"preference": {}, "correction": {}, "rating": {}}
    for fb in sorted(feedback, key=lambda f: f.get("time", "")):
        kinds = [
            k
            for k, present in (
                ("preference", fb.get("chosen") is not None and fb.get("rejected") is not None),
                ("correction", fb.get("correction") is not None),
                ("rating", fb.get("rating") is not None),
            )
            if present
        ]
        if not kinds:
            rejected[
                "texts not logged" if fb.get("texts_omitted") is not None else "no rating, correction or preference"
            ] += 1
            continue
        req, why = _usable(fb, by_id)
        if req is None:
            rejected[str(why)] += 1
            continue
        for kind in kinds:
            if req["request_id"] in latest[kind]:
                rejected[f"superseded by a later {kind}"] += 1
            latest[kind][req["request_id"]] = {"feedback": fb, "request": req}

    candidates: list[tuple[str, dict, list[str]]] = []  # (source, row, feedback ids)
    for item in latest["preference"].values():
        fb, req = item["feedback"], item["request"]
        candidates.append(("preference", _pair(req["prompt"], fb["chosen"], fb["rejected"]), [fb["feedback_id"]]))
    for item in latest["correction"].values():
        fb, req = item["feedback"], item["request"]
        answer = _answer(req)
        if answer is None:
            rejected["a correction without the one answer it corrects (not logged, or several choices)"] += 1
        elif answer == fb["correction"]:
            rejected["a correction equal to the answer it corrects"] += 1
        else:
            candidates.append(("correction", _pair(req["prompt"], fb["correction"], answer), [fb["feedback_id"]]))
    groups: dict[str, list[tuple[int, str, dict]]] = {}
    for item in latest["rating"].values():
        fb, req = item["feedback"], item["request"]
        answer = _answer(req)
        if answer is None:
            rejected["a rating of no one logged answer (not logged, or several choices)"] += 1
            continue
        same = json.dumps([req.get("key_id"), req["prompt"]], sort_keys=True, ensure_ascii=False)
        groups.setdefault(same, []).append((fb["rating"], answer, item))
    for rated in groups.values():
        paired = set()
        for hi_rating, hi_answer, hi in rated:
            for lo_rating, lo_answer, lo in rated:
                if hi_rating > lo_rating and hi_answer != lo_answer:
                    ids = [hi["feedback"]["feedback_id"], lo["feedback"]["feedback_id"]]
                    candidates.append(("ratings", _pair(hi["request"]["prompt"], hi_answer, lo_answer), ids))
                    paired.update(ids)
        unpaired = sum(item["feedback"]["feedback_id"] not in paired for _, _, item in rated)
        if unpaired:
            rejected["a rating with no differently rated answer to the same prompt"] += unpaired

    rows: list[dict] = []
    feedback_ids: list[str] = []
    request_ids: list[str] = []
    sources: Counter[str] = Counter()
    seen: set[str] = set()
    used: set[str] = set()  # ids already listed (feedback and request ids never collide: fb_ vs req_/chatcmpl-)
    for source, row, ids in candidates:
        problem = row_problem(row, "dpo")
        if problem is not None:
            rejected["fails the data contract: " + re.sub(r"\d+", "N", problem)] += 1
            continue
        same = json.dumps(row, sort_keys=True, ensure_ascii=False)
        if same in seen:
            rejected["the same pair as another feedback's"] += 1
            continue
        seen.add(same)
        rows.append(row)
        sources[source] += 1
        feedback_ids += [i for i in ids if i not in used]
        used.update(ids)
    for kind in latest.values():
        request_ids += [rid for rid in kind if rid not in used]
        used.update(kind)
    lineage = {
        "feedback_ids": feedback_ids,
        "request_ids": request_ids,
        "rows": len(rows),
        "sources": dict(sources),
        "rejected": dict(rejected),
    }
    return rows, lineage


def export_preference_dataset(cfg, output: Path, since=None, lineage_path: Path | None = None) -> dict:
    """Write the preference pairs of feedback given since `since` to output (JSONL in OpenAI's
    DPO format: a preference tuning file, or the feedback part of a dpo retrain set) and their
    lineage to lineage_path (default <output>.lineage.json); returns the lineage."""
    requests = read_records(cfg.request_log.url, cfg.home, "requests")
    fb = read_records(cfg.request_log.url, cfg.home, "feedback", since)
    rows, lineage = preference_examples(requests, fb)
    return _write(rows, lineage, output, since, lineage_path)


def _write(rows: list[dict], lineage: dict, output: Path, since, lineage_path: Path | None) -> dict:
    """rows to output (JSONL), the lineage (with since and path) to lineage_path (default
    <output>.lineage.json); returns the lineage."""
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    lineage["since"] = since.isoformat() if since is not None else None
    lineage["path"] = str(output)
    Path(lineage_path or f"{output}.lineage.json").write_text(json.dumps(lineage, indent=2), encoding="utf-8")
    return lineage
