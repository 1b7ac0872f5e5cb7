"""Sequence parallelism (Ulysses) is exact: one packed micro-batch split between 2 gloo ranks
(CPU, fp32) gives the unsplit batch's summed token NLL, per-token log-probs and LoRA gradients
(summed over the group), with grouped-query attention (2 kv heads, and 1 kv head replicated to
both ranks), a row crossing the slice boundary, a token count that needs a padding row, and
activation checkpointing (the recompute during backward exchanges as the forward did).
The worker (tests/sequence_parallel_worker.py) runs both ways in the same processes (about 20 s
on two CPU cores, most of it starting the processes: slow tier)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch.multiprocessing as mp
from sequence_parallel_worker import worker

from posttrain.distributed.sequence_parallel import check_heads, kv_replicas

CASES = ("kv2_even", "kv2_padded", "kv1_even", "kv1_padded", "kv2_checkpointed")


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("sp")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    init = f"file://{out / 'rendezvous'}"
    mp.spawn(worker, args=(2, init, str(out)), nprocs=2, join=True)
    return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_split_batch_is_exact(records: list[dict], case: str) -> None:
    for record in records:
        r = record[case]
        assert r["grads"] == 16  # A and B of 4 projections x 2 layers
        assert abs(r["nll_sp"] - r["nll_ref"]) <= 1e-5 * abs(r["nll_ref"])
        assert r["logp_err"] < 1e-5
        assert r["grad_rel_err"] < 1e-5
        assert r["tail"] == 0.0  # the padding row scores nothing


@pytest.mark.slow
def test_heads_not_divisible_refused(records: list[dict]) -> None:
    expected = (
        "sequence parallelism over 2 ranks splits the attention heads between them: 3 attention "
        "heads is not a multiple of 2; choose a sequence-parallel size that divides 3"
    )
    assert [r["refusal"] for r in records] == [expected, expected]


def test_check_heads() -> None:
    check_heads(8, 4)
    with pytest.raises(ValueError, match="6 attention heads is not a multiple of 4"):
        check_heads(6, 4)


def test_kv_replicas() -> None:
    # lcm(Hkv, P) / Hkv copies of each kv head: none when Hkv is a multiple of P.
    assert [kv_replicas(kv, 2) for kv in (1, 2, 4)] == [2, 1, 1]
    assert [kv_replicas(kv, 4) for kv in (1, 2, 6)] == [4, 2, 2]
