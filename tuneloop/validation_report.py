"""What the validation gate returns: a ValidationReport of ExpectationOutcomes.

Its own module so that the gate (tuneloop/validation.py) and the page written from a
report (tuneloop/gate_report.py) both import it and neither imports the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The report lists at most this many failing ids per expectation (the count is exact).
MAX_LISTED_IDS = 50


@dataclass
class ExpectationOutcome:
    name: str  # in the user's words: "completion has no secrets"
    column: str  # the DataFrame column GX checked
    success: bool
    unexpected_count: int
    checked_count: int  # rows the expectation applied to
    failing_example_ids: list[str]  # first MAX_LISTED_IDS; unexpected_count is exact
    failing_values: list[Any]  # what was wrong with each listed example, same order
    threshold: str
    expectation_type: str = ""
    error: str | None = None  # GX raised instead of evaluating

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass
class ValidationReport:
    success: bool
    expectations: list[ExpectationOutcome]
    skipped: dict[str, str] = field(default_factory=dict)  # check name -> why it did not run
    data_docs_path: Path | None = None  # the site's index.html
    report_path: Path | None = None  # gate-report.html beside it: self-contained, reads offline
    n_train: int = 0
    n_eval: int = 0
    seconds: float = 0.0

    @property
    def failures(self) -> list[ExpectationOutcome]:
        return [e for e in self.expectations if not e.success]

    def summary(self) -> str:
        verdict = "PASSED" if self.success else f"FAILED ({len(self.failures)} of {len(self.expectations)} checks)"
        lines = [f"Dataset validation {verdict}: {self.n_train} train + {self.n_eval} eval examples"]
        for e in self.expectations:
            if e.success:
                extra = f" ({e.unexpected_count} tolerated)" if e.unexpected_count else ""
                lines.append(f"  PASS {e.name} [{e.threshold}]{extra}")
                continue
            if e.error:
                lines.append(f"  FAIL {e.name}: GX error: {e.error}")
                continue
            lines.append(f"  FAIL {e.name} [{e.threshold}]: {e.unexpected_count} of {e.checked_count} examples")
            for ex_id, value in zip(e.failing_example_ids[:10], e.failing_values[:10]):
                lines.append(f"       {ex_id}: {value}")
            if e.unexpected_count > 10:
                lines.append(f"       ... and {e.unexpected_count - 10} more (see report / Data Docs)")
        for name, why in self.skipped.items():
            lines.append(f"  SKIP {name}: {why}")
        if self.report_path:
            lines.append(f"Report: {self.report_path}")
        if self.data_docs_path:
            lines.append(f"Data Docs: {self.data_docs_path}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "success": self.success,
            "n_train": self.n_train,
            "n_eval": self.n_eval,
            "seconds": round(self.seconds, 3),
            "expectations": [e.to_dict() for e in self.expectations],
            "skipped": dict(self.skipped),
            "data_docs_path": str(self.data_docs_path) if self.data_docs_path else None,
            "report_path": str(self.report_path) if self.report_path else None,
        }
