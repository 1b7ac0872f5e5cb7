"""The memory pre-flight with `infra.sequence_parallel`: each rank saves activations for 1/N of
the tokens while weights, gradients and optimizer state stay sharded over every rank, and a
refused stage is told the smallest N that divides the devices and the heads and fits."""

from __future__ import annotations

from posttrain.memory.estimate import Adapter, DeviceLayout, ModelShape, StageShape, estimate
from posttrain.memory.fixes import suggest_fixes

# H=64, I=96, 4 heads x 16 (2 key/value heads), 2 layers, vocab 300; LoRA r=4 on every linear.
SHAPE = ModelShape(64, 2, 4, 2, 16, 96, 300, tied=True)
POLICY = Adapter("policy", 4, "all-linear", True)


def test_activations_per_rank_are_one_nth_hand_computed() -> None:
    st = StageShape("lm", 2, 10, (POLICY,))
    one = estimate(SHAPE, st, DeviceLayout(world=2), 0)
    two = estimate(SHAPE, st, DeviceLayout(world=2, sequence_parallel=2), 0)
    # Per token and block 3952 bytes (test_memory_estimate's breakdown), 20 tokens, 2 blocks,
    # the final norm's input (20 x 64 x 4) and the [2, 1, 10, 10] bool mask.
    whole = 20 * 2 * 3952 + 20 * 64 * 4 + 2 * 10 * 10
    assert one.component("activations") == whole == 163_400
    assert two.component("activations") == whole // 2 == 81_700
    assert "1/2 per rank (sequence parallel)" in next(
        r.note for r in two.rows if r.name == "activations"
    )
    # Parameters are sharded over both ranks either way; nothing else changes.
    for name in ("base weights", "adapter", "gradients", "optimizer", "logits"):
        assert two.component(name) == one.component(name), name
    assert one.total - two.total == whole // 2


def test_a_refused_stage_is_told_the_smallest_sequence_parallel_that_fits() -> None:
    # Long rows: activations dominate (4 x 4096 tokens).
    st = StageShape("lm", 4, 4096, (POLICY,), logits_chunk_tokens=2048)
    layout = DeviceLayout(world=4)
    at = {n: estimate(SHAPE, st, DeviceLayout(world=4, sequence_parallel=n), 0) for n in (1, 2, 4)}
    assert at[1].total > at[2].total > at[4].total
    budget = at[2].total  # fits at 2, not at 1
    fixes = suggest_fixes(SHAPE, st, layout, budget, 0, "sft", accum=1)
    (sp,) = [f for f in fixes if f.change.startswith("infra.sequence_parallel")]
    before, after = at[1].component("activations"), at[2].component("activations")
    assert sp.change == (
        f"infra.sequence_parallel: 2 (activations {before / 2**20:.1f} MiB -> "
        f"{after / 2**20:.1f} MiB per rank; 2 data-parallel ranks; grad_accum_steps: 2 keeps "
        "the global batch)"
    )
    assert sp.fits and sp.total == at[2].total


def test_only_sizes_that_divide_the_heads_are_suggested() -> None:
    # 6 heads on 4 devices: 4 does not split the heads, so 2 is suggested even though it does
    # not fit; 3 divides the heads but not the devices.
    six = ModelShape(96, 2, 6, 6, 16, 96, 300, tied=True)
    st = StageShape("lm", 4, 4096, (POLICY,), logits_chunk_tokens=2048)
    layout = DeviceLayout(world=4)
    fixes = suggest_fixes(six, st, layout, 1, 0, "sft", accum=3)
    (sp,) = [f for f in fixes if f.change.startswith("infra.sequence_parallel")]
    assert sp.change.startswith("infra.sequence_parallel: 2 (") and not sp.fits
    assert sp.change.endswith("2 data-parallel ranks; grad_accum_steps: 6 keeps the global batch)")


def test_no_sequence_parallel_fix_on_one_device_or_hsdp() -> None:
    st = StageShape("lm", 4, 4096, (POLICY,), logits_chunk_tokens=2048)
    for layout in (DeviceLayout(world=1), DeviceLayout(world=4, layout="hsdp", devices_per_node=2)):
        fixes = suggest_fixes(SHAPE, st, layout, 1, 0, "sft")
        assert not [f for f in fixes if f.change.startswith("infra.sequence_parallel")], layout
