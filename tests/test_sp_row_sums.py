"""Per-row sums under sequence parallelism are exact: the summed log-probs of each row of one
packed micro-batch, split between 2 gloo ranks (CPU, fp32), equal the unsplit batch's on every
rank, rows crossing the slice boundary and a padding row included, full logits and the chunked
head; and the LoRA gradients of a DPO-like loss of them, summed over the group, equal the
unsplit batch's (the all-reduce's backward is the identity: `shard_row_sums`). The worker is
tests/sp_row_sums_worker.py (process start-up dominates: slow tier)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch.multiprocessing as mp
from sp_row_sums_worker import worker

CASES = ("even_chunk0", "even_chunk8", "padded_chunk0", "padded_chunk8")


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("sp_rows")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    mp.spawn(worker, args=(2, f"file://{out / 'rendezvous'}", str(out)), nprocs=2, join=True)
    return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_row_sums_match_the_unsplit_batch(records: list[dict], case: str) -> None:
    first, second = (r[case] for r in records)
    assert first["sp"] == second["sp"], "every rank of the group holds the same sums"
    assert len(first["sp"]) == 4  # the padding row is dropped
    assert first["sp"] == pytest.approx(first["ref"], abs=1e-5)
    assert first["sp_lengths"] == first["ref_lengths"]
    for r in (first, second):
        assert r["grads"] == 16
        assert r["grad_rel_err"] < 1e-5
