"""The run report's section on why the verifier's programs failed: evaluate's per-policy test
outcomes (`posttrain.eval.failures`, in its summary's `verifier.policies.<name>.failures`) as a
table, and each policy's most common error lines. Nothing when no verifier counted outcomes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

COLUMNS = ("passed", "wrong_answer", "timeout", "error", "sandbox_failure", "no_program")
NOTE = (
    "The verifier's tests by outcome, per policy and answers (greedy: one per prompt; "
    "sampled: the pass@k samples): wrong answer (it ran, an assert failed or the output "
    "differs), timeout, error (it crashed), sandbox failure (the sandbox did not start); no "
    "program counts answers without a code block, whose tests did not run."
)


def _rows(policies: dict[str, Any]) -> tuple[list[tuple[str, ...]], list[str]]:
    """(table rows, error lines) of the policies whose figures hold `failures`."""
    rows, errors = [], []
    for name, figures in policies.items():
        for answers, f in (figures.get("failures") or {}).items():
            if f is None:
                continue
            rows.append((name, answers, str(f["tests"]), *(str(f[c]) for c in COLUMNS)))
            top = ", ".join(f"`{_cell(e['line'])}` ({e['count']})" for e in f["top_errors"])
            if top:
                errors.append(f"- `{name}`, {answers}: {top}")
    return rows, errors


def _cell(text: str) -> str:
    # A program's error line: a pipe would split the row, a backtick end the code span.
    return text.replace("|", "\\|").replace("`", "'").replace("\n", " ")


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + [
        "| " + " | ".join(map(_cell, row)) + " |" for row in rows
    ]


def failures_markdown(verifiers: Sequence[tuple[str, dict[str, Any] | None]]) -> list[str]:
    """Each evaluate stage's failure-reasons table and most common errors, from its (stage
    name, summary's `verifier` section) pair."""
    lines: list[str] = []
    for stage, verifier in verifiers:
        rows, errors = _rows((verifier or {}).get("policies") or {})
        if not rows:
            continue
        header = ("policy", "answers", "tests", *(c.replace("_", " ") for c in COLUMNS))
        lines += ["", f"## Why programs failed (`{stage}`)", "", NOTE, "", *_table(header, rows)]
        if errors:
            lines += ["", "Most common errors:", "", *errors]
    return lines
