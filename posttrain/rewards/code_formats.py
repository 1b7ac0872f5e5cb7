"""A row's tests for the code verifier, read from whichever test columns the row has:

- MBPP: `test_list` (assert statements; `test_setup_code` runs first): one check per assert.
- HumanEval: `test` (defines `check(candidate)`) and `entry_point` (the function's name): one
  check, `check(<entry_point>)`.
- APPS / CodeContests: `inputs` and `outputs` (stdin and expected stdout, one pair per check),
  or APPS's `input_output` JSON string `{"inputs": [...], "outputs": [...]}`.
- APPS call-based (`input_output` with `fn_name`): one check per input, the function (or
  LeetCode's `Solution().<fn_name>`) called with the input's arguments, its result (a tuple as
  a list) equal to the output, or to the output's only element (APPS wraps some in a list), as
  APPS's own harness compares.

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


def call_checks(fn_name: str, inputs: Any, outputs: Any) -> list[Check]:
    """APPS call-based checks: call `fn_name` with each input's arguments, compare the result."""
    if not isinstance(inputs, list) or not isinstance(outputs, list) or not inputs:
        return []
    if len(inputs) != len(outputs):
        raise ValueError(f"{len(inputs)} test inputs but {len(outputs)} outputs")
    checks = []
    for args, want in zip(inputs, outputs, strict=True):
        # The arguments and output travel as JSON text: any value the row holds, no quoting.
        after = (
            "import json as _json\n"
            f"_args, _want = _json.loads({json.dumps(json.dumps([args, want]))})\n"
            f"_fn = Solution().{fn_name} if 'Solution' in globals() else {fn_name}\n"
            "_got = _fn(*_args) if isinstance(_args, list) else _fn(_args)\n"
            "_got = list(_got) if isinstance(_got, tuple) else _got\n"
            "assert _got == _want or (isinstance(_want, list) and len(_want) == 1 "
            "and _got == _want[0]), f'got {_got!r}'\n"
        )
        checks.append(Check(after=after))
    return checks


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
            return call_checks(spec["fn_name"], spec.get("inputs"), spec.get("outputs"))
        return io_checks(spec.get("inputs"), spec.get("outputs"))
    return []


def same_output(stdout: str, expected: str) -> bool:
    """Stdout equals the expected output line by line, each line stripped, blank ends ignored."""
    return [x.strip() for x in stdout.strip().splitlines()] == [
        x.strip() for x in expected.strip().splitlines()
    ]
