"""The code verifier (posttrain.rewards.code): each test format against right, wrong and
partly right programs, extraction, timeouts and crashes counted, the cache, concurrency.
Runs with `sandbox: none` (the bwrap sandbox is tested with posttrain.rewards.sandbox)."""

from __future__ import annotations

import json
import os
import time

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
        "code_timeouts": 0.0,
        "code_errors": 0.0,
        "code_sandbox_failures": 0.0,
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
