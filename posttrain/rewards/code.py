"""Code against tests: the program in a completion runs against the row's tests in the sandbox
(`posttrain.rewards.sandbox`); the reward is the fraction of tests passed (or 1.0/0.0).

Contract, as for every built-in reward: `fn(prompts, completions, **columns) -> list[float |
None]`; the tests come from the row's columns (`posttrain.rewards.code_formats`), None for a row
without tests. Program behaviour never raises: a crash, a timeout or a sandbox that did not start
fails that test. Each test has an outcome: `passed`, `wrong_answer` (it ran; an assert failed or
the output differs), `timeout`, `error` (it crashed: an exception other than the test's assert,
a non-zero exit, a limit), `sandbox_failure` (the sandbox did not start). Per row they are
counted (`posttrain.rewards.counters`, summed into the step records and evaluate's report):
code_runs and code_cache_hits (how the tests were settled), code_passed, code_wrong_answers,
code_timeouts, code_errors, code_sandbox_failures (every test, run or cached, has one of these)
and code_no_program (rows with tests whose reply had no program). A crash's last stderr line
(`NameError: name 'x' is not defined`) is noted beside them (`counters.note`).

- The program: `extract: fenced` takes the LAST ```python (or ```py, or untagged ```) block of
  the reply: models draft, then correct, and the final block is the answer (a first block is
  often the signature restated or a sketch); no block scores 0.0. `whole` takes the reply.
- Each test is its own process (an assert appended to the program, or stdin fed to it): one
  assert that hangs or crashes fails alone, so `fraction` is exact; the runs go to `workers`
  threads at once. A program that exits 0 before its assert ran (`exit(0)`) does not pass: an
  assert check passes only when a line printed after the assert, with a random token, came out.
- Outcomes are cached in this process by sha256 of (program, test, command, limits, sandbox):
  a program scored again (re-evaluated, a repeated sample) is not run again, and a cached
  failure keeps its reason and error line. A sandbox failure is not cached (the host's fault).
- `workers` defaults to this host's cores shared by the ranks on it (`LOCAL_WORLD_SIZE`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import secrets
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import Any, Literal

from posttrain.rewards import counters
from posttrain.rewards.code_formats import Check, row_checks, same_output
from posttrain.rewards.extract import completion_text
from posttrain.rewards.sandbox import Limits, RunResult, run, unavailable

log = logging.getLogger("posttrain.rewards")
_warned_unsandboxed = threading.Event()

__all__ = ["LANGUAGES", "code_tests", "extract_program"]

# language: (the program's file name, the command that runs it inside the sandbox)
LANGUAGES: dict[str, tuple[str, list[str]]] = {"python": ("main.py", ["python3", "main.py"])}
_FENCE_TAGS = {"python": ("python", "python3", "py")}
_FENCE = re.compile(r"```[ \t]*([\w+#.-]*)[^\n]*\n(.*?)```", re.DOTALL)

Outcome = Literal["passed", "wrong_answer", "timeout", "error", "sandbox_failure"]
# Each test's outcome, as the per-row counter it adds to.
OUTCOME_COUNTERS: dict[str, str] = {
    "passed": "code_passed",
    "wrong_answer": "code_wrong_answers",
    "timeout": "code_timeouts",
    "error": "code_errors",
    "sandbox_failure": "code_sandbox_failures",
}
COUNTERS = ("code_runs", "code_cache_hits", *OUTCOME_COUNTERS.values(), "code_no_program")
_ERROR_CHARS = 160  # an error line noted is cut here: a long message would flood a report

_CACHE_SIZE = 100_000
# key -> (outcome, the error line of an `error`)
_cache: OrderedDict[str, tuple[Outcome, str | None]] = OrderedDict()
_cache_lock = threading.Lock()


def extract_program(text: str, extract: str = "fenced", language: str = "python") -> str | None:
    """The program of a reply: its last fenced block in `language` (or untagged), or the whole
    reply; None when `fenced` finds no block."""
    if extract == "whole":
        return text
    tags = _FENCE_TAGS.get(language, (language,))
    blocks = [body for tag, body in _FENCE.findall(text) if tag.lower() in (*tags, "")]
    return blocks[-1] if blocks else None


def _cache_get(key: str) -> tuple[Outcome, str | None] | None:
    with _cache_lock:
        if key not in _cache:
            return None
        _cache.move_to_end(key)
        return _cache[key]


def _cache_put(key: str, settled: tuple[Outcome, str | None]) -> None:
    with _cache_lock:
        _cache[key] = settled
        _cache.move_to_end(key)
        while len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)


def _key(program: str, check: Check, argv: list[str], limits: Limits, sandbox: str) -> str:
    blob = json.dumps([program, asdict(check), argv, asdict(limits), sandbox])
    return hashlib.sha256(blob.encode()).hexdigest()


def _run_check(
    program: str, check: Check, file: str, argv: list[str], limits: Limits, sandbox: str
) -> tuple[Outcome, str | None]:
    """Run one test of `program` -> (its outcome, the error line of an `error`)."""
    if check.after is None:
        got = run(argv, {file: program}, check.stdin, limits, sandbox)  # type: ignore[arg-type]
        return _outcome(got, got.status == "ok" and same_output(got.stdout, check.expected or ""))
    token = secrets.token_hex(16)
    source = f"{program}\n\n{check.after}\nprint('\\n{token}')\n"
    got = run(argv, {file: source}, "", limits, sandbox)  # type: ignore[arg-type]
    return _outcome(got, got.status == "ok" and token in got.stdout.splitlines(), asserts=True)


def _outcome(got: RunResult, passed: bool, asserts: bool = False) -> tuple[Outcome, str | None]:
    """How a run that did not pass failed. A run that exited 0 (output differs, or it left
    before the assert) or died of an AssertionError (the test's assert; HumanEval's check) is
    a wrong answer; any other non-zero exit is an error, with its last stderr line."""
    if passed:
        return "passed", None
    if got.status in ("timeout", "sandbox_failure"):
        return got.status, None
    lines = [x.strip() for x in got.stderr.splitlines() if x.strip()]
    last = lines[-1][:_ERROR_CHARS] if lines else None
    if got.status == "ok" or (asserts and last is not None and last.startswith("AssertionError")):
        return "wrong_answer", None
    return "error", last or f"exit code {got.returncode} with nothing on stderr"


def _command(language: str, command: list[str] | None) -> tuple[str, list[str]]:
    if language not in LANGUAGES and command is None:
        raise ValueError(
            f"code_tests: no command for language {language!r} (built in: {sorted(LANGUAGES)}); "
            "set kwargs.command, e.g. [node, main.js], with the program's file name last"
        )
    if command is None:
        return LANGUAGES[language]
    if not command or not all(isinstance(a, str) for a in command):
        raise ValueError(f"code_tests: command must be a list of strings, got {command!r}")
    return command[-1], list(command)


def _validate(extract: str, scoring: str, sandbox: str, timeout_s: float, memory_mb: int) -> None:
    for name, value, allowed in (
        ("extract", extract, ("fenced", "whole")),
        ("scoring", scoring, ("fraction", "all")),
        ("sandbox", sandbox, ("bwrap", "none")),
    ):
        if value not in allowed:
            raise ValueError(f"code_tests: {name} must be one of {allowed}, got {value!r}")
    if not timeout_s > 0 or not memory_mb > 0:
        raise ValueError(
            f"code_tests: timeout_s and memory_mb must be > 0, got {timeout_s}, {memory_mb}"
        )


def _row_columns(n: int, columns: dict[str, Any]) -> list[dict[str, Any]]:
    """One dict of column values per row, from the per-column lists the rewarder passes."""
    return [{k: v[i] for k, v in columns.items() if isinstance(v, list)} for i in range(n)]


_TEST_COLUMNS = (
    "test_list",
    "test_setup_code",
    "test",
    "entry_point",
    "inputs",
    "outputs",
    "input_output",
)


def code_tests(
    prompts: list,
    completions: list,
    extract: str = "fenced",
    scoring: str = "fraction",
    language: str = "python",
    command: list[str] | None = None,
    sandbox: str = "bwrap",
    timeout_s: float = 10.0,
    memory_mb: int = 512,
    workers: int | None = None,
    **columns: Any,
) -> list[float | None]:
    """Per row: the fraction of its tests the completion's program passes (`scoring: all`: 1.0
    when all pass, else 0.0); 0.0 when no program is found; None when the row has no tests."""
    _validate(extract, scoring, sandbox, timeout_s, memory_mb)
    _refuse_without_sandbox(sandbox)
    file, argv = _command(language, command)
    limits = Limits(wall_s=float(timeout_s), cpu_s=max(1, int(timeout_s)), memory_mb=memory_mb)
    n = len(completions)
    tests = {k: columns.get(k) for k in _TEST_COLUMNS}
    checks = [row_checks(c) for c in _row_columns(n, tests)]
    programs = [extract_program(completion_text(c), extract, language) for c in completions]
    # Every (row, test) to settle: from the cache, else a run; [(row, key, program, check)]
    todo = [
        (i, _key(programs[i], ch, argv, limits, sandbox), programs[i], ch)
        for i in range(n)
        if programs[i] is not None
        for ch in checks[i]
    ]
    counts = {name: [0.0] * n for name in COUNTERS}
    for i in range(n):
        counts["code_no_program"][i] = float(programs[i] is None and bool(checks[i]))
    passed = [0] * n
    runs, waiting = [], []  # the first (row, key, program, check) of each key; its repeats
    started: set[str] = set()
    for i, key, program, ch in todo:
        hit = _cache_get(key)
        if hit is None:
            # A repeat within this call (GRPO's samples of one prompt often agree) waits for
            # the one run of its key and counts as a cache hit.
            (waiting if key in started else runs).append((i, key, program, ch))
            started.add(key)
            continue
        counts["code_cache_hits"][i] += 1
        passed[i] += _settle(counts, i, hit)
    done: dict[str, tuple[Outcome, str | None]] = {}
    with ThreadPoolExecutor(max_workers=workers or default_workers()) as pool:
        results = pool.map(lambda r: _run_check(r[2], r[3], file, argv, limits, sandbox), runs)
        for (i, key, _, _), settled in zip(runs, results, strict=True):
            counts["code_runs"][i] += 1
            passed[i] += _settle(counts, i, settled)
            done[key] = settled
            if settled[0] != "sandbox_failure":  # the host's fault: try again next time
                _cache_put(key, settled)
    for i, key, _, _ in waiting:
        counts["code_cache_hits"][i] += 1
        passed[i] += _settle(counts, i, done[key])
    for name, per_row in counts.items():
        counters.record(name, per_row)
    return [_score(passed[i], len(checks[i]), scoring) for i in range(n)]


def _settle(counts: dict[str, list[float]], i: int, settled: tuple[Outcome, str | None]) -> bool:
    """Count row `i`'s test by its outcome (and note an error's line); whether it passed."""
    outcome, line = settled
    counts[OUTCOME_COUNTERS[outcome]][i] += 1
    if line is not None:
        counters.note(line)
    return outcome == "passed"


def default_workers() -> int:
    """This host's cores shared by the ranks on it: each rank's reward runs at once."""
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return max(1, (os.cpu_count() or 1) // max(1, ranks))


def _refuse_without_sandbox(sandbox: str) -> None:
    """The stage's backstop for what `validate` refuses (`check_kwargs`): bubblewrap asked for
    and unable to run here is an error, never a silent run without it; `sandbox: none` runs
    unsandboxed with a warning, once per process."""
    if sandbox == "none":
        if not _warned_unsandboxed.is_set():
            _warned_unsandboxed.set()
            log.warning(
                "code_tests: sandbox: none - model-written programs run unsandboxed, with the "
                "stage's user, files and network (only the resource limits apply)"
            )
        return
    if reason := unavailable():
        raise RuntimeError(f"code_tests: sandbox: bwrap: {reason}")


def check_kwargs(kwargs: dict[str, Any]) -> str | None:
    """What `validate` says of a recipe's kwargs for `code_tests` (None: fine): a setting it
    would refuse at its first call, or bubblewrap that cannot run on this host."""
    try:
        _validate(
            kwargs.get("extract", "fenced"),
            kwargs.get("scoring", "fraction"),
            kwargs.get("sandbox", "bwrap"),
            kwargs.get("timeout_s", 10.0),
            kwargs.get("memory_mb", 512),
        )
        _command(kwargs.get("language", "python"), kwargs.get("command"))
    except ValueError as exc:
        return str(exc).removeprefix("code_tests: ")
    if kwargs.get("sandbox", "bwrap") == "bwrap" and (reason := unavailable()):
        return f"sandbox: bwrap cannot run here: {reason}; or set sandbox: none (unsandboxed)"
    return None


# `validate` calls a reward function's `check_kwargs` with the recipe's kwargs, where it has one.
code_tests.check_kwargs = check_kwargs  # type: ignore[attr-defined]


def _score(passed: int, total: int, scoring: str) -> float | None:
    if total == 0:
        return None
    if scoring == "all":
        return float(passed == total)
    return passed / total
