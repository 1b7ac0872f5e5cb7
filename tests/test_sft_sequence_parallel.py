"""SFT with sequence parallelism computes what SFT on one rank computes.

The real sft stage on 2 gloo ranks with `infra.sequence_parallel: 2` (one data-parallel group:
both ranks take the same 4 rows, each half of the packed micro-batch's tokens) against the same
stage on 1 rank with the same global batch of 4: every step's loss, target count and token count,
the held-out losses (step 0 and the end) and the trained adapter agree, with and without
activation checkpointing, and with each decoder block compiled (`infra.compile`). The micro-batches are padding-free rows laid end to end, so the cut
between the two ranks' slices falls inside a row (checked): attention crosses it through the
all-to-all exchange, and the last token of slice 0 predicts the first of slice 1.
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from stage_helpers import TINY, planned_dir, run_inprocess, run_shared, run_torchrun, write_recipe

from posttrain.config.loader import load_recipe
from posttrain.data.batching import step_indices
from posttrain.data.sft_data import prepare
from posttrain.models.loading import load_tokenizer
from posttrain.telemetry.records import read_metrics

pytestmark = pytest.mark.slow

STEPS = 4
GLOBAL = 4
ONE = ("sft.batch.micro_batch_size=4",)
SP2 = ("infra.devices_per_node=2", "infra.sequence_parallel=2", "sft.batch.micro_batch_size=4")
DP2 = ("infra.devices_per_node=2", "sft.batch.micro_batch_size=2")
VARIANTS = {
    "one_rank": ONE,
    "sp2": SP2,
    "sp2_checkpointed": (*SP2, "sft.activation_checkpointing=true"),
    # Each decoder block compiled whole (fullgraph), the all-to-alls inside its graph.
    "sp2_compiled": (*SP2, "infra.compile=true"),
    "dp2": DP2,
    "dp2_sp2": ("infra.devices_per_node=4", "infra.sequence_parallel=2", DP2[1]),
    "dp4": ("infra.devices_per_node=4", "sft.batch.micro_batch_size=1"),
}
SP4 = ("infra.devices_per_node=4", "infra.sequence_parallel=4", "sft.batch.micro_batch_size=4")
# Where the SP-2 run's step-2 checkpoint resumes: a workspace each, and the run's overrides.
RESUMES = {"resume": ONE, "resume_sp2": SP2, "resume_sp4": SP4}
LOG_LINE = "sequence parallel: 2 ranks per group, {}"


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory, shared_parents: Path) -> dict:
    folder = tmp_path_factory.mktemp("sft-sp")
    data = copy.deepcopy(TINY)
    data["infra"]["threads_per_rank"] = 1
    # Seed 0's first step has its midpoint on a row boundary; seed 1's four steps cut rows.
    data["run"]["seed"] = 1
    data["sft"].update(
        batch={"micro_batch_size": 4, "grad_accum_steps": 1},
        max_steps=STEPS,
        eval_every=0,
        checkpoint_every=2,  # what the resume below starts from
    )
    recipes = {}
    for name in [*VARIANTS, *RESUMES]:  # a workspace each: they share the sft fingerprint
        (folder / name).mkdir()
        recipes[name] = write_recipe(folder / name, data)
        run_shared("ingest", recipes[name], shared_parents)
    return {"recipes": recipes, "done": {}}


def _run(env: dict, name: str) -> tuple[Path, str]:
    """Run one variant once per module: (its output folder, its log)."""
    if name not in env["done"]:
        recipe, over = env["recipes"][name], VARIANTS[name]
        env["done"][name] = (planned_dir("sft", recipe, *over), _launch(recipe, over))
    return env["done"][name]


def _launch(recipe: Path, over: tuple[str, ...]) -> str:
    """Run sft with `over`: under torchrun when it names several devices (its log), else in
    this process ("")."""
    nproc = next((int(o.split("=")[1]) for o in over if "devices_per_node" in o), 1)
    if nproc == 1:
        run_inprocess("sft", recipe, *over)
        return ""
    proc = run_torchrun("sft", recipe, nproc, *over)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def _records(out: Path, kind: str) -> list[dict]:
    return read_metrics(out / "metrics.jsonl", kind)


def test_the_cut_falls_inside_a_row(env: dict) -> None:
    """The premise: in every step the micro-batch's midpoint (N rounded up to even, halved) is
    strictly inside one of its rows, so one row's tokens lie on both ranks."""
    recipe = env["recipes"]["one_rank"]
    loaded = load_recipe(recipe, list(ONE))
    assert not loaded.sft.packing
    tok = load_tokenizer(planned_dir("ingest", recipe) / "tokenizer")
    rows = prepare(loaded.sft.data, tok, loaded.run.seed).train
    for step in range(STEPS):
        (idx,) = step_indices(
            len(rows), step, micro=GLOBAL, accum=1, dp_size=1, rank=0, seed=loaded.run.seed
        )
        ends = torch.tensor([len(rows[i]["input_ids"]) for i in idx]).cumsum(0).tolist()
        mid = (ends[-1] + ends[-1] % 2) // 2
        starts = [0, *ends[:-1]]
        assert any(s < mid < e for s, e in zip(starts, ends, strict=True)), (step, ends)


@pytest.mark.parametrize("name", ["sp2", "sp2_checkpointed", "sp2_compiled"])
def test_two_sequence_parallel_ranks_match_one_rank(env: dict, name: str) -> None:
    two, text = _run(env, name)
    assert LOG_LINE.format("1 data-parallel group") in text
    start = _records(two, "start")[0]
    assert (start["world_size"], start["global_batch_size"]) == (2, GLOBAL)
    _assert_same_run(_run(env, "one_rank")[0], two)


def test_two_by_two_matches_two_data_parallel_ranks(env: dict) -> None:
    """2 data-parallel groups x 2 sequence-parallel ranks (4 processes, micro 2 each group) ==
    2 data-parallel ranks x micro 2 == 1 rank x micro 4."""
    four, text = _run(env, "dp2_sp2")
    assert LOG_LINE.format("2 data-parallel groups") in text
    start = _records(four, "start")[0]
    assert (start["world_size"], start["global_batch_size"]) == (4, GLOBAL)
    _assert_same_run(_run(env, "dp2")[0], four)
    _assert_same_run(_run(env, "one_rank")[0], four)


def test_two_by_two_matches_four_data_parallel_ranks(env: dict) -> None:
    """2 DP x 2 SP (micro 2 a group) == 4 DP ranks x micro 1: the same global batch of 4."""
    dp4, _ = _run(env, "dp4")
    start = _records(dp4, "start")[0]
    assert (start["world_size"], start["global_batch_size"]) == (4, GLOBAL)
    _assert_same_run(dp4, _run(env, "dp2_sp2")[0])


def test_a_sequence_parallel_checkpoint_resumes_on_one_rank(env: dict) -> None:
    """The 2-rank SP=2 run's step-2 checkpoint (DCP shards of 2 ranks, an RNG state each), its
    run cut there, continues on 1 rank to the 1-rank trajectory: steps 3-4, the held-out loss
    at the end and the adapter."""
    out = _resume_sp2_checkpoint(env, "resume")
    starts = _records(out, "start")
    assert [(r["start_step"], r["world_size"]) for r in starts] == [(0, 2), (2, 1)]
    _assert_same_run(_run(env, "one_rank")[0], out)


@pytest.mark.parametrize(("name", "world"), [("resume_sp2", 2), ("resume_sp4", 4)])
def test_a_sequence_parallel_checkpoint_resumes_at_another_size(
    env: dict, name: str, world: int
) -> None:
    """The same SP-2 checkpoint continues at SP 2 (same size) and on 4 ranks at SP 4 (one
    data-parallel group of 4, micro 4: the same global batch; the tiny model's 4 heads and 4
    key/value heads split 1 a rank), each to the 1-rank trajectory."""
    out = _resume_sp2_checkpoint(env, name)
    starts = _records(out, "start")
    assert [(r["start_step"], r["world_size"]) for r in starts] == [(0, 2), (2, world)]
    assert starts[-1]["global_batch_size"] == GLOBAL
    _assert_same_run(_run(env, "one_rank")[0], out)


def _resume_sp2_checkpoint(env: dict, name: str) -> Path:
    """Copy the SP-2 run into workspace `name` as if killed after step 3 (no artifact, the
    step-2 checkpoint the newest), resume it with RESUMES[name]'s layout: its output folder."""
    sp2, _ = _run(env, "sp2")
    recipe, over = env["recipes"][name], RESUMES[name]
    out = planned_dir("sft", recipe, *over)
    assert out.name == sp2.name  # sequence parallelism is not part of the fingerprint
    shutil.copytree(sp2, out)
    (out / "manifest.json").unlink()
    shutil.rmtree(out / "adapter")
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_0000002"]
    _launch(recipe, over)
    return out


def _assert_same_run(one: Path, two: Path) -> None:
    """Every step's loss, gradient norm, target and token counts, the held-out losses and the
    trained adapter of run `two` are run `one`'s."""
    a, b = _records(one, "train"), _records(two, "train")
    assert [r["step"] for r in b] == list(range(1, STEPS + 1))
    for x, y in zip(a, b, strict=True):
        assert y["loss"] == pytest.approx(x["loss"], abs=1e-5), x["step"]
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-4), x["step"]
        assert y["target_tokens"] == x["target_tokens"]
        # Each rank counts its own slice: together, the one rank's tokens (none twice).
        assert y["tokens"] == x["tokens"]
    ev_a, ev_b = _records(one, "eval"), _records(two, "eval")
    assert [r["step"] for r in ev_b] == [0, STEPS]
    for x, y in zip(ev_a, ev_b, strict=True):
        assert y["eval_loss"] == pytest.approx(x["eval_loss"], abs=1e-5)
    wa, wb = (load_file(str(d / "adapter" / "adapter_model.safetensors")) for d in (one, two))
    assert wa.keys() == wb.keys() and len(wa) > 0
    # The whole adapter within 1e-5 relative; each element within 5e-5: Adam divides an update
    # by sqrt(second moment), so an element whose gradient is near rounding noise moves with
    # the last bits of the summation order (seen: 1 of 512 elements off by 1.02e-5 after 4
    # steps, as in tests/test_equivalence.py).
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=0, atol=5e-5, msg=lambda m, k=k: f"{k}: {m}")
    diff = torch.cat([(wb[k] - wa[k]).flatten() for k in wa])
    norm = torch.cat([wa[k].flatten() for k in wa])
    assert float(diff.norm() / norm.norm()) < 1e-5
    assert max(float(v.abs().max()) for k, v in wa.items() if "lora_B" in k) > 1e-3
