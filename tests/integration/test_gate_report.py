"""The gate report page: rendered by a real headless chromium with no network, it shows the
verdict, each check and the failing rows by id and reason, loads nothing, and never carries
the planted secret, card number or email."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

from tests.support.examples import chat
from tuneloop.config import ValidationConfig
from tuneloop.data.schema import Example
from tuneloop.gate_report import REPORT_NAME, render_gate_report
from tuneloop.validation import validate_dataset
from tuneloop.validation_report import MAX_LISTED_IDS, ExpectationOutcome, ValidationReport

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="chromium is not installed (`make system-packages` installs Debian's chromium)"
)

SECRET = "sk-proj-Q2xk9Vb7LmN3pRt5WyZa8cDe"
CARD = "4111 1111 1111 1111"
EMAIL = "jane.roe@fastmail.com"
PLANTED = (SECRET, CARD, CARD.replace(" ", ""), EMAIL)


def failing_dataset() -> tuple[list[Example], list[Example]]:
    """Clean free-text Q&A plus a duplicate, a secret, PII and an over-long completion."""
    train = [
        chat(f"train.jsonl:{i + 1}", f"What is item {i} made of?", f"Item {i} is made of part {i * 7}.")
        for i in range(30)
    ]
    eval_ = [
        chat(f"eval.jsonl:{i + 1}", f"How old is sample {i}?", f"Sample {i} is {i + 3} days old.") for i in range(8)
    ]
    train += [
        chat("dup.jsonl:1", train[0].messages[0]["content"], train[0].completion),
        chat("secret.jsonl:1", "How do I call the API?", f"Use client = OpenAI(api_key='{SECRET}') and go."),
        chat("card.jsonl:2", "Which card was charged?", f"The card {CARD} was charged."),
        chat("email.jsonl:3", "Who do I contact?", f"Write to {EMAIL} for help."),
        chat("long.jsonl:4", "Tell me a long story.", "word " * 900),  # 4500 chars > 4000
    ]
    return train, eval_


class _VisibleText(HTMLParser):
    """The text a reader sees: everything in <body> outside <script>/<style>."""

    def __init__(self) -> None:
        super().__init__()
        self.parts: list[str] = []
        self._hidden = 0
        self._in_body = False

    def handle_starttag(self, tag, attrs):
        self._in_body |= tag == "body"
        self._hidden += tag in ("script", "style", "template")

    def handle_endtag(self, tag):
        self._hidden -= tag in ("script", "style", "template") and self._hidden > 0

    def handle_data(self, data):
        if self._in_body and not self._hidden:
            self.parts.append(data)


def visible_text(dom: str) -> str:
    parser = _VisibleText()
    parser.feed(dom)
    return re.sub(r"\s+", " ", " ".join(parser.parts))


def render_in_chromium(page: Path, work: Path, timeout: float = 60) -> tuple[str, list[str]]:
    """(the DOM after load, the URLs the page itself requested), from headless chromium.

    Every host name resolves to nothing, so no request leaves the machine; the net log
    still records each one the page started. The browser's own background requests
    (updates, accounts) have no origin as initiator and are not the page's."""
    netlog = work / "netlog.json"
    cmd = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--no-first-run",
        f"--user-data-dir={work / 'chromium-profile'}",
        "--disable-background-networking",
        "--disable-component-update",
        "--host-resolver-rules=MAP * ~NOTFOUND",
        f"--log-net-log={netlog}",
        "--dump-dom",
        page.as_uri(),
    ]
    # Its own session: on a timeout the whole process tree (renderer, zygote) goes.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        dom, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"chromium did not finish rendering {page} within {timeout}s")
    assert proc.returncode == 0, err[-2000:]

    log = json.loads(netlog.read_text())
    start_job = log["constants"]["logEventTypes"]["URL_REQUEST_START_JOB"]
    requested = []
    for event in log["events"]:
        params = event.get("params") or {}
        url, initiator = params.get("url", ""), params.get("initiator")
        if (
            event["type"] == start_job
            and initiator
            and initiator != "not an origin"
            and not url.startswith(("file:", "data:"))
        ):
            requested.append(url)
    return dom, requested


@needs_chromium
def test_gate_report_renders_offline_with_failing_rows_and_no_pii(tmp_path):
    train, eval_ = failing_dataset()
    docs = tmp_path / "docs"
    report = validate_dataset(train, eval_, ValidationConfig(), None, docs)
    assert not report.success

    page = docs / REPORT_NAME
    assert report.report_path == page.resolve() and page.is_file()
    assert f"Report: {page.resolve()}" in report.summary()
    assert report.to_dict()["report_path"] == str(page.resolve())

    source = page.read_text()
    # Nothing to fetch: no remote src/href, no script, no stylesheet link.
    assert not re.search(r"""(?:src|href)\s*=\s*["']?\s*(?:https?:)?//""", source, re.I), source
    assert "<script" not in source.lower() and "<link" not in source.lower()

    dom, requested = render_in_chromium(page, tmp_path)
    assert requested == []
    text = visible_text(dom)
    assert "Dataset validation gate: FAILED" in text
    assert "35 train examples" in text and "8 eval examples" in text
    # Each failing check by name, with its failing rows' ids and reasons.
    expected_rows = {
        "no duplicate examples": [("dup.jsonl:1", "duplicate of train.jsonl:1")],
        "completion has no secrets": [("secret.jsonl:1", "openai_api_key")],
        "completion has no personal data": [("card.jsonl:2", "card_number"), ("email.jsonl:3", "email")],
        "completion length in characters": [("long.jsonl:4", "4500 (allowed 1..4000 chars)")],
    }
    assert {e.name for e in report.failures} == set(expected_rows)
    for name, rows in expected_rows.items():
        assert f"FAIL {name}" in text
        for ex_id, reason in rows:
            assert re.search(rf"\d+ {re.escape(ex_id)} {re.escape(reason)}", text), (ex_id, reason, text)
    # Observed vs threshold, and the passing and skipped checks too.
    assert "1 of 43 examples fail (2.3%)" in text and "duplicates: none" in text
    assert "PASS eval prompts not seen in train" in text
    assert "SKIP example length in tokens no tokenizer given" in text
    for planted in PLANTED:
        assert planted not in source and planted not in dom


@needs_chromium
def test_request_check_catches_a_page_that_loads_from_a_cdn(tmp_path):
    # The check above would pass vacuously if the net log missed the page's requests.
    page = tmp_path / "cdn.html"
    page.write_text(
        '<html><head><link rel="stylesheet" href="https://cdn.example.com/x.css"></head>'
        '<body>hi<img src="https://cdn.example.com/logo.png"></body></html>'
    )
    dom, requested = render_in_chromium(page, tmp_path)
    assert "hi" in visible_text(dom)
    assert sorted(requested) == ["https://cdn.example.com/logo.png", "https://cdn.example.com/x.css"]


def test_long_lists_say_how_many_more_and_raw_values_are_withheld():
    listed = [f"dup.jsonl:{i}" for i in range(1, MAX_LISTED_IDS + 1)]
    outcome = ExpectationOutcome(
        name="no duplicate examples",
        column="duplicate_of",
        success=False,
        unexpected_count=120,
        checked_count=400,
        failing_example_ids=listed,
        failing_values=[f"duplicate of train.jsonl:{i}" for i in range(1, MAX_LISTED_IDS)] + [f"key {SECRET}"],
        threshold="duplicates: none",
        expectation_type="expect_column_values_to_be_null",
    )
    blank = ExpectationOutcome(
        name="completion is not empty",
        column="completion",
        success=False,
        unexpected_count=1,
        checked_count=400,
        failing_example_ids=["blank.jsonl:7"],
        failing_values=[None],
        threshold="no blank completions",
        expectation_type="expect_column_values_to_not_be_null",
    )
    page = render_gate_report(ValidationReport(success=False, expectations=[outcome, blank], n_train=400))
    text = visible_text(page)
    assert "and 70 more not listed" in text and "count of 120 is exact" in text
    assert "dup.jsonl:50 [withheld: looks like openai_api_key]" in text
    assert SECRET not in page
    assert "blank.jsonl:7 blank completion" in text
    assert "0 of 2 checks passed" in text
