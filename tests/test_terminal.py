"""The terminal of `posttrain run`, in process: the closing block of a failure (what, fix, log),
the console filter that keeps stage output and Prefect's repeats of a failure off the terminal,
and the progress printer (rate-limited plain lines; one line redrawn in place on a TTY).
The real CLI in a subprocess: tests/test_cli_terminal.py."""

from __future__ import annotations

import io
import json
import logging
import re
from pathlib import Path

import pytest

from flows import terminal
from flows.failure_block import BUG, FIXES, gate_block, stage_failure_block, unexpected_block
from flows.stage.output import (
    TAIL_LINES,
    MetricsTail,
    OutputPump,
    add_step_listener,
    remove_step_listener,
)
from flows.terminal import ProgressPrinter, QuietConsole

LOG = "/ws/artifacts/sft/18ad184aa1f3a563/logs/stage.log"


def _stage_failed(tail: str, headline: str = "stage 'sft' exited with code 1") -> str:
    # The message flows.stage.supervise raises a StageFailed with.
    return f"{headline}. Log: {LOG}\n--- end of the log ---\n{tail}"


DATA_TAIL = """\
2026-12-01 23:33:39,472 INFO [posttrain] stage sft fingerprint 18ad184aa1f3a563
Traceback (most recent call last):
  File "/repo/posttrain/stages/common.py", line 393, in stage_main
    summary = run(ctx)
  File "/repo/posttrain/data/loading.py", line 244, in parse_json_line
    raise DataError(f"{where}: invalid JSON: {exc.msg} (column {exc.colno})") from None
posttrain.data.loading.DataError: /data/chat.jsonl:3: invalid JSON: Expecting ',' delimiter

POSTTRAIN_ERROR stage sft failed: DataError: /data/chat.jsonl:3: invalid JSON: Expecting ','"""

MEMORY_TAIL = """\
POSTTRAIN_ERROR stage sft failed: MemoryPreflightError: stage sft: estimated peak 484.7 MiB \
per device does NOT fit in 50% of 1.0 MiB (infra.device_memory_gb override)
component                          phase          size  note
estimated peak                               484.7 MiB
fixes (estimated peak each; budget 524.3 KiB):
  - sft.activation_checkpointing: true: 482.7 MiB
  - sft.batch.micro_batch_size: 1 with grad_accum_steps: 8 (same global batch): 478.7 MiB
nothing above fits: this stage needs a device with at least 956.9 MiB
Refused before loading the model. Apply a fix above, or set infra.memory_preflight: warn"""

BUG_TAIL = """\
Traceback (most recent call last):
  File "/repo/posttrain/stages/common.py", line 393, in stage_main
    summary = run(ctx)
  File "/repo/posttrain/stages/sft.py", line 99, in run
    x = rows[0]["nope"]
KeyError: 'nope'

POSTTRAIN_ERROR stage sft failed: KeyError: 'nope'"""


def test_data_error_block_names_stage_file_line_fix_and_log() -> None:
    text = stage_failure_block(_stage_failed(DATA_TAIL)).text()
    lines = text.splitlines()
    assert lines[0] == "posttrain: stage sft failed"
    assert "what: /data/chat.jsonl:3: invalid JSON" in lines[1]
    assert lines[2].startswith("  fix:  correct or remove that row")
    assert lines[3] == f"  full log: {LOG}"
    assert len(lines) == 4 and "Traceback" not in text


def test_a_bad_pair_s_fix_names_on_invalid_skip_of_its_section() -> None:
    what = "/data/pairs.jsonl:7: chosen and rejected are identical: no preference to learn"
    tail = f"POSTTRAIN_ERROR stage dpo2 failed: PreferenceDataError: {what}"
    headline = "stage 'dpo2' exited with code 1"
    block = stage_failure_block(_stage_failed(tail, headline), sections={"dpo2": "stages.dpo2"})
    assert block.what == what
    assert block.fix == (
        "correct or remove that row, or set stages.dpo2.data.on_invalid: skip to leave bad rows "
        "out (counted by reason in the stage's log), then run again: finished stages are reused"
    )
    # SFT has no on_invalid: its bad row's fix is the row's alone.
    assert "on_invalid" not in stage_failure_block(_stage_failed(DATA_TAIL)).fix


def test_memory_refusal_block_lists_the_changes_that_fit() -> None:
    fits = MEMORY_TAIL.replace(
        "nothing above fits: this stage needs a device with at least 956.9 MiB\n", ""
    )
    text = stage_failure_block(_stage_failed(fits)).text()
    assert text.startswith("posttrain: stage sft failed\n  what: stage sft: estimated peak")
    assert "  fix:  one of\n        sft.activation_checkpointing: true" in text
    assert "sft.batch.micro_batch_size: 1 with grad_accum_steps: 8" in text
    assert "infra.memory_preflight=warn" in text and f"full log: {LOG}" in text
    assert "component" not in text  # the estimate's table stays in the log
    assert len(text.splitlines()) <= 8


def test_a_verdict_pushed_out_of_the_tail_by_torchrun_still_makes_the_block() -> None:
    """A multi-rank stage's refusal is followed by torchrun's closing report (longer than the
    tail the supervisor keeps): the block still lists the changes, not 'see the log'."""
    fits = MEMORY_TAIL.replace(
        "nothing above fits: this stage needs a device with at least 956.9 MiB\n", ""
    )
    report = [f"  rank      : {i % 2} torchrun report line {i}" for i in range(TAIL_LINES + 10)]
    lines = ["2026-12-07 INFO [posttrain] parents ingest verified", *fits.splitlines(), *report]
    pump = OutputPump(iter(f"{x}\n" for x in lines), io.StringIO(), logging.getLogger("t"), "sft")
    pump.join(10)
    tail = pump.tail_text()
    assert tail.splitlines()[-1] == report[-1]
    text = stage_failure_block(_stage_failed(tail)).text()
    assert "  fix:  one of\n        sft.activation_checkpointing: true" in text
    # Without a verdict, the tail is the last lines alone.
    plain = OutputPump(iter(f"{x}\n" for x in report), io.StringIO(), logging.getLogger("t"), "x")
    plain.join(10)
    assert plain.tail_text().splitlines() == report[-TAIL_LINES:]


def test_memory_refusal_block_says_when_no_change_fits() -> None:
    text = stage_failure_block(_stage_failed(MEMORY_TAIL)).text()
    assert (
        "fix:  no setting of this stage fits: this stage needs a device with at least 956.9 MiB"
        in text
    )
    assert "activation_checkpointing" not in text and len(text.splitlines()) == 4


def test_unknown_error_says_unexpected_and_shows_the_last_frame() -> None:
    text = stage_failure_block(_stage_failed(BUG_TAIL)).text()
    assert "what: unexpected error: KeyError: 'nope'" in text
    assert 'at:   File "/repo/posttrain/stages/sft.py", line 99, in run' in text
    assert "Traceback" not in text and f"full log: {LOG}" in text


def test_killed_stage_and_timeout_blocks() -> None:
    killed = stage_failure_block(
        _stage_failed("step 3", "stage 'sft' was killed by SIGKILL; its last heartbeat: step 3")
    ).text()
    assert "what: stage 'sft' was killed by SIGKILL; its last heartbeat: step 3" in killed
    timeout = stage_failure_block(
        f"stage 'dpo' timed out after 60 s (infra.timeouts.dpo) and was killed with its "
        f"process group. Log: {LOG}\n--- end of the log ---\nstep 9",
        timed_out=True,
    ).text()
    assert timeout.startswith("posttrain: stage dpo failed") and "infra.timeouts.dpo" in timeout


def test_blocks_of_stages_a_cluster_ended_or_never_started(tmp_path: Path) -> None:
    from flows.stage.failures import failure_headline
    from posttrain.runtime.spec import PlannedStage

    stage = PlannedStage("sft", "m", "fp", tmp_path, {}, 1, 60.0, nnodes=2)

    def block(reason: str, timed_out: bool = False) -> str:
        headline = failure_headline(stage, 1, [], reason)
        return stage_failure_block(_stage_failed("[node 0] step 3", headline), timed_out).text()

    node = block("Slurm: job 57 NODE_FAIL, it lost a node (NodeDown) on n[1-2]")
    assert "what: stage 'sft' was ended by Slurm: job 57 NODE_FAIL, it lost a node" in node
    assert "fix:  run again: it resumes from the newest complete checkpoint, once" in node
    limit = block("Slurm: job 57 TIMEOUT, it reached its time limit (00:06:00; infra.slurm.time)")
    assert "fix:  raise infra.slurm.time" in limit
    oom = block("Kubernetes: pod job-1 OOMKilled (exit 137)")
    assert "infra.kubernetes.memory" in oom
    queued = stage_failure_block(
        "stage 'sft' waited 600 s without starting (Slurm job 57 (2 nodes): Slurm: PENDING "
        "(Resources)) and was cancelled (infra.queue_timeout_s)",
        timed_out=True,
    ).text()
    assert "raise infra.queue_timeout_s" in queued and "infra.timeouts" not in queued


def test_gate_block() -> None:
    text = gate_block("reward: held-out reward accuracy 0.5 < reward.min_accuracy 1.0").text()
    assert text.splitlines()[0] == "posttrain: stage reward failed its quality gate"
    assert "reward.min_accuracy 1.0" in text and "fix:" in text


def test_unexpected_flow_error_keeps_its_traceback_in_a_file(tmp_path: Path) -> None:
    try:
        {}["missing"]
    except KeyError as exc:
        block = unexpected_block(exc, tmp_path / "logs")
    assert block.log is not None
    assert "Traceback (most recent call last)" in Path(block.log).read_text()
    assert "unexpected error: KeyError" in block.text() and "test_terminal.py" in block.text()


# posttrain's exception classes that no stage ends with, and why: the flow reports them itself
# (known_block, before any stage runs), or another verdict carries them to the stage's line,
# or they are a bug by definition.
NOT_A_STAGE_VERDICT = {
    "RecipeError": "the recipe is refused before any stage runs (known_block)",
    "GraphError": "a RecipeError problem: the stage graph is checked with the recipe",
    "SelectionError": "--until/--only refused before any stage runs (known_block)",
    "LockTimeout": "flow side: the supervisor turns it into a StageTimeout",
    "ServerError": "the server engine turns it into ServerFailed, with the server's last words",
    "UndecidedField": "a recipe field the fingerprint walk cannot place: a bug",
    "DataNotCached": "validate --full only: a hub dataset not cached is read by its stage",
    "JudgeFailed": "the rewarder turns it into RewardFunctionError, naming the judge and row",
    "MissingColumn": "the rewarder turns it into RewardFunctionError, naming the row's columns",
}


def _posttrain_exceptions() -> dict[str, type]:
    """Every exception class posttrain defines: its modules imported, the class tree walked."""
    import importlib
    import pkgutil

    import posttrain

    for module in pkgutil.walk_packages(posttrain.__path__, "posttrain."):
        importlib.import_module(module.name)
    found, todo = {}, [BaseException]
    while todo:
        for sub in todo.pop().__subclasses__():
            todo.append(sub)
            if sub.__module__.startswith("posttrain."):
                found[sub.__name__] = sub
    return found


def test_every_error_a_stage_ends_with_has_a_fix() -> None:
    """A verdict class without a FIXES entry would end the run with "this looks like a bug in
    posttrain": a new class must get its fix, or a reason here why no stage ends with it."""
    from posttrain.errors import StageVerdict

    classes = _posttrain_exceptions()
    assert set(FIXES) <= set(classes), set(FIXES) - set(classes)
    assert set(NOT_A_STAGE_VERDICT) <= set(classes), set(NOT_A_STAGE_VERDICT) - set(classes)
    verdicts = {n for n, c in classes.items() if c is not StageVerdict}
    missing = verdicts - set(FIXES) - set(NOT_A_STAGE_VERDICT)
    assert not missing, f"no fix for {sorted(missing)}: add one to flows/failure_block.FIXES"
    assert not set(FIXES) & set(NOT_A_STAGE_VERDICT)
    for name in FIXES:
        block = stage_failure_block(_stage_failed(f"POSTTRAIN_ERROR stage sft failed: {name}: x"))
        assert block.fix != BUG and not block.what.startswith("unexpected error"), name


def _record(name: str, msg: str, level: int = logging.INFO, **extra: object) -> logging.LogRecord:
    record = logging.LogRecord(name, level, __file__, 1, msg, (), None)
    record.__dict__.update(extra)
    return record


def test_console_drops_stage_output_and_failure_repeats_only() -> None:
    f = QuietConsole()
    assert not f.filter(_record("prefect.task_runs", "[sft] x", posttrain_stage_output="sft"))
    assert not f.filter(_record("prefect.task_runs", "Finished in state Failed('...')"))
    assert not f.filter(
        _record("prefect.flow_runs", "Encountered exception during execution: X", logging.ERROR)
    )
    assert f.filter(_record("prefect.task_runs", "Finished in state Completed()"))
    # The embedded server's URL (dead after the run) and Prefect's pointer to its docs, as
    # prefect.server.api.server.SubprocessASGIServer logs them.
    started = (
        "Starting temporary server on http://127.0.0.1:8685\nSee https://www.prefect.io/docs/v3/"
        "concepts/server#how-to-guides for more information on running a dedicated Prefect server."
    )
    assert not f.filter(_record("prefect", started))
    assert not f.filter(_record("prefect", "Stopping temporary server on http://127.0.0.1:8685"))
    assert f.filter(_record("prefect.task_runs", "stage sft: /usr/bin/python -m ..."))
    assert f.filter(
        _record(
            "prefect.task_runs", "artifact in /ws/x is not valid (a.bin is missing): removing", 30
        )
    )


def _train(step: int, total: int = 100) -> dict:
    return {"kind": "train", "step": step, "total_steps": total, "loss": 2.5, "tokens_per_s": 5100}


def test_plain_progress_is_rate_limited_and_has_an_eta(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    monkeypatch.setattr(terminal.time, "monotonic", lambda: now[0])
    out = io.StringIO()
    printer = ProgressPrinter(out, tty=False, every_s=10)
    for step in range(1, 101):  # one step per second for 100 s
        printer.on_step("sft", _train(step))
        now[0] += 1.0
    lines = out.getvalue().splitlines()
    # The first step, then one line per 10 s, then the last step: never one per step.
    assert 10 <= len(lines) <= 12, lines
    assert lines[0] == "sft  step 1/100 · loss 2.5 · 5,100 tok/s"
    assert re.fullmatch(r"sft  step 11/100 · loss 2\.5 · 5,100 tok/s · ETA 1m 29s", lines[1])
    assert lines[-1].startswith("sft  step 100/100") and lines[-1].endswith("ETA 0.0 s")
    assert "\r" not in out.getvalue()


def test_an_rl_progress_line_shows_the_mean_reward_beside_the_loss() -> None:
    # A GRPO step whose groups all tie has loss 0: the reward says the stage is alive.
    out = io.StringIO()
    printer = ProgressPrinter(out, tty=False, every_s=10)
    step = {"kind": "train", "step": 3, "total_steps": 40, "loss": 0.0, "tokens_per_s": 812.4}
    printer.on_step("grpo", step | {"score_mean": 0.6251, "reward_fn_exact_match": 0.5})
    assert out.getvalue() == "grpo  step 3/40 · reward 0.6251 · loss 0 · 812 tok/s\n"
    # A stage without rewards (sft) keeps its line as it was.
    assert terminal.progress_text("sft", _train(7), None) == (
        "sft  step 7/100 · loss 2.5 · 5,100 tok/s"
    )


def test_tty_progress_redraws_one_line_for_parallel_stages(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [1000.0]
    monkeypatch.setattr(terminal.time, "monotonic", lambda: now[0])
    out = io.StringIO()
    printer = ProgressPrinter(out, tty=True, every_s=10)
    printer.on_step("dpo", _train(1))
    printer.on_step("kto", _train(1))
    now[0] += 98.0
    printer.on_step("dpo", _train(50))
    screen = out.getvalue().split("\r\x1b[K")[-1]
    assert screen == (
        "dpo  step 50/100 · loss 2.5 · 5,100 tok/s · ETA 1m 40s | "
        "kto  step 1/100 · loss 2.5 · 5,100 tok/s"
    )
    assert "\n" not in out.getvalue()  # nothing scrolls while they train
    printer.on_step("dpo", _train(100))  # done: its last figures stay, kto goes on below
    done, redrawn = out.getvalue().split("\r\x1b[K")[-1].split("\n")
    assert done.startswith("dpo  step 100/100")
    assert redrawn == "kto  step 1/100 · loss 2.5 · 5,100 tok/s"
    printer.clear()
    assert out.getvalue().endswith("\r\x1b[K")


def test_metrics_tail_tells_the_listeners_the_stage_and_its_newest_step(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text(
        "\n".join(json.dumps(r) for r in (_train(1), {"kind": "eval", "loss": 1}, _train(2))) + "\n"
    )
    seen: list[tuple[str, int]] = []

    def listener(stage: str, record: dict) -> None:
        seen.append((stage, record["step"]))

    add_step_listener(listener)
    try:
        tail = MetricsTail(path, lambda p, d: None, interval_s=3600, stage="sft")
        tail.stop()
        anonymous = MetricsTail(path, lambda p, d: None, interval_s=3600)  # no stage: untold
        anonymous.stop()
    finally:
        remove_step_listener(listener)
    assert seen == [("sft", 2)]


def test_cli_picks_the_block_by_failure(tmp_path: Path) -> None:
    from flows.cli import failure_block
    from flows.stage.failures import QualityGateFailed, StageFailed, StageTimeout
    from posttrain.config.loader import RecipeError, validate_recipe

    recipe = validate_recipe(
        {
            "run": {"workspace": str(tmp_path / "ws")},
            "infra": {"device": "cpu", "precision": "fp32"},
            "ingest": {"source": "from_config"},
            "sft": {"data": {"synthetic": {}}},
        }
    )
    data = StageFailed(_stage_failed(DATA_TAIL))
    data.add_note("run folder: /ws/runs/1")
    text = failure_block(data, recipe).text()
    assert "run folder: /ws/runs/1" in text and text.endswith(f"full log: {LOG}")
    timeout = StageTimeout(f"stage 'sft' timed out after 5 s. Log: {LOG}\n--- end of the log ---\n")
    assert "infra.timeouts.sft" in failure_block(timeout, recipe).text()
    gate = failure_block(QualityGateFailed("grpo: held-out KL 10.9 > grpo.max_kl 8.0"), recipe)
    assert gate.head == "posttrain: stage grpo failed its quality gate"
    refused = failure_block(RecipeError(["sft.data.path: /etc/x is outside"]), recipe)
    assert refused.what == "sft.data.path: /etc/x is outside"
    bug = failure_block(ZeroDivisionError("division by zero"), recipe)
    assert bug.what == "unexpected error: ZeroDivisionError: division by zero"
    assert bug.log == str(tmp_path / "ws" / "logs" / "posttrain-run-error.log")
