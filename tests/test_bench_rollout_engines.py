"""bench/rollout_engines.py at its tiniest: the real GRPO stage on the in-process engine, on a
real `transformers serve` and on it one update behind, and the two engines' argmax rows."""

from __future__ import annotations

import pytest

from bench import rollout_engines

pytestmark = pytest.mark.slow


def test_three_engines_train_and_the_argmax_rows_agree(capsys: pytest.CaptureFixture) -> None:
    args = ["--hidden", "64", "--layers", "1", "--steps", "3", "--prompts", "2", "--samples"]
    args += ["2", "--new-tokens", "6", "--threads", "2", "--equality-prompts", "6"]
    args += ["--warmup-steps", "20", "--sft-steps", "8"]
    got = rollout_engines.main(args)
    out = capsys.readouterr().out
    assert "engine  | step s" in out and "hf vs server:" in out
    engines = got["engines"]
    assert list(engines) == ["hf", "server", "overlap"]
    assert engines["hf"]["sync_s"] < 1e-3 < engines["server"]["sync_s"]  # in process: nothing
    assert engines["server"]["generation_overlapped_s"] == 0
    assert engines["overlap"]["generation_overlapped_s"] > 0  # sampled beside the update
    assert [r["staleness"] for r in engines["overlap"]["rows"]] == [0, 1, 1]
    assert [r["staleness"] for r in engines["server"]["rows"]] == [0, 0, 0]
    eq = got["equality"]
    # Rows that differ are the same text re-tokenised, or part at near-ties of the policy's
    # logits (the server's batches round differently), never where the policy is sure.
    assert eq["rows"] == 6 and eq["same"] + eq["retokenised"] + len(eq["margins"]) == 6
    assert all(m < 1e-3 for m in eq["margins"]), eq
