"""One device, no FSDP2 (`posttrain.distributed.fsdp.place_model`, architecture decision 45): a
model on a mesh of one is left unwrapped, and sharded only with `shard_single_device`; both train
to the same losses, a checkpoint saved by either loads into the other, a meta-built base fills
unwrapped, and bf16 compute under autocast agrees with FSDP's bf16 cast to bf16 rounding."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch.distributed.fsdp import FSDPModule
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from posttrain.distributed.fsdp import forward_method, grad_sync, place_model
from posttrain.distributed.runtime import all_reduce_sums, init_distributed, shutdown
from posttrain.kinds.ingest import FromConfigModel
from posttrain.models.lora import apply_lora
from posttrain.models.sharded_load import build_on_meta, fill_from_checkpoint
from posttrain.models.tiny import build_model
from posttrain.sections.shared import LoraConfig, OptimConfig
from posttrain.train.checkpoint import save_checkpoint, trainable_state_dict
from posttrain.train.forward_logps import forward_nll_sum
from posttrain.train.optim import build_optimizer, build_scheduler
from posttrain.train.resume import resume_newest_intact


class _Tok:
    pad_token_id, eos_token_id = 0, 1

    def __len__(self) -> int:
        return 320


@pytest.fixture(scope="module")
def mesh() -> Iterator[object]:
    d = init_distributed("cpu", 60, 1)
    try:
        yield d.mesh
    finally:
        shutdown()


def _lora_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = FromConfigModel(
        hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64, vocab_size=320
    )
    return apply_lora(build_model(cfg, _Tok()), LoraConfig(r=4, alpha=8))


def _batch(n: int = 4, t: int = 12) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(2, 256, (n, t), generator=g)
    mask = torch.ones_like(ids)
    mask[0, -4:] = 0  # one padded row
    labels = ids.masked_fill(mask == 0, -100)
    pos = torch.arange(t).expand(n, t)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels, "position_ids": pos}


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _train(model: torch.nn.Module, steps: int, chunk: int = 0) -> list[float]:
    """`steps` AdamW steps over two micro-batches each -> the losses."""
    opt = build_optimizer([p for p in model.parameters() if p.requires_grad], OptimConfig(lr=1e-2))
    b = _batch()
    halves = [{k: v[:2] for k, v in b.items()}, {k: v[2:] for k, v in b.items()}]
    losses = []
    for _ in range(steps):
        total = torch.zeros(())
        for k, mb in enumerate(halves):
            grad_sync(model, k == len(halves) - 1)
            nll, n = forward_nll_sum(model, mb, chunk)
            (nll / 40).backward()
            total += nll.detach().float()
        losses.append(float(total) / 40)
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses


@pytest.mark.parametrize("chunk", [0, 16], ids=["full-logits", "chunked-head"])
def test_one_device_is_unwrapped_and_trains_as_sharded(mesh, chunk: int) -> None:
    plain = place_model(_lora_model(), mesh, "fp32")
    sharded = place_model(_lora_model(), mesh, "fp32", shard_single_device=True)
    assert not isinstance(plain, FSDPModule)
    assert not any(isinstance(m, FSDPModule) for m in plain.modules())
    assert isinstance(sharded, FSDPModule)
    a, b = _train(plain, 3, chunk), _train(sharded, 3, chunk)
    assert a[0] == pytest.approx(b[0], abs=1e-6)  # same weights, same batch
    assert a == pytest.approx(b, abs=1e-5)  # and the same updates after
    pa, pb = trainable_state_dict(plain), trainable_state_dict(sharded)
    assert pa.keys() == pb.keys()
    for k in pa:
        torch.testing.assert_close(pa[k], _full(pb[k]), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(
    "saved_sharded", [False, True], ids=["plain-to-sharded", "sharded-to-plain"]
)
def test_checkpoint_loads_across_wrapping(mesh, tmp_path: Path, saved_sharded: bool) -> None:
    """A checkpoint has the same names and tensors either way (DCP stores full tensors from a
    plain module, shards from a sharded one): each loads into the other, weights and AdamW
    moments exactly. (Across world sizes through the stages: tests/test_resume.py.)"""
    src = place_model(_lora_model(), mesh, "fp32", shard_single_device=saved_sharded)
    opt = build_optimizer([p for p in src.parameters() if p.requires_grad], OptimConfig())
    sched = build_scheduler(opt, 10, OptimConfig())
    _train_one(src, opt)
    path = save_checkpoint(tmp_path, 1, src, opt, sched, 1)
    want = {k: _full(v).clone() for k, v in trainable_state_dict(src).items()}
    want_m = [_full(s["exp_avg"]).clone() for s in opt.state.values()]

    dst = place_model(_lora_model(seed=9), mesh, "fp32", shard_single_device=not saved_sharded)
    opt2 = build_optimizer([p for p in dst.parameters() if p.requires_grad], OptimConfig())
    sched2 = build_scheduler(opt2, 10, OptimConfig())
    point = resume_newest_intact(tmp_path, dst, opt2, sched2)  # what a stage's resume runs
    assert point.path == path and point.meta["step"] == 1
    got = trainable_state_dict(dst)
    for k, v in want.items():
        assert torch.equal(_full(got[k]), v), k
    for m, s in zip(want_m, opt2.state.values(), strict=True):
        assert torch.equal(_full(s["exp_avg"]), m)


def _train_one(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    nll, n = forward_nll_sum(model, _batch(), 0)
    (nll / n).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def test_meta_built_base_fills_unwrapped(mesh, tmp_path: Path) -> None:
    """build_on_meta -> LoRA -> place_model (unwrapped) -> fill_from_checkpoint gives the
    from_pretrained model: every tensor real, equal, tied embeddings still tied."""
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        tie_word_embeddings=True,
    )
    torch.manual_seed(1)
    LlamaForCausalLM(cfg).save_pretrained(str(tmp_path))
    torch.manual_seed(5)
    old = apply_lora(AutoModelForCausalLM.from_pretrained(str(tmp_path)), LoraConfig(r=4, alpha=8))
    torch.manual_seed(5)
    new, files = build_on_meta(tmp_path, AutoModelForCausalLM, torch.float32)
    new = place_model(apply_lora(new, LoraConfig(r=4, alpha=8)), mesh, "fp32")
    fill_from_checkpoint(new, files, torch.device("cpu"))
    assert not isinstance(new, FSDPModule)
    a, b = old.state_dict(), new.state_dict()
    assert a.keys() == b.keys()
    assert [k for k in a if b[k].is_meta or not torch.equal(a[k], b[k])] == []
    assert not any(t.is_meta for t in (*new.parameters(), *new.buffers()))
    inner = new.get_base_model()
    assert inner.lm_head.weight is inner.model.embed_tokens.weight
    ids = _batch()["input_ids"]
    with torch.no_grad():
        assert torch.equal(old.eval()(input_ids=ids).logits, new.eval()(input_ids=ids).logits)


def test_bf16_compute_unwrapped_matches_fsdp_cast(mesh) -> None:
    """precision bf16 at one device: the forward (and `generate` through `forward_method`) runs
    under autocast, matmuls in bf16 from fp32 masters; the loss is FSDP's bf16 one to bf16
    rounding, and the gradients reach the fp32 LoRA factors."""
    plain = place_model(_lora_model(), mesh, "bf16")
    sharded = place_model(_lora_model(), mesh, "bf16", shard_single_device=True)
    b = _batch()
    logits = plain(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
    assert logits.dtype == torch.bfloat16  # computed in bf16, as FSDP's cast does
    la, _ = forward_nll_sum(plain, b, 16)
    lb, _ = forward_nll_sum(sharded, b, 16)
    assert float(la) == pytest.approx(float(lb), rel=2e-2)
    la.backward()
    grads = [p.grad for p in plain.parameters() if p.requires_grad]
    assert grads and all(g is not None and g.dtype == torch.float32 for g in grads)
    assert any(float(g.abs().sum()) > 0 for g in grads)
    forward_method(plain, "generate")
    with torch.no_grad():
        out = plain.generate(input_ids=b["input_ids"][:1], max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 15)


def test_all_reduce_sums_reads_tensors_and_floats_at_once() -> None:
    sums = {"a": torch.tensor(1.5), "b": 2.0, "c": torch.tensor(3, dtype=torch.int64)}
    assert all_reduce_sums(sums, torch.device("cpu")) == {"a": 1.5, "b": 2.0, "c": 3.0}
