"""A sequence-parallel group trains on one set of rows, rewarded once: its 2 gloo ranks sample
the same prompts with different seeds (what nondeterministic sampling kernels could amount to)
and both end up with the first rank's responses; the reward functions run on the first rank
only, and the other takes its scores and counters; an engine without collectives (`fast`)
samples on the first rank alone. The worker is tests/sp_group_worker.py
(process start-up dominates: slow tier)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch.multiprocessing as mp
from fixtures_tiny import tiny_assets
from sp_group_worker import worker

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    tiny = tiny_assets(tmp_path_factory)
    out = tmp_path_factory.mktemp("sp_group")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    init = f"file://{out / 'rendezvous'}"
    mp.spawn(worker, args=(2, init, tiny, str(out)), nprocs=2, join=True)
    return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(2)]


def test_the_group_keeps_its_first_ranks_samples(records: list[dict]) -> None:
    first, second = records
    assert first["alone"] != second["alone"], "the seeds differ, so do the ranks' own draws"
    assert first["grouped"] == second["grouped"] == first["alone"]
    assert first["stopped"] == second["stopped"]


def test_rewards_run_once_per_group(records: list[dict]) -> None:
    first, second = records
    assert first["calls"] == [4] and second["calls"] == [], "the function ran on rank 0 only"
    assert second["scores"] == first["scores"] == first["lengths"]
    assert second["keys"] == first["keys"]
    assert "fn:counted" in second["keys"] and "count:reward_fn_s" in second["keys"]


def test_a_local_engine_samples_on_the_first_rank_only(records: list[dict]) -> None:
    """The `fast` engine's forwards are no collective: the other rank does not draw at all and
    takes the first rank's responses."""
    first, second = records
    assert (first["fast_draws"], second["fast_draws"]) == (1, 0)
    assert second["fast"] == first["fast"] and len(first["fast"]) == 4
