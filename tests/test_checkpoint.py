"""A checkpoint holds each trainable weight once (no frozen or duplicate tied embedding) and
loads back exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from posttrain.distributed.fsdp import shard_model
from posttrain.distributed.runtime import init_distributed, shutdown
from posttrain.kinds.ingest import FromConfigModel
from posttrain.models.lora import apply_lora
from posttrain.models.tiny import build_model
from posttrain.sections.shared import LoraConfig, OptimConfig
from posttrain.train.checkpoint import save_checkpoint, trainable_state_dict
from posttrain.train.optim import build_optimizer, build_scheduler
from posttrain.train.resume import resume_newest_intact


class _Tok:
    pad_token_id, eos_token_id = 0, 1

    def __len__(self) -> int:
        return 512


@pytest.mark.parametrize(("tied", "lora"), [(True, True), (False, True), (True, False)])
def test_checkpoint_holds_each_trainable_weight_once(
    tmp_path: Path, tied: bool, lora: bool
) -> None:
    d = init_distributed("cpu", 60, 1)
    try:
        cfg = FromConfigModel(
            hidden_size=64,
            num_layers=2,
            num_heads=4,
            intermediate_size=128,
            vocab_size=512,
            tie_word_embeddings=tied,
        )
        model = build_model(cfg, _Tok())
        if lora:
            model = apply_lora(model, LoraConfig(r=4, alpha=8))
        # named_parameters() names a shared (tied) parameter once: the set to expect.
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        model = shard_model(model, d.mesh, "fp32")
        opt = build_optimizer([p for p in model.parameters() if p.requires_grad], OptimConfig())
        sched = build_scheduler(opt, 1, OptimConfig())
        path = save_checkpoint(tmp_path, 1, model, opt, sched, 1)
        meta = dcp.FileSystemReader(str(path)).read_metadata()
        saved = {
            k.removeprefix("model.") for k in meta.state_dict_metadata if k.startswith("model.")
        }
        # LoRA + tied: no frozen 'lm_head.weight' alias; full + tied: the embedding once.
        assert saved == trainable
        # Perturb the adapter, resume (the path a stage takes): the saved values come back.
        before = {k: v.full_tensor().clone() for k, v in trainable_state_dict(model).items()}
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad:
                    p.add_(1.0)
        point = resume_newest_intact(tmp_path, model, opt, sched)
        assert point.path == path and point.verified
        after = trainable_state_dict(model)
        for k, v in before.items():
            assert torch.equal(after[k].full_tensor(), v), k
    finally:
        shutdown()


def test_retention_and_incomplete_checkpoints(tmp_path: Path) -> None:
    """Keep the newest `keep` complete checkpoints; a half-written one (`.tmp`, or no meta.json)
    is never taken for the newest, and the next save of that step replaces it."""
    from posttrain.train.checkpoint import complete_checkpoints

    d = init_distributed("cpu", 60, 1)
    try:
        cfg = FromConfigModel(
            hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, vocab_size=512
        )
        model = shard_model(
            apply_lora(build_model(cfg, _Tok()), LoraConfig(r=2, alpha=4)), d.mesh, "fp32"
        )
        opt = build_optimizer([p for p in model.parameters() if p.requires_grad], OptimConfig())
        sched = build_scheduler(opt, 10, OptimConfig())
        for step in (1, 2, 3):
            save_checkpoint(tmp_path, step, model, opt, sched, keep=2)
        assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_0000002", "step_0000003"]
        # A save killed half-way: its temp folder, and a renamed folder missing meta.json.
        (tmp_path / "step_0000004.tmp").mkdir()
        (tmp_path / "step_0000004.tmp" / "__0_0.distcp").write_bytes(b"partial")
        (tmp_path / "step_0000009").mkdir()
        assert complete_checkpoints(tmp_path)[-1].name == "step_0000003"
        save_checkpoint(tmp_path, 4, model, opt, sched, keep=2)
        assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_0000003", "step_0000004"]
        assert not (tmp_path / "step_0000004.tmp").exists()
        assert resume_newest_intact(tmp_path, model, opt, sched).meta["step"] == 4
    finally:
        shutdown()
