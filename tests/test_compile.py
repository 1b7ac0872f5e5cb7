"""Regional compilation (`infra.compile`, `posttrain.models.compile`): each decoder block
compiled, losses and LoRA gradients equal to eager, and one graph per kind of batch.

A tiny Llama (4 layers) with a LoRA adapter takes padding-free batches of six different layouts
(several rows and one row, lengths 2 to 40), eagerly and compiled with inductor on CPU.
Tolerances: the loss to 1e-6 relative, gradients to atol 1e-6 / rtol 1e-4 (measured: they agree
to ~2e-8; fusions reorder float sums, so bit equality is not expected). Also: FSDP2 (one rank)
with checkpointing trains as eager, and LoRA dropout draws eager's masks."""

from __future__ import annotations

import pytest
import torch
from test_padding_free import llama, rows

from posttrain.data.segments import flat_batch
from posttrain.distributed.fsdp import is_sharded, place_model
from posttrain.distributed.runtime import init_distributed, shutdown
from posttrain.models.compile import CompileStats, compile_blocks, compile_enabled
from posttrain.models.lora import apply_lora, prepare_for_training
from posttrain.sections.infra import InfraConfig
from posttrain.sections.shared import LoraConfig, OptimConfig
from posttrain.train.forward_logps import forward_nll_sum
from posttrain.train.optim import build_optimizer

# Several rows, then one row: the two kinds of packed batch (a single row needs no gather).
MULTI = [[19, 5, 27, 11], [7, 30, 2], [12, 12, 12, 12, 3], [9, 33]]
SINGLE = [[40], [25]]


def test_auto_is_on_for_cuda_only() -> None:
    assert InfraConfig().compile == "auto"
    assert not compile_enabled("auto", torch.device("cpu"))
    assert compile_enabled("auto", torch.device("cuda"))
    assert compile_enabled(True, torch.device("cpu"))
    assert not compile_enabled(False, torch.device("cuda"))


def lora_llama(checkpointing: bool, device: str, dropout: float = 0.0) -> torch.nn.Module:
    base = llama(num_hidden_layers=4)
    prepare_for_training(base, checkpointing)
    model = apply_lora(base, LoraConfig(r=4, alpha=8, dropout=dropout)).to(device)
    model.train()
    torch.manual_seed(1)  # B starts at zero: move it off zero, the same way for both models
    for n, p in model.named_parameters():
        if "lora_B" in n:
            p.data.normal_(0, 0.02)
    return model


def loss_and_grads(
    model: torch.nn.Module, lengths: list[int], device: str
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    batch = flat_batch(rows(lengths, seed=len(lengths)))
    batch = {k: v.to(device) for k, v in batch.items()}
    model.zero_grad(set_to_none=True)
    nll, count = forward_nll_sum(model, batch, 0)
    loss = nll / count
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def compare(checkpointing: bool, device: str) -> list[int]:
    """Eager vs compiled over every layout; returns the graphs compiled at each layout."""
    torch._dynamo.reset()
    eager, compiled = lora_llama(checkpointing, device), lora_llama(checkpointing, device)
    assert compile_blocks(compiled) == 4
    graphs = []
    for lengths in MULTI + SINGLE:
        want, want_grads = loss_and_grads(eager, lengths, device)
        before = CompileStats.now()
        got, got_grads = loss_and_grads(compiled, lengths, device)
        graphs.append(CompileStats.now().since(before)["graphs_compiled"])
        torch.testing.assert_close(got, want, atol=0, rtol=1e-6)
        assert got_grads.keys() == want_grads.keys()
        for n in want_grads:
            torch.testing.assert_close(got_grads[n], want_grads[n], atol=1e-6, rtol=1e-4, msg=n)
    return graphs


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", [False, True])
def test_compiled_blocks_match_eager_without_recompiling(checkpointing: bool) -> None:
    graphs = compare(checkpointing, "cpu")
    # At the first packed batch of several rows and at the first of one row: one graph for the
    # blocks, two without checkpointing (the first block's input, from the frozen embedding,
    # needs no gradient; peft makes it need one when checkpointing). None for the other
    # layouts, whatever their lengths.
    first = 1 if checkpointing else 2
    assert graphs == [first, 0, 0, 0, first, 0], graphs


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_blocks_match_eager_on_cuda() -> None:
    graphs = compare(True, "cuda")
    assert graphs == [1, 0, 0, 0, 1, 0], graphs


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_flash_varlen_blocks_do_not_recompile_on_cuda() -> None:
    """bf16 on CUDA: attention through torch's flash varlen kernel inside the compiled blocks
    (`posttrain.models.flash_varlen`), one graph per kind of batch whatever the lengths; the
    loss equals eager's to bf16 rounding."""
    torch._dynamo.reset()
    eager, compiled = lora_llama(True, "cuda"), lora_llama(True, "cuda")
    compile_blocks(compiled)
    graphs = []
    for lengths in MULTI + SINGLE:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            want, _ = loss_and_grads(eager, lengths, "cuda")
            before = CompileStats.now()
            got, _ = loss_and_grads(compiled, lengths, "cuda")
        graphs.append(CompileStats.now().since(before)["graphs_compiled"])
        torch.testing.assert_close(got, want, atol=0, rtol=2e-2)
    assert graphs == [1, 0, 0, 0, 1, 0], graphs


def train(model: torch.nn.Module) -> list[float]:
    """One AdamW step per layout -> the losses (a step changes the weights the next sees)."""
    opt = build_optimizer([p for p in model.parameters() if p.requires_grad], OptimConfig(lr=1e-2))
    losses = []
    for lengths in MULTI + SINGLE:
        loss, _ = loss_and_grads(model, lengths, "cpu")
        losses.append(float(loss))
        opt.step()
    return losses


@pytest.mark.slow
def test_compiled_fsdp2_blocks_train_as_eager() -> None:
    """FSDP2 (one rank, `shard_single_device`) with checkpointing, blocks compiled after
    sharding: FSDP's per-block hooks run around the compiled body, losses follow eager's."""
    torch._dynamo.reset()
    d = init_distributed("cpu", 60, 1)
    try:
        eager = place_model(lora_llama(True, "cpu"), d.mesh, "fp32")
        sharded = place_model(lora_llama(True, "cpu"), d.mesh, "fp32", shard_single_device=True)
        assert is_sharded(sharded) and compile_blocks(sharded) == 4
        before = CompileStats.now()
        got, want = train(sharded), train(eager)
        assert CompileStats.now().since(before)["graphs_compiled"] == 2  # several rows; one row
    finally:
        shutdown()
    assert got == pytest.approx(want, rel=1e-5)


@pytest.mark.slow
def test_compiled_lora_dropout_draws_eager_masks() -> None:
    """LoRA dropout inside a compiled block draws from torch's generator, as eager does: the
    same seed gives the same loss (inductor's own RNG would give other masks)."""
    torch._dynamo.reset()
    eager, compiled = lora_llama(False, "cpu", 0.3), lora_llama(False, "cpu", 0.3)
    compile_blocks(compiled)
    for lengths in MULTI[:2]:
        losses = []
        for model in (eager, compiled):
            torch.manual_seed(5)
            losses.append(loss_and_grads(model, lengths, "cpu")[0])
        torch.testing.assert_close(losses[1], losses[0], atol=0, rtol=1e-6)
