"""The code verifier (posttrain.rewards.code): each test format against right, wrong and
partly right programs, extraction, timeouts and crashes counted, the cache, concurrency.
Runs with `sandbox: none` (the bwrap sandbox is tested with posttrain.rewards.sandbox)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from posttrain.rewards import code, counters
from posttrain.rewards.code import code_tests, extract_program

ADD_RIGHT = "def add(a, b):\n    return a + b\n"
ADD_WRONG = "def add(a, b):\n    return a - b\n"
ADD_PARTLY = "def add(a, b):\n    return a + b if a else 0\n"  # wrong when a == 0
MBPP = ["assert add(1, 2) == 3", "assert add(2, 2) == 4", "assert add(0, 5) == 5"]


@pytest.fixture(autouse=True)
def fresh():
    code._cache.clear()
    counters.take(0)
    yield


def fenced(program: str) -> str:
    return f"Here it is:\n```python\n{program}```\nDone."


def score(programs: list[str], **kw) -> list[float | None]:
    kw.setdefault("sandbox", "none")
    kw.setdefault("timeout_s", 5)
    return code_tests([[]] * len(programs), [fenced(p) for p in programs], **kw)


def counts(n: int) -> dict[str, float]:
    return {k: sum(v) for k, v in counters.take(n).items()}


def test_mbpp_asserts_fraction_and_all():
    progs = [ADD_RIGHT, ADD_WRONG, ADD_PARTLY]
    assert score(progs, test_list=[MBPP] * 3) == [1.0, 0.0, 2 / 3]
    assert score(progs, test_list=[MBPP] * 3, scoring="all") == [1.0, 0.0, 0.0]


def test_mbpp_setup_code_runs_before_the_asserts():
    setup = "import math\nK = 10"
    got = score(
        ["def f(x):\n    return x * 10\n"],
        test_list=[["assert f(2) == 2 * K"]],
        test_setup_code=[setup],
    )
    assert got == [1.0]


def test_humaneval_check_function():
    test = (
        "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(0, 0) == 0\n"
    )
    got = score([ADD_RIGHT, ADD_WRONG], test=[test] * 2, entry_point=["add"] * 2)
    assert got == [1.0, 0.0]


def test_stdin_stdout_pairs_and_apps_json():
    prog = "n = int(input())\nprint(n * 2)\nprint('  end  ')\n"
    inputs, outputs = ["3\n", "5\n"], ["6\nend\n", "11\nend"]
    assert score([prog], inputs=[inputs], outputs=[outputs]) == [0.5]
    apps = json.dumps({"inputs": inputs, "outputs": ["6\nend", "10\nend"]})
    assert score([prog], input_output=[apps]) == [1.0]


def test_exit_zero_before_the_asserts_does_not_pass():
    hack = "import sys\nsys.exit(0)\n"
    assert score([hack], test_list=[MBPP]) == [0.0]


def test_fenced_takes_the_last_block_and_whole_the_reply():
    reply = f"Sketch:\n```python\n{ADD_WRONG}```\nFixed:\n```py\n{ADD_RIGHT}```\n"
    assert extract_program(reply) == ADD_RIGHT
    assert extract_program("no code here") is None
    assert extract_program("```\nx = 1\n```") == "x = 1\n"
    got = code_tests([[]], [ADD_RIGHT], extract="whole", sandbox="none", test_list=[MBPP])
    assert got == [1.0]
    got = code_tests([[]], [ADD_RIGHT], sandbox="none", test_list=[MBPP])
    assert got == [0.0]  # fenced, and the reply has no block


def test_row_without_tests_is_not_applicable():
    got = score([ADD_RIGHT, ADD_RIGHT], test_list=[MBPP, None])
    assert got == [1.0, None]
    assert score([ADD_RIGHT]) == [None]  # the data has no test column at all


def test_timeout_scores_zero_and_is_counted():
    hang = "while True:\n    pass\n"
    got = score([hang, ADD_RIGHT], test_list=[MBPP[:1]] * 2, timeout_s=0.5)
    assert got == [0.0, 1.0]
    c = counts(2)
    assert c["code_timeouts"] == 1 and c["code_runs"] == 2 and c["code_errors"] == 0


def test_crash_is_counted_as_error():
    got = score(["raise RuntimeError('boom')\n"], test_list=[MBPP])
    assert got == [0.0]
    c = counts(1)
    assert c["code_errors"] == 3 and c["code_runs"] == 3


OUTCOMES = ("code_passed", "code_wrong_answers", "code_timeouts", "code_errors")


def test_each_outcome_with_its_reason():
    """Per row: a wrong answer (assert fails, or exit 0 before it), a crash with its last
    stderr line, a timeout, a reply without a block (no test runs)."""
    replies = [
        fenced(ADD_WRONG),
        fenced("import sys\nsys.exit(0)\n"),
        fenced("def add(a, b):\n    return a + c\n"),
        fenced("while True:\n    pass\n"),
        "I would add them.",
    ]
    got = code_tests([[]] * 5, replies, sandbox="none", timeout_s=0.5, test_list=[MBPP[:2]] * 5)
    assert got == [0.0] * 5
    notes = counters.take_notes()
    c = counters.take(5)
    assert {k: c[k] for k in OUTCOMES} == {
        "code_passed": [0.0, 0.0, 0.0, 0.0, 0.0],
        "code_wrong_answers": [2.0, 2.0, 0.0, 0.0, 0.0],
        "code_timeouts": [0.0, 0.0, 0.0, 2.0, 0.0],
        "code_errors": [0.0, 0.0, 2.0, 0.0, 0.0],
    }
    assert c["code_no_program"] == [0.0, 0.0, 0.0, 0.0, 1.0]
    assert c["code_runs"] == [2.0, 2.0, 2.0, 2.0, 0.0]
    assert notes == {"NameError: name 'c' is not defined": 2}


def test_stdin_outcomes_and_a_silent_crash():
    prog = "n = int(input())\nprint(n + 1)\n"
    exits = "import sys\nsys.exit(3)\n"
    got = score([prog, exits], inputs=[["1\n", "x\n"]] * 2, outputs=[["3", "1"]] * 2)
    assert got == [0.0, 0.0]
    notes = counters.take_notes()
    c = counts(2)
    assert c["code_wrong_answers"] == 1 and c["code_errors"] == 3
    assert notes == {
        "exit code 3 with nothing on stderr": 2,
        "ValueError: invalid literal for int() with base 10: 'x'": 1,
    }


def test_a_cached_failure_keeps_its_reason():
    crash = "def add(a, b):\n    raise KeyError('k')\n"
    score([crash, ADD_WRONG], test_list=[MBPP] * 2)
    counters.take(2)
    assert score([crash, ADD_WRONG], test_list=[MBPP] * 2) == [0.0, 0.0]
    notes = counters.take_notes()
    c = counts(2)
    assert c["code_runs"] == 0 and c["code_cache_hits"] == 6
    assert c["code_errors"] == 3 and c["code_wrong_answers"] == 3
    assert notes == {"KeyError: 'k'": 3}


def test_apps_call_based_rows():
    """`fn_name`: the function (or Solution().<fn_name>) called with each input's arguments;
    an output wrapped in a one-element list compares with its element, a tuple as a list."""
    spec = {"fn_name": "add", "inputs": [[1, 2], [0, 5]], "outputs": [[3], 5]}
    leet = "class Solution:\n    def add(self, a, b):\n        return (a + b, 0)[0]\n"
    pair = {"fn_name": "pair", "inputs": [[1]], "outputs": [[1, 2]]}
    pair_prog = "def pair(x):\n    return x, x + 1\n"
    got = score(
        [ADD_RIGHT, ADD_PARTLY, leet, pair_prog],
        input_output=[json.dumps(x) for x in (spec, spec, spec, pair)],
    )
    assert got == [1.0, 0.5, 1.0, 1.0]


def test_workers_default_to_the_cores_of_this_rank(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert code.default_workers() == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "32")
    assert code.default_workers() == 1
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert code.default_workers() == 16


def test_cache_skips_re_execution():
    score([ADD_RIGHT, ADD_WRONG], test_list=[MBPP] * 2)
    assert counts(2)["code_runs"] == 6
    assert score([ADD_RIGHT, ADD_WRONG], test_list=[MBPP] * 2) == [1.0, 0.0]
    c = counts(2)
    assert c["code_runs"] == 0 and c["code_cache_hits"] == 6


def test_repeats_within_one_call_run_once():
    """GRPO's samples of one prompt often agree: each distinct (program, test) runs once."""
    got = score([ADD_RIGHT, ADD_WRONG, ADD_RIGHT, ADD_RIGHT], test_list=[MBPP] * 4)
    assert got == [1.0, 0.0, 1.0, 1.0]
    c = counts(4)
    assert c["code_runs"] == 6 and c["code_cache_hits"] == 6


def test_workers_run_concurrently():
    sleepy = "import time\ntime.sleep(0.5)\n"
    progs = [sleepy + f"x = {i}\n" for i in range(4)]  # distinct: no cache hits
    start = time.monotonic()
    got = score(progs, test_list=[["assert True"]] * 4, workers=4)
    assert got == [1.0] * 4
    assert time.monotonic() - start < 1.5


def test_bad_kwargs_are_named():
    with pytest.raises(ValueError, match="scoring must be one of"):
        score([ADD_RIGHT], scoring="most", test_list=[MBPP])
    with pytest.raises(ValueError, match="no command for language 'rust'"):
        score([ADD_RIGHT], language="rust", test_list=[MBPP])


class _Replies:
    """A tokenizer whose decode gives a fixed reply per response (the first token picks it)."""

    def __init__(self, replies: dict[int, str]) -> None:
        self.replies = replies

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.replies[ids[0]]


def test_counters_reach_the_step_record():
    from functools import partial

    import torch

    from posttrain.rewards.combine import RewardFunction
    from posttrain.rl.metrics import rollout_totals
    from posttrain.rl.rewarder import Rewarder, counter_metrics
    from tests.test_rl_losses import _rollout

    ro = _rollout([0.0, 0.0], [True, True])  # responses start with tokens 5 and 7
    fn = partial(code_tests, sandbox="none", timeout_s=5)
    rewarder = Rewarder(
        [RewardFunction("code", "posttrain.rewards.code:code_tests", 1.0, fn, "")],
        None,
        _Replies({5: fenced(ADD_RIGHT), 7: fenced("while True: pass\n")}),
    )
    rows = [{"messages": [], "columns": {"test_list": MBPP}}, {"messages": [], "columns": {}}]
    rewarder(ro, rows)
    assert ro.scored["scores"].tolist() == [1.0, 0.0]  # the second row has no tests: None
    totals = rollout_totals(ro, torch.device("cpu"), "k1")
    got = counter_metrics(totals)  # the step record's fields
    assert 0 < got.pop("reward_fn_s") < 60  # seconds inside the reward functions
    assert got == {
        "code_runs": 3.0,
        "code_cache_hits": 0.0,
        "code_passed": 3.0,
        "code_wrong_answers": 0.0,
        "code_timeouts": 0.0,
        "code_errors": 0.0,
        "code_sandbox_failures": 0.0,
        "code_no_program": 0.0,  # the second row has no tests: no program is missing
    }


def test_each_format_in_the_bwrap_sandbox():
    """The same verdicts inside bubblewrap (skipped where it cannot run, failed instead under
    POSTTRAIN_REQUIRE_BWRAP=1, as tests/test_sandbox.py)."""
    if (reason := code.unavailable()) is not None:
        if os.environ.get("POSTTRAIN_REQUIRE_BWRAP") == "1":
            pytest.fail(f"{reason} [POSTTRAIN_REQUIRE_BWRAP=1]", pytrace=False)
        pytest.skip(reason)
    progs = [ADD_RIGHT, ADD_WRONG, ADD_PARTLY]
    assert score(progs, test_list=[MBPP] * 3, sandbox="bwrap") == [1.0, 0.0, 2 / 3]
    test = "def check(candidate):\n    assert candidate(1, 2) == 3\n"
    assert score([ADD_RIGHT], test=[test], entry_point=["add"], sandbox="bwrap") == [1.0]
    prog = "print(int(input()) * 2)\n"
    got = score([prog], inputs=[["3\n", "4\n"]], outputs=[["6", "9"]], sandbox="bwrap")
    assert got == [0.5]
    assert counts(1)["code_sandbox_failures"] == 0


def test_check_kwargs_says_what_validate_refuses(monkeypatch):
    assert code.check_kwargs({}) is None  # bwrap runs on this host
    assert code.check_kwargs({"extract": "xml"}).startswith("extract must be one of")
    assert code.check_kwargs({"language": "cobol"}).startswith("no command for language")
    # A host where bubblewrap cannot start (its reason as `sandbox.unavailable` gives it).
    monkeypatch.setattr(code, "unavailable", lambda: "no `bwrap` (bubblewrap) on this host")
    said = code.check_kwargs({"sandbox": "bwrap"})
    assert said == (
        "sandbox: bwrap cannot run here: no `bwrap` (bubblewrap) on this host; or set "
        "sandbox: none (unsandboxed)"
    )
    assert code.check_kwargs({"sandbox": "none"}) is None
    with pytest.raises(RuntimeError, match="code_tests: sandbox: bwrap: no `bwrap`"):
        code_tests([[]], ["x"], sandbox="bwrap", test_list=[MBPP[:1]])


def test_report_says_why_programs_failed_and_nothing_without_outcomes():
    from flows.report.tables import StageRecord, markdown_report
    from posttrain.store.summary import Summary

    greedy = {"tests": 6, "passed": 1, "wrong_answer": 2, "timeout": 0, "error": 3}
    greedy |= {"sandbox_failure": 0, "no_program": 1}
    greedy["top_errors"] = [{"line": "TypeError: a | b", "count": 3}]
    policies = {"base": {"pass@1": 0.0}, "grpo": {"pass@1": 0.5, "failures": {"greedy": greedy}}}
    summary = Summary.model_validate({"verifier": {"policies": policies}})
    report = markdown_report(
        "r", "id", [StageRecord("evaluate", "fp", "ran", 1.0, summary=summary)]
    )
    assert "## Why programs failed (`evaluate`)" in report
    assert "| grpo | greedy | 6 | 1 | 2 | 0 | 3 | 0 | 1 |" in report
    assert "- `grpo`, greedy: `TypeError: a \\| b` (3)" in report
    plain = Summary.model_validate({"verifier": {"policies": {"base": {"pass@1": 0.0}}}})
    report = markdown_report("r", "id", [StageRecord("evaluate", "fp", "ran", 1.0, summary=plain)])
    assert "Why programs failed" not in report


def test_the_throughput_bench_prints_its_table():
    """bench/code_reward.py at its smallest: every row measured, ratios and the cached line."""
    if (reason := code.unavailable()) is not None:
        if os.environ.get("POSTTRAIN_REQUIRE_BWRAP") == "1":
            pytest.fail(f"{reason} [POSTTRAIN_REQUIRE_BWRAP=1]", pytrace=False)
        pytest.skip(reason)
    bench = Path(__file__).parents[1] / "bench" / "code_reward.py"
    args = [sys.executable, str(bench), "--replies", "2", "--workers", "1,2", "--rounds", "1"]
    out = subprocess.run(args, capture_output=True, text=True, timeout=120, check=True).stdout
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert [r[0] for r in rows] == ["2", "1", "2"] and rows[0][1] == "replies"
    assert all(float(r[1]) > 0 and float(r[2]) > 0 and r[3].endswith("x") for r in rows[1:])
    assert "cached: the same 6 tests again in" in out
