"""No host sync in a training step (issue 42, point 5), on a real tiny LoRA model on the CPU.

- The collator takes the chunked head's scored positions on the host (`target_positions`); the
  head gathers and scatters by them, bit-equal to the boolean-mask indexing it replaces, and
  needs no tensor data to do it (it runs on the meta device, where the mask path cannot).
- An SFT step (`sft_step` + `Training.finish_step`) reads the device exactly once: the guard's
  copy of (loss, grad norm); training with the loss kept on the device is bit-equal to reading
  it with float() per step, as before.
- Under autocast, peft's input casts are off, and training is bit-equal to having them on.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from stage_helpers import TINY

from posttrain.config.loader import section_batch
from posttrain.config.schema import Recipe
from posttrain.data.batching import collate, pad_batch
from posttrain.data.chat import IGNORE
from posttrain.data.segments import flat_batch
from posttrain.distributed.runtime import init_distributed, shutdown
from posttrain.models.chunked import head_scores, shifted_targets
from posttrain.models.lora import apply_lora
from posttrain.runtime.context import StageContext
from posttrain.runtime.spec import PlannedStage
from posttrain.sections.shared import LoraConfig
from posttrain.stages.sft import sft_step
from posttrain.telemetry import heartbeat
from posttrain.train.loop import Draw, Training, open_training

# --- the head by host-side positions -------------------------------------------------------------


def _rows(n: int = 5, seed: int = 0) -> list[dict[str, list[int]]]:
    """Rows of different lengths whose first few tokens are prompt (IGNORE labels)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        t = 6 + 3 * i
        ids = torch.randint(2, 60, (t,), generator=g).tolist()
        rows.append({"input_ids": ids, "labels": [IGNORE] * (2 + i % 3) + ids[2 + i % 3 :]})
    return rows


@pytest.mark.parametrize("flat", [False, True], ids=["padded", "padding-free"])
def test_target_positions_are_the_scored_positions(flat: bool) -> None:
    batch = flat_batch(_rows()) if flat else pad_batch(_rows(), 0)
    scored = shifted_targets(batch["labels"]) != IGNORE  # [B, T]
    assert batch["target_positions"].device.type == "cpu"
    assert torch.equal(batch["target_positions"], scored.reshape(-1).nonzero().squeeze(1))


def _mask_head_scores(head, hidden, targets, chunk, entropy):  # the code before, as reference
    from posttrain.models.chunked import chunked_target_logps

    mask = targets != IGNORE
    logp_n, ent_n = chunked_target_logps(
        hidden[mask], head.weight, head.bias, targets[mask], chunk, entropy
    )
    logp = logp_n.new_zeros(targets.shape)
    logp[mask] = logp_n
    if ent_n is None:
        return logp, None
    ent = ent_n.new_zeros(targets.shape)
    ent[mask] = ent_n
    return logp, ent


def _head_inputs(device: str = "cpu") -> tuple[torch.nn.Linear, torch.Tensor, dict[str, Any]]:
    torch.manual_seed(0)
    batch = pad_batch(_rows(), 0)
    head = torch.nn.Linear(16, 64, bias=True).to(device)
    hidden = torch.randn(*batch["labels"].shape, 16, device=device, requires_grad=True)
    return head, hidden, batch


@pytest.mark.parametrize("entropy", [False, True])
def test_head_by_positions_equals_the_boolean_mask(entropy: bool) -> None:
    head, hidden, batch = _head_inputs()
    targets = shifted_targets(batch["labels"])
    results = []
    for by_positions in (True, False):
        head.zero_grad()
        hidden.grad = None
        if by_positions:
            positions = batch["target_positions"]
            logp, ent = head_scores(head, hidden, targets, 7, entropy, positions=positions)
        else:
            logp, ent = _mask_head_scores(head, hidden, targets, 7, entropy)
        loss = logp.sum() + (ent.sum() if ent is not None else 0.0)
        loss.backward()
        results.append([logp, ent, hidden.grad, head.weight.grad, head.bias.grad])
    for new, old in zip(*results, strict=True):
        assert (new is None and old is None) or torch.equal(new, old)


def test_head_by_positions_reads_no_tensor_data() -> None:
    """On the meta device a tensor has no data: an op whose result depends on it (boolean-mask
    indexing, nonzero) raises, so running there proves the head waits for nothing."""
    head, hidden, batch = _head_inputs("meta")
    targets = shifted_targets(batch["labels"]).to("meta")
    positions = batch["target_positions"].to("meta")
    logp, ent = head_scores(head, hidden, targets, 7, True, positions=positions)
    assert logp.shape == targets.shape and ent is not None and ent.shape == targets.shape
    with pytest.raises((NotImplementedError, RuntimeError)):
        head_scores(head, hidden, targets, 7, True)  # positions found from the mask


# --- an SFT step on a real tiny session -------------------------------------------------------


def _loop(tmp_path: Path, precision: str, flat: bool, lora_dropout: float = 0.0) -> Training:
    """A real SFT `Training` (world of one) over generated rows, logging every 100 steps."""
    data = copy.deepcopy(TINY)
    data["run"]["workspace"] = str(tmp_path / "ws")
    data["infra"].update(precision=precision, threads_per_rank=1, logits_chunk_tokens=16)
    data["sft"].update(log_every=100, max_steps=6)
    data["sft"]["batch"] = {"micro_batch_size": 2, "grad_accum_steps": 2, "padding_free": flat}
    recipe = Recipe.model_validate(data)
    out = tmp_path / f"out-{precision}-{flat}-{lora_dropout}"
    stage = PlannedStage("sft", "posttrain.stages.sft", "f" * 16, out, {}, 1, 60.0)
    ctx = StageContext(stage, recipe, {})
    out.mkdir(parents=True)
    ctx.dist = init_distributed("cpu", 60, 1)
    heartbeat.start(out, 0)
    torch.manual_seed(0)
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    model = apply_lora(LlamaForCausalLM(cfg), LoraConfig(r=4, alpha=8, dropout=lora_dropout))
    rows = _rows(16)
    draw = Draw(rows, lambda r: len(r["input_ids"]), collate, 0)

    class _Data:
        train_rows, eval_rows, train, eval, stats = rows, [], rows, [], {}

    batch = section_batch(recipe, "sft")
    return open_training(ctx, model, None, batch, 6, _Data(), draw, lambda _: None)


def _adapter(loop: Training) -> list[torch.Tensor]:
    return [p.detach().clone() for p in loop.tr.trainable]


def _count_host_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every Python-level read of a tensor's value from now on, by name."""
    calls: list[str] = []
    for name in ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "nonzero"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            calls.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return calls


@pytest.mark.parametrize("flat", [False, True], ids=["padded", "padding-free"])
def test_sft_step_reads_the_device_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flat: bool
) -> None:
    """Padding-free (the default): the forwards and backwards read nothing, the optimizer
    step once. Padded: transformers' SDPA mask builder also checks each padding mask for
    padding (`_ignore_causal_mask_sdpa`, one read per forward), which posttrain leaves be."""
    loop = _loop(tmp_path, "bf16", flat)
    try:
        loop.finish_step(0, sb := loop.step_batch(0), loss=sft_step(loop, sb)[0])
        sb = loop.step_batch(1)  # laid out on the host: not part of the device's step
        calls = _count_host_reads(monkeypatch)
        loss, _ = sft_step(loop, sb)
        forwards = len(sb.micro)
        assert calls == ([] if flat else ["__bool__"] * 2 * forwards)
        calls.clear()
        loop.finish_step(1, sb, loss=loss)  # not a logged step (log_every 100)
        assert calls == ["tolist"], "one read: the guard's (loss, grad norm)"
        monkeypatch.undo()
    finally:
        loop.tr.metrics.close()
        shutdown()


def test_loss_on_the_device_trains_as_the_float_read(tmp_path: Path) -> None:
    """Six steps with the loss read by float() each step and the mask-indexed head (the code
    before) and six with both gone: bit-equal losses and adapters."""
    runs = []
    for before in (True, False):
        loop = _loop(tmp_path / str(before), "bf16", flat=True)
        losses = []
        try:
            for step in loop.steps():
                sb = loop.step_batch(step)
                if before:
                    for mb in sb.micro:
                        del mb["target_positions"]
                loss, _ = sft_step(loop, sb)
                loss = float(loss) if before else loss
                loss, _, _ = loop.tr.optimizer_step(1.0, loss=loss, step=step + 1)
                losses.append(loss)
            runs.append((losses, _adapter(loop)))
        finally:
            loop.tr.metrics.close()
            shutdown()
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1], strict=True))


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_no_peft_input_casts_under_autocast_trains_the_same(tmp_path: Path, dropout: float) -> None:
    """Without LoRA dropout the casts go and training is bit-equal with them put back; with
    dropout they stay (its scaling rounds differently in bf16)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    runs = []
    for casts in (True, False):
        torch.manual_seed(1)  # the same dropout masks in both runs
        loop = _loop(tmp_path / str(casts), "bf16", flat=False, lora_dropout=dropout)
        layers = [m for m in loop.model.modules() if isinstance(m, BaseTunerLayer)]
        assert layers and all(m.cast_input_dtype_enabled == (dropout > 0) for m in layers)
        for m in layers:
            m.cast_input_dtype_enabled = casts
        try:
            for step in loop.steps():
                sb = loop.step_batch(step)
                loop.finish_step(step, sb, loss=sft_step(loop, sb)[0])
            runs.append(_adapter(loop))
        finally:
            loop.tr.metrics.close()
            shutdown()
    same = all(torch.equal(a, b) for a, b in zip(*runs, strict=True))
    assert same == (dropout == 0.0)


def test_step_metrics_are_read_on_logged_steps_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The preference stages' figures (`step_means`) stay on the device: a step that is not
    logged reads only the guard's pair; a logged one also reads the figures, in one copy, equal
    to the host arithmetic of before (all_reduce_sums, then / global batch)."""
    from posttrain.distributed.runtime import all_reduce_sums
    from posttrain.telemetry.records import read_metrics

    loop = _loop(tmp_path, "fp32", flat=True)
    try:
        sums = {"pair_loss": torch.tensor(1.2345678, dtype=torch.float32), "correct": 3.0}
        sums["margin"] = torch.tensor(-0.3, dtype=torch.float32)
        n = loop.batch.global_batch_size
        before = {k: v / n for k, v in all_reduce_sums(sums, loop.device).items()}
        for step in (0, 5):  # step 6 of 6 is logged (the last), step 1 is not
            sb = loop.step_batch(step)
            loss, _ = sft_step(loop, sb)
            g = loop.step_means(sums)
            calls = _count_host_reads(monkeypatch)
            loop.finish_step(step, sb, loss=loss, **g)
            assert calls == (["tolist"] if step == 0 else ["tolist", "tolist"])
            monkeypatch.undo()
        record = read_metrics(loop.tr.metrics.path, "train")[-1]
        assert record["step"] == 6
        assert {k: record[k] for k in before} == before
    finally:
        loop.tr.metrics.close()
        shutdown()
