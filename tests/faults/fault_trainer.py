"""A tiny sharded LoRA model with its optimizer and schedule, for checkpoint fault tests."""

from __future__ import annotations

import torch

from posttrain.distributed.fsdp import shard_model
from posttrain.kinds.ingest import FromConfigModel
from posttrain.models.lora import apply_lora
from posttrain.models.tiny import build_model
from posttrain.sections.shared import LoraConfig, OptimConfig
from posttrain.train.checkpoint import trainable_state_dict
from posttrain.train.optim import build_optimizer, build_scheduler


class _Tok:
    pad_token_id, eos_token_id = 0, 1

    def __len__(self) -> int:
        return 512


class Trainer:
    """A sharded tiny LoRA model with its optimizer and schedule, as start_session builds them."""

    def __init__(self, mesh) -> None:
        torch.manual_seed(0)
        cfg = FromConfigModel(
            hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, vocab_size=512
        )
        self.model = shard_model(
            apply_lora(build_model(cfg, _Tok()), LoraConfig(r=2, alpha=4)), mesh, "fp32"
        )
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = build_optimizer(params, OptimConfig())
        self.sched = build_scheduler(self.opt, 10, OptimConfig())

    def step(self) -> None:
        """One real AdamW step on a made-up loss: parameters, optimizer state and LR all move."""
        ids = torch.randint(0, 512, (2, 8))
        self.model(input_ids=ids, labels=ids).loss.backward()
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)

    def weights(self) -> dict[str, torch.Tensor]:
        return {k: v.full_tensor().clone() for k, v in trainable_state_dict(self.model).items()}
