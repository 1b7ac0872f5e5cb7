"""bench/sequence_parallel.py --cpu-smoke: SFT's step on 1 and on 2 gloo ranks (torchrun) of one
sequence-parallel group at two lengths, a table row each with the pre-flight's estimate beside
the measurement; what a step adds to a rank's memory at N = 2 is below N = 1's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import sequence_parallel

pytestmark = pytest.mark.slow  # two torchrun launches (~12 s)


def test_cpu_smoke_prints_every_row_and_two_ranks_hold_less(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "sp.json"
    rows = sequence_parallel.main(["--cpu-smoke", "--json", str(out)])
    text = capsys.readouterr().out
    assert json.loads(out.read_text())["rows"] == rows
    assert [(r["tokens"], r["n"]) for r in rows] == [(256, 1), (1024, 1), (256, 2), (1024, 2)]
    assert "tokens  N  base MiB  peak MiB  step MiB  x N=1  step s  x N=1 |" in text
    assert "est act MiB est step MiB" in text
    for r in rows:
        line = f"{r['tokens']:>7} {r['n']:>2} {r['base_mib']:>9.1f} {r['peak_mib']:>9.1f}"
        assert line in text, line
        assert r["step_s"] > 0 and r["step_mib"] > 0 and r["est_act_mib"] > 0, r
    one, two = (
        {r["tokens"]: r for r in rows if r["n"] == 1},
        {r["tokens"]: r for r in rows if r["n"] == 2},
    )
    # The longer micro-batch: each of 2 ranks adds less than 1 rank did, as the estimate says
    # (its activations term is halved, but for the padding-free batch's four int64 index
    # tensors, 32 bytes a token, which every rank holds whole).
    assert two[1024]["step_mib"] < one[1024]["step_mib"]
    whole = 1024 * 32 / 2**20
    assert two[1024]["est_act_mib"] == pytest.approx(
        (one[1024]["est_act_mib"] - whole) / 2 + whole, abs=1e-3
    )
    # The same global batch: both layouts train the same first step (the loss after warm-up).
    assert two[1024]["loss"] == pytest.approx(one[1024]["loss"], rel=1e-4)
