"""The memory pre-flight with `infra.sequence_parallel`: each rank saves activations for 1/N of
the tokens while weights, gradients and optimizer state stay sharded over every rank, and a
refused stage is told the smallest N that divides the devices and the heads and fits."""

from __future__ import annotations

from dataclasses import replace

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
    # Parameters are sharded over both ranks either way; the full logits are the slice's.
    for name in ("base weights", "adapter", "gradients", "optimizer"):
        assert two.component(name) == one.component(name), name
    assert one.component("logits") == 3 * 20 * 300 * 4
    assert two.component("logits") == 3 * 10 * 300 * 4


def test_padding_free_activations_count_no_mask_hand_computed() -> None:
    """Padding-free rows build no [T, T] mask: each block's SDPA saves its fp32 logsumexp (4
    heads x 4 bytes a token), split over sequence-parallel ranks, and the batch's four int64
    index tensors (position ids, row_of, pos_of, gather: 32 bytes a token) are whole on every
    rank."""
    st = StageShape("lm", 2, 10, (POLICY,), padding_free=True)
    one = estimate(SHAPE, st, DeviceLayout(world=2), 0)
    two = estimate(SHAPE, st, DeviceLayout(world=2, sequence_parallel=2), 0)
    split = 20 * 2 * 3952 + 20 * 64 * 4 + 2 * 20 * 4 * 4  # blocks, final norm, logsumexp
    assert split == 163_840
    assert one.component("activations") == split + 20 * 32 == 164_480
    assert two.component("activations") == split // 2 + 20 * 32 == 82_560
    note = next(r.note for r in two.rows if r.name == "activations")
    assert note == (
        "2 seqs x 10 tokens, no AC, row-confined, no mask, 1/2 per rank (sequence parallel)"
    )
    # Checkpointed: one block's logsumexp (the recomputed one).
    ac = estimate(SHAPE, replace(st, activation_checkpointing=True), DeviceLayout(), 0)
    blocks = 20 * 2 * 64 * 4 + 20 * 3952
    assert ac.component("activations") == blocks + 20 * 64 * 4 + 20 * 4 * 4 + 20 * 32
    # At long rows the mask dominated what the row-confined path holds instead.
    long = StageShape("lm", 1, 16384, (POLICY,), logits_chunk_tokens=2048)
    padded = estimate(SHAPE, long, DeviceLayout(), 0).component("activations")
    free = estimate(SHAPE, replace(long, padding_free=True), DeviceLayout(), 0)
    assert padded - free.component("activations") == 16384 * 16384 - 16384 * (2 * 16 + 32)


def test_a_soft_capped_model_keeps_its_mask_when_padding_free() -> None:
    """Gemma-2's soft-capped attention cannot run row-confined: it keeps padded batches."""
    cfg = {
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "intermediate_size": 96,
        "vocab_size": 300,
        "attn_logit_softcapping": 50.0,
    }
    capped = ModelShape.from_hf_config(cfg)
    assert capped.padded_attention
    st = StageShape("lm", 2, 10, (POLICY,), padding_free=True)
    act = estimate(capped, st, DeviceLayout(), 0).component("activations")
    assert act == estimate(capped, replace(st, padding_free=False), DeviceLayout(), 0).component(
        "activations"
    )
    assert "[T, T] mask" in next(
        r.note for r in estimate(capped, st, DeviceLayout(), 0).rows if r.name == "activations"
    )


def test_the_chunked_head_runs_on_a_ranks_slice_hand_computed() -> None:
    """Under sequence parallelism a rank's LM head sees its slice's positions: the hidden states
    kept for the head (and their gradient) are 1/N; the [chunk, vocab] buffers are not."""
    st = StageShape("lm", 4, 4096, (POLICY,), logits_chunk_tokens=2048)
    logits = {
        n: estimate(SHAPE, st, DeviceLayout(world=4, sequence_parallel=n), 0).component("logits")
        for n in (1, 2, 4)
    }
    buffers = 2 * 2048 * 300 * 4
    assert logits == {n: buffers + 2 * (16384 // n) * 64 * 4 for n in (1, 2, 4)}
    # A slice smaller than a chunk: the chunk is the slice.
    short = StageShape("lm", 1, 2048, (POLICY,), logits_chunk_tokens=2048)
    four = estimate(SHAPE, short, DeviceLayout(world=4, sequence_parallel=4), 0)
    assert four.component("logits") == 2 * 512 * 300 * 4 + 2 * 512 * 64 * 4
    note = next(r.note for r in four.rows if r.name == "logits")
    assert (
        note
        == "chunked: 2 x 512 tokens x vocab 300 x 4 B, 512 positions per rank (sequence parallel)"
    )


def test_rl_head_positions_are_capped_by_the_slice_not_halved() -> None:
    """RL scores only the response (4 of a row's 10 tokens), and one rank's slice may hold all
    of a row's response: its head positions are min(responses, slice), not responses / N."""
    rl = StageShape("rl", 2, 10, (POLICY,), logit_positions=4, logits_chunk_tokens=8)
    at = {n: estimate(SHAPE, rl, DeviceLayout(world=4, sequence_parallel=n), 0) for n in (1, 2, 4)}
    # 8 response positions; slices of 10 (N = 2) and 5 (N = 4) tokens.
    for n, positions in ((1, 8), (2, 8), (4, 5)):
        chunk = min(8, positions)
        assert at[n].component("logits") == 3 * chunk * 300 * 4 + 2 * positions * 64 * 4, n


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
