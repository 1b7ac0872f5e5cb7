"""The block `posttrain run` ends with when a run fails: what stage, what is wrong (file:line or
field path), the fix, and where the full log is. Nothing else of the failure reaches the
terminal: the stage's own output, tracebacks included, is in `logs/stage.log` (and in the
Prefect UI), and Prefect's own repeats of the failure are kept off the console
(`flows.terminal.quiet_console`).

    posttrain: stage sft failed
      what: /data/chat.jsonl:3: invalid JSON: Expecting ',' delimiter (column 107, the end of the line)
      fix:  correct or remove that row (or point the recipe at another file), then run again...
      run folder: /ws/runs/20261201T233654Z-c5b00207
      full log: /ws/artifacts/sft/18ad184aa1f3a563/logs/stage.log

An error posttrain does not know (a bug) says "unexpected error", shows the last frame of its
traceback, and points at the log that holds all of it.
"""

from __future__ import annotations

import contextlib
import re
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from posttrain.errors import ERROR_MARKER

RERUN = "then run again: finished stages are reused"
BUG = "this looks like a bug in posttrain: the full traceback is in the log"

# The errors a stage reports as verdicts (their `POSTTRAIN_ERROR` line names the type), with the
# fix a person applies. Every name is a class of posttrain, and every class of posttrain's that
# a stage can end with is here (tests/test_terminal.py walks them): anything else is a bug.
FIXES: dict[str, str] = {
    "DataError": f"correct or remove that row (or point the recipe at another file), {RERUN}",
    # These two name the field their message starts with (FIELD_FIXES) when it does.
    "DataFileMissing": f"correct the recipe's path to it (or create the file), {RERUN}",
    "RecipeVerdict": "change the field the message starts with as it says (`posttrain validate` "
    f"checks the rest of the recipe without running it), {RERUN}",
    "PreferenceDataError": f"correct or remove that pair (or point the recipe elsewhere), {RERUN}",
    "RowsTooLong": "raise max_seq_len to the value named above (a system prompt and tool "
    f"schemas count against it), or shorten the rows, {RERUN}",
    "TemplateError": f"give the model a chat template that renders these rows, {RERUN}",
    "TemplateNotIncremental": "set the stage's chat_template (with allow_template_change: true) "
    "or ingest.chat_template to a template that renders each turn the same whatever follows it "
    "(not one that drops earlier turns' reasoning) and ends an assistant turn with the token "
    f"generation stops at, {RERUN}",
    "ToolsUnsupported": "use a base whose chat template renders tool calls (Qwen2.5/3, Llama "
    "3.1, Mistral v0.3), or set ingest.chat_template to one that does, or drop rollout.tools "
    f"and rollout.environment, {RERUN}",
    "IngestError": f"correct the ingest section (model id, revision, local folder), {RERUN}",
    "HubError": f"check the hub id, revision and network (or use a local folder), {RERUN}",
    "MemoryPreflightError": (
        "apply one of the changes listed above, or set infra.memory_preflight=warn to try anyway"
    ),
    "DiskFull": f"free disk space in the workspace (old artifacts, checkpoints), {RERUN}",
    "NoIntactCheckpoint": "delete the damaged checkpoints folder, or set "
    "infra.no_intact_checkpoint=restart to train from the start",
    "ParentArtifactDamaged": f"delete the damaged artifact folder named above, {RERUN}",
    "ArtifactDamaged": "delete the artifact folder named above (its stage runs again; an "
    f"artifact written by another posttrain version reads so too), {RERUN}",
    "RewardFunctionError": f"fix the reward function named above (or its kwargs), {RERUN}",
    "RewardLoadError": f"fix the reward module or its name in the recipe, {RERUN}",
    "ToolLoadError": f"fix the tool or environment named above (or its name in the recipe), "
    f"{RERUN}",
    "EnvironmentFailed": f"fix the environment method named above (the row it served is named), "
    f"{RERUN}",
    "TooManyBadSteps": "lower the learning rate or check the data (non-finite losses); "
    "infra.guard.* sets how many bad steps are tolerated",
    "ExportVerificationError": "the merged export does not match base+adapter: the stage's "
    "log has the numbers; report it with the log",
    "GGUFUnsupported": "remove export.gguf (the safetensors export needs none), or export a "
    f"Llama or Qwen2 family model with a byte-level BPE tokenizer, {RERUN}",
    "GGUFVerificationError": "the GGUF file does not read back as planned (a bug in its "
    "writer): remove that type from export.gguf to export without it, and report it with the log",
    "ServerFailed": "read the rollout server's own log (logs/rollout-server.log in the stage's "
    "folder), then correct rollout.server (command, api, weights, host, url) or the server, or "
    f"raise rollout.server.request_timeout_s or startup_timeout_s for a slow one, {RERUN}",
    "StaleRollout": "posttrain's guard on off-policy rollouts fired (a bug): set "
    "rollout.max_staleness: 0 to train on-policy meanwhile, and report it with the log",
    "StaleSampler": "the rollout sampler scores tokens otherwise than the trainer's weights: "
    "the fast engine's copy did not follow them (a bug, or an adapter it cannot fold, such as "
    "DoRA: set rollout.engine: hf meanwhile and report it with the log), or the rollout "
    "server holds another adapter than the policy's version (check its log for the adapter it "
    "loaded, and restart it); a tolerance too tight for the hardware's bf16 is raised with "
    f"rollout.sampler_probe_tolerance, {RERUN}",
}
LOG_RE = re.compile(r"Log: (\S+stage\.log)")
FRAME_RE = re.compile(r'^\s*File "[^"]+", line \d+, in .+$')


@dataclass
class Block:
    """One failure, as the terminal shows it."""

    head: str  # `posttrain: stage sft failed`
    what: str
    fix: str
    log: str | None = None
    frame: str | None = None  # unexpected errors: the last frame of the traceback
    notes: tuple[str, ...] = ()  # e.g. `run folder: ...`

    def text(self) -> str:
        lines = [self.head, f"  what: {self.what}"]
        if self.frame:
            lines.append(f"  at:   {self.frame.strip()}")
        lines.append(f"  fix:  {self.fix}")
        lines.extend(f"  {note}" for note in self.notes)
        if self.log:
            lines.append(f"  full log: {self.log}")
        return "\n".join(lines)


def _stage_of(text: str) -> str:
    match = re.search(r"stage '([^']+)'", text)
    return match.group(1) if match else "?"


def _last_frame(lines: list[str]) -> str | None:
    frames = [x for x in lines if FRAME_RE.match(x)]
    return frames[-1] if frames else None


RESUMES = "run again: it resumes from the newest complete checkpoint"
# What the engine said ended the job (flows.stage.launchers: "was ended by Slurm: job 57 TIMEOUT,
# ..."), in the order tried, and what to do about it.
ENGINE_FIXES = (
    (
        "infra.queue_timeout_s",
        "the cluster did not start it in time: check its partition and "
        "resources (`squeue`, `sinfo`, `kubectl describe pod`), or raise infra.queue_timeout_s",
    ),
    ("TIMEOUT", f"raise infra.slurm.time (null = the stage's timeout + 5 min), then {RESUMES}"),
    ("OUT_OF_MEMORY", "give the job more memory (infra.slurm.mem), or make the stage smaller"),
    ("OOMKilled", "give the pods more memory (infra.kubernetes.memory), or make the stage smaller"),
    ("PREEMPTED", f"{RESUMES}; or use a partition or QoS that is not preempted"),
    ("cancelled outside the flow", f"someone cancelled the job outside the flow; {RESUMES}"),
    ("was ended by ", f"{RESUMES}, once the cluster has healthy nodes for it"),
)


def engine_fix(headline: str) -> str | None:
    """The fix for a stage a cluster engine ended or never started, from its headline."""
    if "was ended by " not in headline and "infra.queue_timeout_s" not in headline:
        return None
    return next(fix for key, fix in ENGINE_FIXES if key in headline)


def data_fix(kind: str, section: str) -> str | None:
    """The fix for a bad row of the stage whose recipe section is `section` (`dpo`,
    `stages.dpo2`): a row a check refused (PreferenceDataError: pairs, unpaired feedback,
    prompts) may be skipped instead, since those sections have `on_invalid`."""
    if kind != "PreferenceDataError":
        return None
    return (
        f"correct or remove that row, or set {section}.data.on_invalid: skip to leave bad "
        f"rows out (counted by reason in the stage's log), {RERUN}"
    )


# Verdicts whose message starts with the recipe field to change, and their fix naming it:
# `sft.data.path: /x does not exist` (the field, not a row), `ppo.rollout.prompts_per_step: 6
# must be a multiple of the 4 ranks ...`.
FIELD_FIXES = {
    "DataFileMissing": (r"([\w.]+\.(?:path|eval_path)): ", "correct {} (or create the file)"),
    "RecipeVerdict": (r"([\w.]+): ", "change {} as said above"),
}


def field_fix(kind: str, what: str) -> str | None:
    """The fix of a verdict of FIELD_FIXES, naming the field its message starts with (None
    without one: FIXES then has its general fix)."""
    rule = FIELD_FIXES.get(kind)
    named = re.match(rule[0], what) if rule else None
    return f"{rule[1].format(named.group(1))}, {RERUN}" if rule and named else None


def stage_failure_block(
    message: str,
    timed_out: bool = False,
    hung: bool = False,
    sections: Mapping[str, str] | None = None,
) -> Block:
    """The block for a `StageFailed` (its message: headline, `Log: <path>`, the log's tail).
    `sections`: {stage name: its recipe section (`stages.dpo2`)}, for fixes that name a field
    (default: the stage's name, its shorthand section)."""
    head_line, _, tail = message.partition("\n--- end of the log ---\n")
    stage = _stage_of(head_line)
    found = LOG_RE.search(message)
    log = found.group(1) if found else None
    headline = LOG_RE.sub("", head_line).strip().rstrip(".").strip()
    head = f"posttrain: stage {stage} failed"
    lines = tail.splitlines()
    verdicts = [x for x in lines if x.startswith(ERROR_MARKER)]
    if fix := engine_fix(headline):
        return Block(head, headline, fix, log)
    if timed_out:
        return Block(
            head, headline, f"raise infra.timeouts.{stage}, or make the stage smaller", log
        )
    if hung:
        first = headline.splitlines()[0] if headline else "every rank stopped beating"
        return Block(head, first, "the stacks of every rank are in the log; report it", log)
    if verdicts:
        # `POSTTRAIN_ERROR stage sft failed: DataError: /data/x.jsonl:3: invalid JSON ...`
        _, _, rest = verdicts[-1].partition(" failed: ")
        kind, _, what = rest.partition(": ")
        if kind == "MemoryPreflightError":
            # Its message goes on with the estimate's table, then the changes that would fit
            # (`  - sft.batch.micro_batch_size: 1 ...: 478.7 MiB`), or that none would: the
            # block keeps those, the table stays in the log.
            after = lines[lines.index(verdicts[-1]) + 1 :]
            changes = [x.strip()[2:] for x in after if x.startswith("  - ")]
            need = next((x for x in after if x.startswith("nothing above fits")), None)
            fix = FIXES[kind]
            if need:
                need = need.replace("nothing above fits", "no setting of this stage fits", 1)
                fix = f"{need}; or set infra.memory_preflight=warn to try anyway"
            elif changes:
                steps = "\n".join(f"        {c}" for c in changes)
                fix = f"one of\n{steps}\n        or set infra.memory_preflight=warn to try anyway"
            return Block(head, what, fix, log)
        if fix := field_fix(kind, what) or data_fix(kind, (sections or {}).get(stage, stage)):
            return Block(head, what, fix, log)
        if kind in FIXES:
            return Block(head, what, FIXES[kind], log)
        return Block(head, f"unexpected error: {kind}: {what}", BUG, log, _last_frame(lines))
    # No verdict line: the process was killed (a signal, the OOM killer) or left no artifact.
    return Block(head, headline, "see the end of the log for what it did last", log)


def gate_block(message: str) -> Block:
    """The block for a `QualityGateFailed`: `<stage>: <what the gate measured>`."""
    stage, _, what = message.partition(": ")
    fix = "its artifact is kept; train it better (steps, data, lr) or change the bar named above"
    return Block(
        f"posttrain: stage {stage} failed its quality gate", what or message, f"{fix}, {RERUN}"
    )


def unexpected_block(exc: BaseException, log_dir: Path) -> Block:
    """A failure outside any stage (in the flow or the CLI): its traceback goes to a file in
    `log_dir`, the block names that file and the last frame."""
    text = "".join(traceback.format_exception(exc))
    log = None
    with contextlib.suppress(OSError):
        log_dir.mkdir(parents=True, exist_ok=True)
        (path := log_dir / "posttrain-run-error.log").write_text(text)
        log = str(path)
    what = f"unexpected error: {type(exc).__name__}: {exc}".split("\n", 1)[0]
    return Block("posttrain: the run failed", what, BUG, log, _last_frame(text.splitlines()))


def known_block(exc: BaseException, sections: Mapping[str, str] | None = None) -> Block | None:
    """The block of a failure posttrain raises and explains (a stage failed, timed out or hung, a
    gate not met, a recipe or selection refused in the flow); None for anything else."""
    from flows.devices import DevicesBusy
    from flows.stage.failures import QualityGateFailed, StageFailed, StageTimeout
    from flows.stage.hang import StageHung
    from posttrain.config.loader import RecipeError
    from posttrain.plan.selection import SelectionError

    if isinstance(exc, StageFailed):
        timed_out, hung = isinstance(exc, StageTimeout), isinstance(exc, StageHung)
        return stage_failure_block(str(exc), timed_out=timed_out, hung=hung, sections=sections)
    if isinstance(exc, QualityGateFailed):
        return gate_block(str(exc))
    if isinstance(exc, DevicesBusy):
        return Block(
            "posttrain: the devices stayed busy (no stage ran)",
            str(exc),
            "run again once that run has ended, or wait longer: --wait-devices SECONDS "
            "(infra.wait_devices_s; unset waits as long as it takes)",
        )
    if isinstance(exc, SelectionError):  # a served run's --until/--only, refused in the flow
        return Block(
            "posttrain: stage selection refused (no stage ran)",
            str(exc),
            "name stages the recipe has (`posttrain plan` lists them); the stages an --only "
            "stage needs must be complete (--until runs them)",
        )
    if isinstance(exc, RecipeError):  # refused in the flow (e.g. a path outside its reach)
        return Block(
            "posttrain: recipe refused (no stage ran)", "; ".join(exc.errors) or str(exc), exc.fix
        )
    return None


def reason_line(block: Block) -> str:
    """`block` as one line, for where only a line fits (a served run's final state, which
    `posttrain submit --wait` prints): `recipe refused (no stage ran): run.workspace: ...`."""
    what = " ".join(block.what.split())
    return f"{block.head.removeprefix('posttrain: ')}: {what}"
