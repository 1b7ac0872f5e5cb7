"""bench/scoring_passes.py at its tiniest: the real GRPO stage with every scoring pass and with
the needed ones only trains the same adapter, bit for bit; the stage really ran both passes in the
first run and neither in the second (the times are the benchmark's to print, not to assert)."""

from __future__ import annotations

import pytest
from fixtures_tiny import one_torch_thread

from bench import scoring_passes

pytestmark = pytest.mark.slow


def test_the_needed_passes_train_the_same_adapter(capsys: pytest.CaptureFixture) -> None:
    args = ["--hidden", "64", "--layers", "1", "--steps", "3", "--prompts", "4", "--threads", "1"]
    with one_torch_thread():
        m = scoring_passes.main(args)
    out = capsys.readouterr().out
    assert "needed passes / every pass" in out and f"{m['ratio']:.2f}x" in out
    # One update per rollout, scored in the same batches: the update's own log-probs are the
    # scoring pass's to the bit, so nothing but the time differs.
    assert m["diff"] == 0.0 and m["loss"] != 0.0  # a step that trained, not a no-op
    assert m["passes_full"] == [(True, True)] and m["passes_own"] == [(False, False)]
