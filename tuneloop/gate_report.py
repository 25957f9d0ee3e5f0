"""The validation gate's report as one self-contained HTML page a person reads offline.

GX Data Docs load jQuery, Bootstrap and bootstrap-table from CDNs: on an air-gapped machine
their index renders unstyled, with an empty list of results. This page is written next to
them (<data_docs_dir>/gate-report.html) from the ValidationReport alone: inline CSS, no
script, no external reference (a Content-Security-Policy forbids any load), so it reads
the same in a browser with no network, in an MLflow artifact view, or printed.

It shows what the report holds and nothing more: failing examples by id (their file:line)
and the precomputed reason ("duplicate of train.jsonl:3", "card_number"), never the row's
text. Every listed value is checked again for secrets and PII before it is written, so a
check that one day reports raw text cannot leak it into the page.
"""

from __future__ import annotations

import html
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from tuneloop.privacy.personal import find_pii
from tuneloop.privacy.secrets import find_secrets
from tuneloop.validation_report import MAX_LISTED_IDS, ExpectationOutcome, ValidationReport

REPORT_NAME = "gate-report.html"
MAX_VALUE_CHARS = 200  # a reason longer than this is cut: reasons are short by design

# No request of any kind: styles are inline, nothing else is allowed to load.
_CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"

_CSS = """
:root { --fg:#1d2329; --muted:#5b6570; --bg:#fff; --line:#d8dde3; --head:#f3f5f7;
        --pass:#17703a; --pass-bg:#e3f4e8; --fail:#a4161a; --fail-bg:#fbe5e6;
        --skip:#6b5a00; --skip-bg:#fbf3d0; }
@media (prefers-color-scheme: dark) {
  :root { --fg:#e4e8ec; --muted:#a3adb8; --bg:#15191d; --line:#39424b; --head:#1f252b;
          --pass:#7ad39a; --pass-bg:#173222; --fail:#ff8e8e; --fail-bg:#3d1a1c;
          --skip:#e8d37a; --skip-bg:#352f12; }
}
* { box-sizing: border-box; }
body { font: 15px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: var(--fg);
       background: var(--bg); margin: 0 auto; padding: 1.5rem; max-width: 72rem; }
h1 { font-size: 1.5rem; margin: 0 0 .75rem; }
h2 { font-size: 1.15rem; margin: 2rem 0 .5rem; }
h3 { font-size: 1rem; margin: 1.5rem 0 .4rem; }
p, li { color: var(--muted); }
table { border-collapse: collapse; width: 100%; margin: .25rem 0 .5rem; }
th, td { border: 1px solid var(--line); padding: .35rem .55rem; text-align: left; vertical-align: top; }
th { background: var(--head); font-weight: 600; }
th.num, td.num { width: 1%; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
code, .id { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; font-size: .9em; }
.verdict { display: inline-block; font-weight: 700; padding: .2rem .7rem; border-radius: .3rem; }
.status { font-weight: 700; white-space: nowrap; }
.pass { color: var(--pass); background: var(--pass-bg); }
.fail { color: var(--fail); background: var(--fail-bg); }
.skip { color: var(--skip); background: var(--skip-bg); }
.counts { display: flex; flex-wrap: wrap; gap: .5rem 1.5rem; margin: .75rem 0; padding: 0; list-style: none; }
.counts li { color: var(--fg); }
.counts b { font-size: 1.2rem; }
.more { font-style: italic; }
a { color: inherit; }
@media print { body { max-width: none; padding: 0; } a { text-decoration: none; } }
"""


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _safe_text(value: Any) -> str:
    """A value as text fit for the page: secrets and PII withheld, long text cut."""
    text = str(value)
    kinds = find_secrets(text) + find_pii(text)
    if kinds:
        return f"[withheld: looks like {', '.join(kinds)}]"
    if len(text) > MAX_VALUE_CHARS:
        return text[:MAX_VALUE_CHARS] + f"... ({len(text) - MAX_VALUE_CHARS} more chars)"
    return text


def _reason(outcome: ExpectationOutcome, value: Any) -> str:
    """What was wrong with one listed example, in the user's words."""
    kind = outcome.expectation_type
    if value is None:
        # A not-null check lists the blank value itself.
        return f"blank {outcome.column.replace('_text', '').replace('_', ' ')}"
    if kind == "expect_column_values_to_be_between":
        return f"{value} (allowed {outcome.threshold})"
    if kind == "expect_column_values_to_be_in_set":
        return f"rare label {value}"
    return str(value)


def _observed(o: ExpectationOutcome) -> str:
    if o.error:
        return "not evaluated (GX error)"
    share = f" ({o.unexpected_count / o.checked_count:.1%})" if o.checked_count and o.unexpected_count else ""
    if o.success:
        tolerated = ", tolerated" if o.unexpected_count else ""
        return f"{o.unexpected_count} of {o.checked_count} examples{share}{tolerated}"
    return f"{o.unexpected_count} of {o.checked_count} examples fail{share}"


def _anchor(i: int) -> str:
    return f"check-{i + 1}"


def _rows_section(i: int, o: ExpectationOutcome) -> str:
    state = "fail" if not o.success else "pass"
    title = "FAIL" if not o.success else "PASS (tolerated)"
    parts = [
        f'<h3 id="{_anchor(i)}"><span class="status {state}">{title}</span> {_e(o.name)}</h3>',
        f"<p>Threshold: {_e(o.threshold)}. Observed: {_e(_observed(o))}. Column <code>{_e(o.column)}</code>.</p>",
    ]
    if o.error:
        parts.append(f"<p>Great Expectations raised instead of evaluating: <code>{_e(_safe_text(o.error))}</code></p>")
        return "\n".join(parts)
    rows = "\n".join(
        f'<tr><td class="num">{n}</td><td class="id">{_e(_safe_text(ex_id))}</td>'
        f"<td>{_e(_safe_text(_reason(o, value)))}</td></tr>"
        for n, (ex_id, value) in enumerate(zip(o.failing_example_ids, o.failing_values), 1)
    )
    parts.append(
        '<table><thead><tr><th class="num">#</th><th>example (file:line)</th><th>reason</th></tr></thead>'
        f"<tbody>\n{rows}\n</tbody></table>"
    )
    more = o.unexpected_count - len(o.failing_example_ids)
    if more > 0:
        parts.append(
            f'<p class="more">... and {more} more not listed (the gate lists the first '
            f"{MAX_LISTED_IDS} of each check; the count of {o.unexpected_count} is exact).</p>"
        )
    return "\n".join(parts)


def render_gate_report(report: ValidationReport, generated_at: datetime | None = None) -> str:
    """The report as one HTML document (a string): verdict, counts, every check, failing rows."""
    generated_at = generated_at or datetime.now(timezone.utc)
    n_failed = len(report.failures)
    n_checks = len(report.expectations)
    verdict = "PASSED" if report.success else "FAILED"
    state = "pass" if report.success else "fail"

    check_rows = []
    for i, o in enumerate(report.expectations):
        status = '<span class="status pass">PASS</span>' if o.success else '<span class="status fail">FAIL</span>'
        name = _e(o.name)
        if o.failing_example_ids or o.error:
            name = f'<a href="#{_anchor(i)}">{name}</a>'
        check_rows.append(
            f"<tr><td>{status}</td><td>{name}</td><td>{_e(_observed(o))}</td><td>{_e(o.threshold)}</td></tr>"
        )
    for name, why in report.skipped.items():
        check_rows.append(
            f'<tr><td><span class="status skip">SKIP</span></td><td>{_e(name)}</td><td colspan="2">{_e(why)}</td></tr>'
        )

    # Failing checks first, then passing ones that still named examples (tolerated).
    listed = [(i, o) for i, o in enumerate(report.expectations) if not o.success]
    listed += [(i, o) for i, o in enumerate(report.expectations) if o.success and o.failing_example_ids]
    rows_html = "\n".join(_rows_section(i, o) for i, o in listed) or "<p>No example failed any check.</p>"

    docs = ""
    if report.data_docs_path:
        # A relative link: the page and the GX site sit in the same folder.
        docs = (
            f'<p>The Great Expectations Data Docs site (<a href="{_e(Path(report.data_docs_path).name)}">'
            f"{_e(Path(report.data_docs_path).name)}</a>, same folder) has the raw GX results; "
            "it loads its styles and scripts from CDNs and needs a network connection to render.</p>"
        )

    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="{_CSP}">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>Dataset validation {verdict}</title>
<style>{_CSS}</style>
</head>
<body>
<h1>Dataset validation gate: <span class="verdict {state}">{verdict}</span></h1>
<ul class="counts">
<li><b>{report.n_train}</b> train examples</li>
<li><b>{report.n_eval}</b> eval examples</li>
<li><b>{n_checks - n_failed}</b> of {n_checks} checks passed</li>
<li><b>{n_failed}</b> failed</li>
<li><b>{len(report.skipped)}</b> skipped</li>
</ul>
<p>Generated {_e(generated_at.strftime("%Y-%m-%d %H:%M:%S %Z"))} in {report.seconds:.1f} s.
Failing examples are named by id (source file and line) with what was wrong; the rows' text
is not copied here.</p>
<h2>Checks</h2>
<table>
<thead><tr><th>status</th><th>check</th><th>observed</th><th>threshold</th></tr></thead>
<tbody>
{chr(10).join(check_rows)}
</tbody>
</table>
<h2>Failing examples</h2>
{rows_html}
{docs}
</body>
</html>
"""


def write_gate_report(report: ValidationReport, directory: Path) -> Path:
    """Write <directory>/gate-report.html for `report`; returns its path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / REPORT_NAME
    tmp = path.with_suffix(".html.tmp")
    tmp.write_text(render_gate_report(report), encoding="utf-8")
    os.replace(tmp, path)  # a reader never sees half a page
    return path.resolve()
