"""bench/agent_rollout.py at its tiniest: it plays forced k-turn episodes through the real
episode loop, with and without the KV cache kept between turns, times single-turn generation
beside them and prints the figures."""

from __future__ import annotations

import math

import pytest
from fixtures_tiny import one_torch_thread

from bench import agent_rollout

TINY = ["--hidden", "64", "--layers", "1", "--batch", "2", "--turns", "2", "--new-tokens", "40"]


def test_the_bench_prints_its_figures_and_a_finite_ratio(capsys: pytest.CaptureFixture) -> None:
    with one_torch_thread():
        m = agent_rollout.main([*TINY, "--repeats", "1", "--threads", "1", "--device", "cpu"])
    out = capsys.readouterr().out
    assert "k-turn s" in out and "single s" in out and "no cache s" in out
    assert math.isfinite(m["ratio"]) and m["ratio"] > 0
    assert 0 < m["gen"] <= m["k_turn"] and m["render"] > 0
    assert m["generated"] == 2 * 40  # every turn generated exactly --new-tokens
    assert f"{m['ratio']:.2f}x" in out
    # the kept cache spares the re-prefill: a turn runs only the tool turn it appended
    first = m["first_context"] * 2
    assert first < m["prefilled"] < m["prefilled_no_cache"]
