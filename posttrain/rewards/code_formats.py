"""A row's tests for the code verifier, read from whichever test columns the row has:

- MBPP: `test_list` (assert statements; `test_setup_code` runs first): one check per assert.
- HumanEval: `test` (defines `check(candidate)`) and `entry_point` (the function's name): one
  check, `check(<entry_point>)`.
- APPS / CodeContests: `inputs` and `outputs` (stdin and expected stdout, one pair per check),
  or APPS's `input_output` JSON string `{"inputs": [...], "outputs": [...]}`. An APPS row with
  `fn_name` (call-based) is not supported and has no checks.

No tests: an empty list (the reward is None, not applicable, for that row).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Check:
    """One test of a program. `after`: code appended to the program (an assert, a check call)
    that must run to its end; else `stdin` fed and `expected` compared with stdout."""

    after: str | None = None
    stdin: str = ""
    expected: str | None = None


def _nonempty_str(value: Any) -> bool:
    return isinstance(value, str) and bool(value.strip())


def _text(value: Any) -> str:
    """APPS stores a multi-line input or output as a list of lines, sometimes."""
    return "\n".join(map(str, value)) if isinstance(value, list) else str(value)


def io_checks(inputs: Any, outputs: Any) -> list[Check]:
    if not isinstance(inputs, list) or not isinstance(outputs, list) or not inputs:
        return []
    if len(inputs) != len(outputs):
        raise ValueError(f"{len(inputs)} test inputs but {len(outputs)} outputs")
    return [Check(stdin=_text(i), expected=_text(o)) for i, o in zip(inputs, outputs, strict=True)]


def row_checks(columns: dict[str, Any]) -> list[Check]:
    """The checks of one row from its columns (a column the data lacks is None)."""
    tests = columns.get("test_list")
    if isinstance(tests, list) and tests:
        setup = columns.get("test_setup_code") or ""
        return [Check(after=f"{setup}\n{t}" if setup else str(t)) for t in tests]
    test, entry = columns.get("test"), columns.get("entry_point")
    if _nonempty_str(test) and _nonempty_str(entry):
        return [Check(after=f"{test}\ncheck({entry})")]
    if columns.get("inputs") is not None:
        return io_checks(columns.get("inputs"), columns.get("outputs"))
    raw = columns.get("input_output")
    if _nonempty_str(raw):
        spec = json.loads(raw)
        if spec.get("fn_name"):
            return []
        return io_checks(spec.get("inputs"), spec.get("outputs"))
    return []


def same_output(stdout: str, expected: str) -> bool:
    """Stdout equals the expected output line by line, each line stripped, blank ends ignored."""
    return [x.strip() for x in stdout.strip().splitlines()] == [
        x.strip() for x in expected.strip().splitlines()
    ]
