"""Numerical guards, each triggered for real.

- StepGuard bookkeeping: pure, hand-computed (fast).
- TrainSession.optimizer_step on a real tiny LoRA model in a real (world of one) process group:
  a NaN step and a loss spike leave parameters, optimizer state and schedule bit-identical.
- A real SFT stage with an absurd learning rate (1e20: after one update the LoRA product
  overflows fp32, so the forward returns NaN): updates skipped, stopped after
  max_bad_steps + 1, the checkpoint from before the blow-up untouched and resumable.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from posttrain.config.schema import GuardConfig, Recipe
from posttrain.train.guard import StepGuard, TooManyBadSteps
from tests.stage_helpers import TINY, planned_dir, run_inprocess, write_recipe

NAN, INF = float("nan"), float("inf")


# --- StepGuard: window and spike bookkeeping ---------------------------------------------------


def test_window_stops_after_max_bad_steps_plus_one() -> None:
    g = StepGuard(GuardConfig(max_bad_steps=2, window=4), where="stage sft")
    verdicts = []
    for step, (loss, norm) in enumerate([(1.0, 1.0), (NAN, 1.0), (1.0, INF), (1.0, 1.0)], 1):
        reason = g.judge(loss, norm)
        verdicts.append(reason)
        g.commit(step, loss, reason)
    assert verdicts == [None, "non-finite loss (nan)", "non-finite grad norm (inf)", None]
    assert g.skipped == 2
    # Step 5: window = steps 2..5, holding 3 bad steps > 2.
    reason = g.judge(INF, 1.0)
    with pytest.raises(TooManyBadSteps) as info:
        g.commit(5, INF, reason)
    assert info.value.step == 5
    assert [s for s, _ in info.value.bad] == [2, 3, 5]
    msg = str(info.value)
    assert "stage sft: stopped at step 5: 3 bad steps within the last 4 optimizer steps" in msg
    assert "step 2: non-finite loss (nan)" in msg and "step 5: non-finite loss (inf)" in msg


def test_bad_steps_leave_the_window() -> None:
    g = StepGuard(GuardConfig(max_bad_steps=1, window=3))
    # Bad at 1 and 4: never two inside the same 3 steps, so it never stops.
    for step, loss in enumerate([NAN, 1.0, 1.0, NAN, 1.0, 1.0, NAN], 1):
        g.commit(step, loss, g.judge(loss, 1.0))
    assert g.skipped == 3
    g2 = StepGuard(GuardConfig(max_bad_steps=1, window=3))
    g2.commit(1, NAN, "x")
    g2.commit(2, 1.0, None)
    with pytest.raises(TooManyBadSteps):  # steps 1 and 3 are within 3 steps
        g2.commit(3, NAN, "y")


def test_max_bad_steps_zero_stops_at_the_first_bad_step() -> None:
    g = StepGuard(GuardConfig(max_bad_steps=0, window=1))
    g.commit(1, 1.0, None)
    with pytest.raises(TooManyBadSteps, match="stopped at step 2: 1 bad steps"):
        g.commit(2, NAN, g.judge(NAN, 1.0))


def test_loss_spike_against_good_history_only() -> None:
    cfg = GuardConfig(loss_spike_k=2.0, loss_spike_window=3, loss_spike_min_history=3)
    g = StepGuard(cfg)
    g.commit(1, 1.0, g.judge(1.0, 1.0))
    g.commit(2, 2.0, g.judge(2.0, 1.0))
    assert g.judge(100.0, 1.0) is None  # 2 losses < min_history 3: no spike test yet
    g.commit(3, 3.0, g.judge(3.0, 1.0))
    # history 1, 2, 3: mean 2, population std sqrt(2/3) = 0.8165; limit 2 + 2 x 0.8165 = 3.633
    assert g.judge(3.63, 1.0) is None
    reason = g.judge(3.64, 1.0)
    assert reason is not None and reason.startswith("loss spike (3.64 > mean 2 + 2 x std 0.816497")
    g.commit(4, 3.64, reason)
    assert list(g.good_losses) == [1.0, 2.0, 3.0]  # the spike does not raise the baseline
    g.commit(5, 3.5, g.judge(3.5, 1.0))
    assert list(g.good_losses) == [2.0, 3.0, 3.5]  # window of 3
    # k off: the same loss is fine
    assert StepGuard(GuardConfig()).judge(1e9, 1.0) is None


def test_scaler_owns_non_finite_gradients() -> None:
    g = StepGuard(GuardConfig())
    assert g.judge(1.0, INF, check_norm=False) is None
    assert g.judge(NAN, 1.0, check_norm=False) == "non-finite loss (nan)"


def test_guard_state_round_trips_for_resume() -> None:
    cfg = GuardConfig(max_bad_steps=1, window=5, loss_spike_k=3.0)
    g = StepGuard(cfg)
    for step, loss in enumerate([1.0, NAN, 2.0], 1):
        g.commit(step, loss, g.judge(loss, 1.0))
    state = json.loads(json.dumps(g.state_dict()))
    h = StepGuard(cfg)
    h.load_state_dict(state)
    assert list(h.recent) == list(g.recent) and list(h.good_losses) == [1.0, 2.0]
    assert h.skipped == 1
    with pytest.raises(TooManyBadSteps, match="step 2: non-finite loss"):
        h.commit(4, NAN, "non-finite loss (nan)")


def test_guard_config_is_checked() -> None:
    with pytest.raises(ValueError, match="must be below window"):
        GuardConfig(max_bad_steps=5, window=5)
    with pytest.raises(ValueError, match="spike test would never apply"):
        GuardConfig(loss_spike_window=5, loss_spike_min_history=6)


def test_fingerprints_carry_the_spike_test_only() -> None:
    from posttrain.pipeline import plan

    def fps(**guard: object) -> dict[str, str]:
        recipe = Recipe.model_validate({**copy.deepcopy(TINY), "guard": guard})
        return {s.name: s.fingerprint for s in plan(recipe)}

    base = fps()
    assert fps(max_bad_steps=10, window=100) == base  # decides failure, not the result
    spiky = fps(loss_spike_k=4.0)
    assert spiky["ingest"] == base["ingest"]
    assert spiky["sft"] != base["sft"]


# --- TrainSession on a real tiny model ---------------------------------------------------------


def _tiny_session(tmp_path: Path, guard: dict):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from posttrain.config.loader import section_batch
    from posttrain.config.schema import LoraConfig, OptimConfig
    from posttrain.distributed.runtime import init_distributed
    from posttrain.models.lora import apply_lora
    from posttrain.stages.common import StageContext
    from posttrain.train.session import start_session

    data = copy.deepcopy(TINY)
    data["run"]["workspace"] = str(tmp_path / "ws")
    data["infra"].update(precision="fp32", threads_per_rank=1)
    data["guard"] = guard
    recipe = Recipe.model_validate(data)
    ctx = StageContext("sft", "f" * 16, tmp_path / "out", recipe, {}, {})
    ctx.out_dir.mkdir()
    ctx.dist = init_distributed("cpu", 60, 1)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
    )
    model = apply_lora(LlamaForCausalLM(cfg), LoraConfig(r=4))
    batch = section_batch(recipe, "sft")
    tr = start_session(ctx, model, OptimConfig(lr=1e-2), batch, total_steps=10)
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))  # [B, T]
    return ctx, tr, ids


def _snapshot(tr) -> dict:
    import torch

    params = [p.detach().to_local().clone() for p in tr.trainable]
    opt = {
        (i, k): (v.to_local() if hasattr(v, "to_local") else v).clone()
        for i, p in enumerate(tr.trainable)
        for k, v in tr.opt.state[p].items()
        if torch.is_tensor(v)
    }
    return {"params": params, "opt": opt, "sched": tr.sched.state_dict()}


def _same(a: dict, b: dict) -> bool:
    import torch

    return (
        all(torch.equal(x, y) for x, y in zip(a["params"], b["params"], strict=True))
        and a["opt"].keys() == b["opt"].keys()
        and all(torch.equal(a["opt"][k], b["opt"][k]) for k in a["opt"])
        and a["sched"] == b["sched"]
    )


def test_session_skips_non_finite_and_spiking_steps_bit_exactly(tmp_path: Path) -> None:
    from posttrain.distributed.runtime import shutdown
    from posttrain.telemetry.metrics import read_metrics

    guard = {"max_bad_steps": 2, "window": 10, "loss_spike_k": 3.0}
    guard |= {"loss_spike_window": 2, "loss_spike_min_history": 2}
    ctx, tr, ids = _tiny_session(tmp_path, guard)
    try:

        def step(n: int, scale: float) -> tuple[float, float]:
            loss = tr.model(input_ids=ids, labels=ids).loss * scale
            tr.backward(loss)
            return tr.optimizer_step(1.0, loss=float(loss.detach()), step=n)

        step(1, 1.0)
        step(2, 1.0)
        before = _snapshot(tr)
        assert before["opt"], "AdamW state exists after two steps"
        norm, _ = step(3, float("nan"))  # a real NaN loss and NaN gradients
        assert norm != norm
        assert all(p.grad is None for p in tr.trainable)
        assert _same(before, _snapshot(tr)), "a skipped step changed the model or optimizer"
        step(4, 1e3)  # finite, but far above mean + 3 std of the last two good losses
        assert _same(before, _snapshot(tr))
        step(5, 1.0)
        assert not _same(before, _snapshot(tr)), "a good step must still update"
        with pytest.raises(TooManyBadSteps, match="stopped at step 6: 3 bad steps") as info:
            step(6, float("inf"))
        assert [s for s, _ in info.value.bad] == [3, 4, 6]
        assert tr.skipped_steps == 3
        assert tr.summary(ctx)["skipped_steps"] == 3
        assert tr.headline()["skipped_steps"] == 3
        tr.metrics.close()
        records = read_metrics(tmp_path / "out" / "metrics.jsonl", "guard")
        assert [r["step"] for r in records] == [3, 4, 6]
        assert records[0]["reason"] == "non-finite loss (nan)" and records[0]["loss"] != 0
        assert records[1]["reason"].startswith("loss spike (")
        assert set(records[0]) >= {"step", "reason", "loss", "grad_norm", "lr"}
    finally:
        shutdown()


# --- a real SFT stage that blows up ------------------------------------------------------------


def _blowup_recipe(folder: Path) -> Path:
    data = copy.deepcopy(TINY)
    data["infra"]["threads_per_rank"] = 1
    data["ingest"]["from_config"]["pretrain_steps"] = 30
    # lr 1e20: the first update moves every LoRA weight by ~1e20, so the next forward's
    # B @ A product overflows fp32 and the loss is NaN on every later step.
    data["sft"]["optim"].update(lr=1e20, warmup_steps=0)
    data["sft"].update(max_steps=12, checkpoint_every=1, keep_checkpoints=3)
    data["guard"] = {"max_bad_steps": 3, "window": 10}
    return write_recipe(folder, data)


@pytest.mark.slow
def test_sft_blowup_is_skipped_then_stopped_and_the_checkpoint_kept(tmp_path: Path) -> None:
    from posttrain.telemetry.metrics import read_metrics
    from posttrain.train.checkpoint import complete_checkpoints

    recipe = _blowup_recipe(tmp_path)
    run_inprocess("ingest", recipe)
    out = planned_dir("sft", recipe)
    with pytest.raises(SystemExit) as exit_info:
        run_inprocess("sft", recipe)
    assert exit_info.value.code == 1
    error = (out / "logs" / "error.txt").read_text()
    assert "TooManyBadSteps: stage sft: stopped at step 5: 4 bad steps" in error
    assert "step 2: non-finite loss (nan)" in error
    assert not (out / "manifest.json").exists()

    metrics = out / "metrics.jsonl"
    guard = read_metrics(metrics, "guard")
    assert [r["step"] for r in guard] == [2, 3, 4, 5]
    train = read_metrics(metrics, "train")
    # The schedule did not advance over skipped steps: every skipped step reports step 2's lr.
    assert len({r["lr"] for r in train[1:]}) == 1 and train[1]["lr"] < train[0]["lr"]
    assert all(r.get("skipped_updates") == 1 for r in train[1:])

    # The only checkpoint is step 1's, written before the first bad step, and complete.
    ckpts = complete_checkpoints(out / "checkpoints")
    assert [c.name for c in ckpts] == ["step_0000001"]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_0000001"]
    first_bad = guard[0]["time"]
    files = [p for p in ckpts[0].rglob("*") if p.is_file()]
    assert files and all(p.stat().st_mtime <= first_bad for p in files)
    meta = json.loads((ckpts[0] / "meta.json").read_text())
    assert meta["step"] == 1 and meta["guard"]["recent"] == [[1, None]]
    stamp = {p: (p.stat().st_mtime_ns, p.stat().st_size) for p in files}

    # A re-run resumes from it (it loads), replays step 2 to the same verdict and stops again,
    # leaving the checkpoint as it was.
    with pytest.raises(SystemExit):
        run_inprocess("sft", recipe)
    log = (out / "logs" / "error.txt").read_text()
    assert "stopped at step 5: 4 bad steps" in log
    starts = read_metrics(metrics, "start")
    assert starts[-1]["start_step"] == 1
    assert [r["step"] for r in read_metrics(metrics, "guard")] == [2, 3, 4, 5]
    assert {p: (p.stat().st_mtime_ns, p.stat().st_size) for p in files} == stamp
    assert [c.name for c in complete_checkpoints(out / "checkpoints")] == ["step_0000001"]
