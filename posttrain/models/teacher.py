"""The frozen teacher of a distillation stage, on a base model of its own (the `teacher_base`
role: possibly wider than the student's, of the same family).

Built like the student (`posttrain.train.session.start_session` places it): on the meta device,
sharded over the ranks with FSDP2 (one `fully_shard` per decoder block and the root; on one
device unwrapped), each rank filling only its shards from the checkpoint, the base in
`infra.base_dtype` (bf16 on GPUs). A teacher that is a policy stage carries that stage's LoRA
adapter, frozen; a teacher that is a base is its own weights. Nothing of it trains: it has no
gradients and no optimizer state, so its memory is its weights' shards and the activations of
one scoring forward. It is a `RoleModel` whose policy is the teacher, so the rollout engines
can sample from it and `RoleModel.forward` gives its logits on the rows the student's are read
from (padded or padding-free).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from peft import PeftModel

from posttrain.distributed.fsdp import forward_method, place_model
from posttrain.errors import RecipeVerdict
from posttrain.models.adapters import POLICY
from posttrain.models.loading import base_dtype, base_for_training
from posttrain.models.roles import RoleModel
from posttrain.models.sharded_load import adapters_stay_real, fill_from_checkpoint
from posttrain.models.vocab import vocab_mismatch

log = logging.getLogger("posttrain.distill")


def build_teacher(ctx: Any, student_tokenizer: Any | None = None) -> tuple[RoleModel, Any]:
    """(the teacher placed on this rank's device(s) in eval mode with `generate` and `decode`
    registered as forward methods, its tokenizer). With `student_tokenizer` (token-level
    distillation), a teacher tokenizing with another vocabulary is refused first, before its
    weights are read (a RecipeVerdict on the section's `teacher`, naming both)."""
    infra, d = ctx.recipe.infra, ctx.dist
    dtype = base_dtype(infra)
    base, tok, files = base_for_training(
        ctx.role_dir("teacher_base"), ctx.role_manifest("teacher_base"), dtype, infra.attention
    )
    if student_tokenizer is not None:
        names = (ctx.stage.roles["base"], ctx.stage.roles["teacher"])
        if problem := vocab_mismatch(student_tokenizer, tok, names):
            raise RecipeVerdict("teacher", problem, ctx.where)
    adapter = ctx.adapter_dir("teacher")
    lm: Any = base
    if adapter is not None:
        with adapters_stay_real():  # a base on the meta device keeps the adapter's values
            lm = PeftModel.from_pretrained(base, str(adapter), adapter_name=POLICY)
    lm.requires_grad_(False)
    model = place_model(
        RoleModel(lm, None, None), d.mesh, infra.precision, dtype, infra.shard_single_device
    )
    fill_from_checkpoint(model, files, d.device)
    model.eval()
    for name in ("generate", "decode"):
        forward_method(model, name)
    total = sum(p.numel() for p in model.parameters())
    log.info(
        "teacher %s on base %s: %s parameters (this rank's shards), frozen",
        ctx.stage.roles["teacher"],
        ctx.stage.roles["teacher_base"],
        f"{total:,}",
    )
    return model, tok


@torch.no_grad()
def teacher_logits(model: RoleModel, inputs: dict[str, Any], vocab: int) -> torch.Tensor:
    """The teacher's next-token logits [n, R, vocab] at the response positions of `inputs`
    (`posttrain.rl.rollout.sample.model_inputs`), sliced to the shared vocabulary."""
    return model(POLICY, **inputs)[..., :vocab]
