"""Tool calls of a turn: all at once, bounded by a timeout, failures told to the model and
counted, never raised."""

from __future__ import annotations

import threading
import time

from agent_fixtures import add

from posttrain.agents.tool_calls import ToolCall
from posttrain.agents.tool_runner import MAX_RESULT_CHARS, failure_counts, result_text, run_calls


def divide(a: float, b: float) -> float:
    return a / b


def test_results_come_back_per_episode_in_call_order() -> None:
    tools = {"add": add, "divide": divide}
    calls = [
        [ToolCall("add", {"a": 1, "b": 2}), ToolCall("divide", {"a": 1, "b": 4})],
        [],
        [ToolCall("add", {"a": 40, "b": 2})],
    ]
    out = run_calls(calls, [tools] * 3, timeout_s=5)
    assert [[r.content for r in row] for row in out] == [["3", "0.25"], [], ["42"]]
    assert all(r.failure is None for row in out for r in row)
    assert failure_counts(out)["tool_calls"] == 3


def test_every_episodes_calls_run_at_once() -> None:
    # Each call waits for all the others: run one after another, the barrier would break.
    n = 12
    barrier = threading.Barrier(n, timeout=5)

    def meet() -> str:
        barrier.wait()
        return "met"

    out = run_calls([[ToolCall("meet", {})] for _ in range(n)], [{"meet": meet}] * n, 10)
    assert [row[0].content for row in out] == ["met"] * n


def test_failures_are_messages_and_counts() -> None:
    def boom() -> None:
        raise RuntimeError("the service is down")

    tools = {"add": add, "divide": divide, "boom": boom}
    calls = [
        [
            ToolCall("divide", {"a": 1, "b": 0}),
            ToolCall("boom", {}),
            ToolCall("sub", {"a": 1}),
            ToolCall("add", {"a": 1}),
            ToolCall("add", {"a": 1, "b": 2, "c": 3}),
        ]
    ]
    (row,) = run_calls(calls, [tools], timeout_s=5)
    assert [r.failure for r in row] == [
        "error",
        "error",
        "unknown_tool",
        "bad_arguments",
        "bad_arguments",
    ]
    assert row[0].content == "Error: divide raised ZeroDivisionError: division by zero"
    assert "the service is down" in row[1].content
    assert row[2].content == "Error: no tool named 'sub' (tools: add, boom, divide)"
    assert "missing a required argument: 'b'" in row[3].content
    counts = failure_counts([row])
    assert counts == {
        "tool_calls": 5,
        "tool_errors": 2,
        "tool_timeouts": 0,
        "tool_unknown": 1,
        "tool_bad_arguments": 2,
    }


def test_a_hung_tool_times_out_and_the_turn_goes_on() -> None:
    release = threading.Event()

    def hang() -> str:
        release.wait(60)
        return "late"

    t0 = time.monotonic()
    out = run_calls(
        [[ToolCall("hang", {})], [ToolCall("add", {"a": 2, "b": 2})]],
        [{"hang": hang}, {"add": add}],
        timeout_s=0.3,
    )
    elapsed = time.monotonic() - t0
    release.set()  # let the abandoned thread end
    assert out[0][0].failure == "timeout"
    assert out[0][0].content == "Error: hang timed out after 0.3 s"
    assert out[1][0].content == "4" and out[1][0].failure is None
    assert elapsed < 30  # bounded by the timeout, not by the tool
    assert failure_counts(out)["tool_timeouts"] == 1


def test_result_text() -> None:
    assert result_text("x") == "x"
    assert result_text({"a": [1, 2]}) == '{"a": [1, 2]}'
    assert result_text(object).startswith("<class")
    long = result_text("y" * (MAX_RESULT_CHARS + 10))
    assert long.endswith(" [cut]") and len(long) == MAX_RESULT_CHARS + len(" [cut]")
