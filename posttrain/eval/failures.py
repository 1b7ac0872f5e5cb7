"""Why a verifier's answers failed, for evaluate's report: the code verifier's per-test outcomes
and its most common error lines, read from the reward counters side channel
(`posttrain.rewards.counters`) around one scoring call.

`clear()` before scoring, `collect(n)` after it (n: the rows scored) -> `{tests, passed,
wrong_answer, timeout, error, sandbox_failure, no_program, top_errors}`, or None when no
function reported outcomes (a verifier that runs no code: nothing to say).
"""

from __future__ import annotations

from typing import Any

from posttrain.rewards import counters

# The report's outcome -> the counter summed into it (`posttrain.rewards.code`).
OUTCOMES = {
    "passed": "code_passed",
    "wrong_answer": "code_wrong_answers",
    "timeout": "code_timeouts",
    "error": "code_errors",
    "sandbox_failure": "code_sandbox_failures",
    "no_program": "code_no_program",  # rows, not tests: the reply had no program to run
}
TOP_ERRORS = 3


def clear() -> None:
    """Drop what calls before this scoring left on the side channel."""
    counters.take(0)


def collect(n: int) -> dict[str, Any] | None:
    """The outcomes the functions counted on the `n` rows just scored, and the most common
    error lines `[{"line", "count"}]`; None when none counted outcomes."""
    notes = counters.take_notes()  # before `take`, which clears them
    got = counters.take(n)
    if not any(c in got for c in OUTCOMES.values()):
        return None
    out: dict[str, Any] = {k: int(sum(got.get(c, []))) for k, c in OUTCOMES.items()}
    out = {"tests": sum(v for k, v in out.items() if k != "no_program"), **out}
    out["top_errors"] = [{"line": x, "count": c} for x, c in notes.most_common(TOP_ERRORS)]
    return out
