"""Numerical guards and the hang watchdog, each triggered for real.

- StepGuard / HangWatch bookkeeping: pure, hand-computed (fast).
- TrainSession.optimizer_step on a real tiny LoRA model in a real (world of one) process group:
  a NaN step and a loss spike leave parameters, optimizer state and schedule bit-identical.
- A real SFT stage with an absurd learning rate (1e20: after one update the LoRA product
  overflows fp32, so the forward returns NaN): updates skipped, stopped after
  max_bad_steps + 1, the checkpoint from before the blow-up untouched and resumable.
- supervise_stage against stage modules using the real heartbeat + faulthandler: a 2-rank
  torchrun stage whose rank 1 blocks is dumped, killed and reported; a slow healthy one is not.
"""

from __future__ import annotations

import copy
import json
import os
import time
from pathlib import Path

import psutil
import pytest
from stage_modules import on_child_path, write_heartbeat_modules

from posttrain.config.loader import resolve
from posttrain.config.schema import Recipe
from posttrain.sections.shared import GuardConfig
from posttrain.telemetry.heartbeat import HangWatch, Heartbeat, read_heartbeats
from posttrain.train.guard import StepGuard, TooManyBadSteps
from tests.stage_helpers import (
    TINY,
    hand_planned,
    planned_dir,
    run_inprocess,
    run_shared,
    write_recipe,
)

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
    from posttrain.plan.planner import plan

    def fps(**guard: object) -> dict[str, str]:
        recipe = Recipe.model_validate({**copy.deepcopy(TINY), "guard": guard})
        return {s.name: s.fingerprint for s in plan(resolve(recipe)).stages}

    base = fps()
    assert fps(max_bad_steps=10, window=100) == base  # decides failure, not the result
    spiky = fps(loss_spike_k=4.0)
    assert spiky["ingest"] == base["ingest"]
    assert spiky["sft"] != base["sft"]


# --- HangWatch: fake clock, real beat files ----------------------------------------------------


def test_hang_settings_reach_training_stages_only() -> None:
    from posttrain.plan.planner import plan

    with pytest.raises(ValueError, match="hang_timeout_s"):
        Recipe.model_validate({**TINY, "infra": {"hang_timeout_s": 0}})
    planned = {s.name: s for s in plan(resolve(Recipe.model_validate(copy.deepcopy(TINY)))).stages}
    assert planned["sft"].hang_timeout_s == 1800 and planned["sft"].hang_startup_s == 1800
    assert planned["ingest"].hang_timeout_s is None  # no beats during the warm-up
    assert planned["evaluate"].hang_timeout_s is None
    off = Recipe.model_validate({**copy.deepcopy(TINY), "infra": {"hang_timeout_s": None}})
    assert all(s.hang_timeout_s is None for s in plan(resolve(off)).stages)


def test_hang_watch_arms_at_first_beat_and_names_the_rank_behind(tmp_path: Path) -> None:
    watch = HangWatch(tmp_path, timeout_s=10, startup_s=100, expected_ranks=(0, 1))
    assert watch.poll(now=0.0) is None
    assert watch.poll(now=1e6) is None  # no beat yet: not armed
    r0, r1 = Heartbeat(tmp_path, 0), Heartbeat(tmp_path, 1)
    r0.beat(phase="start")
    assert watch.poll(now=1000.0) is None
    # rank 1 never beat: still starting, so timeout + startup allowance
    assert watch.poll(now=1000.0 + 105) is None
    hang = watch.poll(now=1000.0 + 111)
    assert hang is not None and hang.behind.rank == 1 and hang.behind.silent_s is None

    r1.beat(phase="start")
    assert watch.poll(now=2000.0) is None
    r0.beat(step=0, phase="train")
    r1.beat(step=0, phase="train")
    assert watch.poll(now=2001.0) is None
    r1.beat(step=1)
    r0.beat(step=1)
    assert watch.poll(now=2002.0) is None
    r0.beat(step=2)  # rank 0 one step further, then both go quiet
    assert watch.poll(now=2003.0) is None
    assert watch.poll(now=2012.9) is None  # 9.9 s since the last change
    hang = watch.poll(now=2013.5)
    assert hang is not None and hang.limit_s == 10
    assert [(r.rank, r.step, r.phase) for r in hang.ranks] == [(1, 1, "train"), (0, 2, "train")]
    assert hang.ranks[0].silent_s == pytest.approx(11.5)
    assert hang.ranks[0].pid == os.getpid()
    assert "rank 1 at step 1 (phase train), silent 11.5 s" in hang.describe()


def test_stage_beats_reach_the_file_within_the_write_interval(tmp_path: Path) -> None:
    from posttrain.telemetry import heartbeat

    hb = heartbeat.start(tmp_path, 0)
    try:
        assert read_heartbeats(tmp_path)[0]["phase"] == "start"  # the first beat at once
        heartbeat.beat(step=0, phase="train")  # a new phase: at once
        assert (read_heartbeats(tmp_path)[0]["step"], hb.seq) == (0, 2)
        for step in range(1, 200):  # within one phase: held in memory, no write per beat
            heartbeat.beat(step=step)
        on_disk = read_heartbeats(tmp_path)[0]["seq"]
        assert on_disk < hb.seq
        deadline = time.monotonic() + 10 * heartbeat.WRITE_INTERVAL_S
        while read_heartbeats(tmp_path)[0]["seq"] != hb.seq and time.monotonic() < deadline:
            time.sleep(0.01)
        beat = read_heartbeats(tmp_path)[0]
        assert (beat["seq"], beat["step"], beat["phase"]) == (201, 199, "train")
        heartbeat.beat(step=200)
        heartbeat.beat(phase="checkpoint")  # a phase change carries the step with it
        assert (read_heartbeats(tmp_path)[0]["step"], read_heartbeats(tmp_path)[0]["seq"]) == (
            200,
            203,
        )
        heartbeat.beat(step=201, phase="train")
        heartbeat.beat(step=202)
    finally:
        heartbeat.stop()  # writes the newest beat
    assert read_heartbeats(tmp_path)[0]["step"] == 202


def test_hang_watch_ignores_an_earlier_launch(tmp_path: Path) -> None:
    Heartbeat(tmp_path, 0).beat(step=7, phase="train")
    watch = HangWatch(tmp_path, timeout_s=1)
    watch.clear()
    assert read_heartbeats(tmp_path) == {}
    assert watch.poll(now=0.0) is None and watch.poll(now=100.0) is None


# --- TrainSession on a real tiny model ---------------------------------------------------------


def _tiny_session(tmp_path: Path, guard: dict):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from posttrain.config.loader import section_batch
    from posttrain.distributed.runtime import init_distributed
    from posttrain.models.lora import apply_lora
    from posttrain.runtime.context import StageContext
    from posttrain.runtime.spec import PlannedStage
    from posttrain.sections.shared import LoraConfig, OptimConfig
    from posttrain.telemetry import heartbeat
    from posttrain.train.session import start_session

    data = copy.deepcopy(TINY)
    data["run"]["workspace"] = str(tmp_path / "ws")
    data["infra"].update(precision="fp32", threads_per_rank=1)
    data["guard"] = guard
    recipe = Recipe.model_validate(data)
    sft = PlannedStage("sft", "posttrain.stages.sft", "f" * 16, tmp_path / "out", {}, 1, 60.0)
    ctx = StageContext(sft, recipe, {})
    ctx.stage.out_dir.mkdir()
    ctx.dist = init_distributed("cpu", 60, 1)
    heartbeat.start(ctx.stage.out_dir, 0)
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

    local = [p.detach().to_local() if hasattr(p, "to_local") else p.detach() for p in tr.trainable]
    params = [p.clone() for p in local]
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
    from posttrain.telemetry import heartbeat
    from posttrain.telemetry.records import read_metrics

    guard = {"max_bad_steps": 2, "window": 10, "loss_spike_k": 3.0}
    guard |= {"loss_spike_window": 2, "loss_spike_min_history": 2}
    ctx, tr, ids = _tiny_session(tmp_path, guard)
    try:

        def step(n: int, scale: float) -> tuple[float, float, float]:
            loss = tr.model(input_ids=ids, labels=ids).loss * scale
            tr.backward(loss)
            return tr.optimizer_step(1.0, loss=float(loss.detach()), step=n)

        step(1, 1.0)
        step(2, 1.0)
        before = _snapshot(tr)
        assert before["opt"], "AdamW state exists after two steps"
        _, norm, _ = step(3, float("nan"))  # a real NaN loss and NaN gradients
        assert norm != norm
        assert all(p.grad is None for p in tr.trainable)
        assert _same(before, _snapshot(tr)), "a skipped step changed the model or optimizer"
        step(4, 1e3)  # finite, but far above mean + 3 std of the last two good losses
        assert _same(before, _snapshot(tr))

        def record(n: int) -> None:
            tr.record_step(
                n,
                loss=1.0,
                grad_norm=1.0,
                lr=1e-2,
                local_tokens=64,
                seq_len=16.0,
                t_start=time.perf_counter(),
                t_data=0.0,
            )

        record(4)  # both skips since the last record; the NaN one also counted apart
        step(5, 1.0)
        record(5)
        assert not _same(before, _snapshot(tr)), "a good step must still update"
        with pytest.raises(TooManyBadSteps, match="stopped at step 6: 3 bad steps") as info:
            step(6, float("inf"))
        assert [s for s, _ in info.value.bad] == [3, 4, 6]
        assert tr.skipped_steps == 3
        assert tr.summary(ctx)["skipped_steps"] == 3
        assert tr.headline()["skipped_steps"] == 3
        tr.metrics.close()
        train = read_metrics(tmp_path / "out" / "metrics.jsonl", "train")
        assert [(r.get("skipped_updates"), r.get("nonfinite_updates")) for r in train] == [
            (2, 1),
            (None, None),
        ]
        records = read_metrics(tmp_path / "out" / "metrics.jsonl", "guard")
        assert [r["step"] for r in records] == [3, 4, 6]
        assert records[0]["reason"] == "non-finite loss (nan)" and records[0]["loss"] != 0
        assert records[1]["reason"].startswith("loss spike (")
        assert set(records[0]) >= {"step", "reason", "loss", "grad_norm", "lr"}
        heartbeat.flush()  # beats within a phase reach the file from the writer thread
        beat = read_heartbeats(tmp_path / "out")[0]
        assert (beat["step"], beat["phase"], beat["pid"]) == (6, "train", os.getpid())
    finally:
        heartbeat.stop()
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
def test_sft_blowup_is_skipped_then_stopped_and_the_checkpoint_kept(
    tmp_path: Path, shared_parents: Path
) -> None:
    from posttrain.telemetry.health import read_health
    from posttrain.telemetry.records import read_metrics
    from posttrain.train.checkpoint import complete_checkpoints

    recipe = _blowup_recipe(tmp_path)
    run_shared("ingest", recipe, shared_parents)  # the 30-step base, built once per session
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
    # every one of them skipped for a NaN loss: also counted as non-finite
    assert all(r.get("nonfinite_updates") == 1 for r in train[1:])
    assert "nonfinite_updates" not in train[0]
    # the stage's ranks sampled their health beside their beats (logs/health/, issue 30)
    assert read_health(out)[0]["sources"]["io"] == "present"

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


# --- the hang watchdog through the real supervisor ---------------------------------------------


@pytest.fixture
def beat_modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "mods"
    write_heartbeat_modules(folder)
    return on_child_path(folder, monkeypatch)


def _planned(tmp_path: Path, module: str, nprocs: int, hang_s: float, startup_s: float):
    return hand_planned(
        tmp_path,
        module,
        {"pg_timeout_s": 120, "precision": "fp32"},
        nprocs=nprocs,
        hang_timeout_s=hang_s,
        hang_startup_s=startup_s,
    )


def _dead(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.slow
def test_hung_rank_is_dumped_killed_and_named(
    tmp_path: Path, beat_modules: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from flows.stage.failures import StageFailed
    from flows.stage.hang import StageHung
    from flows.stage.task import stage_task

    monkeypatch.setenv("PT_PIDS_FILE", str(tmp_path / "pids"))
    hang_s = 4.0
    stage, spec = _planned(tmp_path, "pt_stuck_sft", nprocs=2, hang_s=hang_s, startup_s=60)
    with pytest.raises(StageHung) as info:
        stage_task.fn(stage, spec, kill_grace_s=1.0)
    raised = time.time()
    assert isinstance(info.value, StageFailed)
    hang = info.value.hang
    behind = hang.behind
    assert (behind.rank, behind.step, behind.phase) == (1, 2, "train")
    assert hang_s < behind.silent_s < hang_s + 2  # polled every 0.5 s
    msg = str(info.value)
    assert "rank 1 is behind: last beat at step 2 (phase train)" in msg
    assert "rank 0 at step 3 (phase train)" in msg
    # Detected within the limit plus polling, the stack dump and the kill.
    beats = read_heartbeats(stage.out_dir)
    assert raised - beats[1]["time"] < hang_s + 8

    stacks = {r: stage.out_dir / "logs" / f"stacks-rank{r}.txt" for r in (0, 1)}
    assert sorted(info.value.stack_files) == sorted(stacks.values())
    assert "wait_for_nothing_forever" in stacks[1].read_text()
    assert "all_reduce" in stacks[0].read_text()  # rank 0 waits in the next collective
    assert "wait_for_nothing_forever" in msg  # the excerpt of the rank behind

    pids = {int(p) for f in tmp_path.glob("pids?") for p in f.read_text().split()}
    assert len(pids) == 3  # torchrun's agent (both ranks' parent) and the two ranks
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not all(_dead(p) for p in pids):
        time.sleep(0.1)
    assert [p for p in pids if not _dead(p)] == []


@pytest.mark.slow
def test_slow_but_beating_stage_is_not_killed(
    tmp_path: Path, beat_modules: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from flows.stage.task import stage_task

    # A silent startup longer than the hang timeout (covered by the startup allowance), then
    # five beats 1 s apart, against a 2 s hang timeout.
    monkeypatch.setenv("PT_STARTUP_S", "3")
    monkeypatch.setenv("PT_BEAT_S", "1")
    monkeypatch.setenv("PT_STEPS", "5")
    stage, spec = _planned(tmp_path, "pt_slowbeats_sft", nprocs=1, hang_s=2.0, startup_s=30)
    out = stage_task.fn(stage, spec, kill_grace_s=1.0)
    assert out.status == "ran"
    beats = read_heartbeats(stage.out_dir)
    assert beats[0]["step"] == 5 and beats[0]["phase"] == "finish"
    assert (stage.out_dir / "logs" / "stacks-rank0.txt").read_text() == ""
