"""`posttrain` command line: validate, plan and run a recipe.

    posttrain validate recipes/quickstart.yaml sft.optim.lr=3e-4   # verdict + every input checked
    posttrain plan     recipes/quickstart.yaml --until dpo
    posttrain run      recipes/quickstart.yaml run.name=try2
    posttrain runs     recipes/quickstart.yaml                 # the workspace's runs, newest first
    posttrain clean    recipes/quickstart.yaml [--yes]         # dry run unless --yes
    posttrain launch   sft recipes/quickstart.yaml   # one stage, no flow (multi-node: on each node)
    posttrain serve    recipes/quickstart.yaml       # deployments on PREFECT_API_URL's server
    posttrain submit   recipes/quickstart.yaml sft.max_steps=50   # prints the run's URL

Parsing lives in `main`; each command is a plain function returning an exit code, so tests call
them directly. Prefect is imported only by `run` and `launch`, after its environment defaults are
set: `validate` and `plan` never import it, and only `run` starts a server.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from flows.cli_checks import cmd_plan, cmd_validate, selected_stages
from flows.cli_common import (
    EXIT_FAILED,
    EXIT_HUNG_UP,
    EXIT_INTERRUPTED,
    EXIT_INVALID,
    EXIT_OK,
    EXIT_TERMINATED,
    load_or_report,
)
from flows.cli_served import cmd_publish_base, cmd_serve, cmd_submit
from flows.cli_workspace import _workspace_args, cmd_clean, cmd_models, cmd_runs
from flows.failure_block import Block, known_block, unexpected_block
from flows.prefect_env import apply_prefect_defaults, prefect_target
from flows.report.tables import (
    RunResult,
    health_lines,
    not_selected_text,
    recovery_lines,
    summary_table,
)
from posttrain.config.schema import Recipe
from posttrain.config.served_access import ALLOWED_ENV, COMMANDS_ENV, REWARDS_ENV
from posttrain.kinds import graph_kinds
from posttrain.plan.planner import RunPlan, plan, spec_for
from posttrain.plan.selection import ALL_STAGES, Selection
from posttrain.runtime.exit import exit_without_collecting
from posttrain.store.status import status


class Terminated(BaseException):
    """SIGTERM reached the CLI (e.g. `kill`, a container stop)."""


class HungUp(Terminated):
    """SIGHUP reached the CLI: its terminal closed, an SSH session dropped."""


def _raise_terminated(signum: int, frame: object) -> None:
    # Without this, SIGTERM ends the process at once: Prefect's own handler stops the stage
    # (our task's cleanup runs), then re-delivers SIGTERM to the default action, which skips
    # interpreter exit, so the embedded Prefect server process is left running. Raising
    # instead lets the run end normally and the server be stopped. SIGHUP's default action is
    # the same abrupt end (and Prefect does not handle it at all): it gets the same treatment.
    raise HungUp() if signum == signal.SIGHUP else Terminated()


def failure_block(exc: BaseException, recipe: Recipe) -> Block:
    """The closing block of a failed run: a stage's failure, a quality gate, or a bug."""
    sections = {s.name: s.where for s in recipe.graph()}
    block = known_block(exc, sections) or unexpected_block(exc, Path(recipe.run.workspace) / "logs")
    block.notes = tuple(getattr(exc, "__notes__", ()))
    return block


def cmd_run(
    path: str, overrides: list[str], out: TextIO, err: TextIO, selection: Selection = ALL_STAGES
) -> int:
    # Validate, resolve and plan (once: the flow is handed the plan) before Prefect starts.
    recipe = load_or_report(path, overrides, err)
    if recipe is None:
        return EXIT_INVALID
    run_plan = plan(recipe)
    if isinstance(selected_stages(run_plan, path, selection, err), int):
        return EXIT_INVALID  # the same check as the flow's
    apply_prefect_defaults()
    print(f"posttrain: running '{recipe.run.name}' on {prefect_target()}", file=err)
    with _signals_raised():
        result = _run_flow(run_plan, err, selection)
    if isinstance(result, int):
        return result
    print_result(result, out)
    return EXIT_OK


def _run_flow(run_plan: RunPlan, err: TextIO, selection: Selection) -> RunResult | int:
    """Run the flow handed `run_plan`: its result, or the exit code after one closing block (a
    failure) or one line (a signal)."""
    early, printer = None, None
    try:
        from flows.embedded_db import set_aside_if_damaged
        from flows.embedded_server import embedded_run_settings as run_settings
        from flows.embedded_server import launch_embedded_server, start_embedded_server

        set_aside_if_damaged(err)  # before the embedded server tries, and fails, to start on it
        # Before Prefect would start it, from this (main) thread: it then dies with this
        # process even when nothing here gets to stop it (SIGKILL). Launched before the flow's
        # imports, so that its boot and those imports overlap (docs/workspace.md).
        early = launch_embedded_server()
        from flows.post_train import handing, post_train  # imports prefect: only now
        from flows.terminal import (
            ProgressPrinter,
            attach_progress,
            quiet_console,
            quiet_known_failures,
        )

        quiet_known_failures()  # a failed stage or gate: one line, not a traceback wall
        # The terminal gets progress and, on failure, one closing block; stage output and
        # tracebacks stay in logs/stage.log and the UI (flows.terminal).
        quiet_console()
        printer = ProgressPrinter(err)
        attach_progress(printer)
        server = start_embedded_server(early)  # adopts it: waits until it is healthy
        early = None
        settings = run_settings() if server is not None else contextlib.nullcontext()
        with settings, handing(run_plan):
            return post_train(run_plan.recipe, list(selection.until), list(selection.only))
    except (KeyboardInterrupt, Terminated) as exc:
        return _say_stopped(exc, err)
    except Exception as exc:
        # The terminal ends with one block: stage, what, fix, log path (flows.failure_block).
        if printer is not None:
            printer.clear()
        print("\n" + failure_block(exc, run_plan.recipe).text(), file=err)
        return EXIT_FAILED
    finally:
        if printer is not None:
            from flows.terminal import detach_progress

            detach_progress(printer)
        if early is not None:  # the run ended before the server was adopted
            early.discard()


@contextlib.contextmanager
def _signals_raised() -> Iterator[None]:
    """Within: SIGTERM and SIGHUP raise `Terminated` and `HungUp` (`_raise_terminated`)."""
    previous = {
        sig: signal.signal(sig, _raise_terminated) for sig in (signal.SIGTERM, signal.SIGHUP)
    }
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _say_stopped(exc: BaseException, err: TextIO) -> int:
    """One line on what stopped the CLI (Ctrl-C, SIGTERM, SIGHUP); its exit code."""
    what, code = "interrupted", EXIT_INTERRUPTED
    if isinstance(exc, HungUp):
        what, code = "hung up", EXIT_HUNG_UP
    elif isinstance(exc, Terminated):
        what, code = "terminated", EXIT_TERMINATED
    with contextlib.suppress(OSError):  # a hang-up may have closed our terminal
        print(f"\nposttrain: {what}; the running stage was stopped", file=err)
    return code


def print_result(result: RunResult, out: TextIO) -> None:
    """The finished run's summary: the stage table, what was recovered, where things are."""
    records = result.stages
    print(summary_table(records), file=out)
    if health := health_lines(records):
        print("\nhealth:", *(f"  {line}" for line in health), sep="\n", file=out)
    if result.not_selected:
        print(not_selected_text(result.not_selected), file=out)
    if recovered := recovery_lines(records):
        print("\nrecovered:", *(f"  {line}" for line in recovered), sep="\n", file=out)
    if result.export_path:
        print(f"\nexported model: {result.export_path}", file=out)
    print(f"run folder:     {result.run_dir}", file=out)
    if (p := result.promotion) is not None:
        verdict = "promoted" if p.promoted else "NOT promoted"
        print(f"promotion:      {verdict}: {p.reason}", file=out)


def cmd_launch(stage_name: str, path: str, overrides: list[str], out: TextIO, err: TextIO) -> int:
    """Run one stage on this machine, in the foreground, without Prefect, through the supervisor
    `posttrain run` uses; its parents must be complete. For a multi-node stage every node runs
    this with its own POSTTRAIN_NODE_RANK."""
    recipe = load_or_report(path, overrides, err)
    if recipe is None:
        return EXIT_INVALID
    stages = {s.name: s for s in plan(recipe).stages}
    if stage_name not in stages:
        print(f"error: no stage {stage_name!r} in this recipe; it has {list(stages)}", file=err)
        return EXIT_INVALID
    stage, refs = stages[stage_name], {}
    for parent, fp in stage.parents.items():
        # Sizes only: the stage verifies every byte of its parents before it reads them.
        look = status(stages[parent].out_dir, fp, hashes=False)
        if look.ref is None:
            why = f"parent stage {parent!r} is not complete ({look.why})"
            print(f"error: {why}; run it first: posttrain run {path} --until {parent}", file=err)
            return EXIT_FAILED
        refs[parent] = look.ref
    apply_prefect_defaults()  # the supervisor's modules import Prefect; no server is started
    from flows.stage.supervise import supervise_stage

    with _foreground(out):
        try:
            outcome = supervise_stage(stage, spec_for(stage, recipe, refs))
        except (KeyboardInterrupt, Terminated) as exc:
            return _say_stopped(exc, err)
        except Exception as exc:
            print("\n" + failure_block(exc, recipe).text(), file=err)
            return EXIT_FAILED
    print(f"stage {stage_name}: {outcome.status}: {outcome.ref.uri}", file=out)
    return EXIT_OK


@contextlib.contextmanager
def _foreground(out: TextIO) -> Iterator[None]:
    """The supervisor's log (the stage's output in it) on `out` only; SIGTERM and SIGHUP raised,
    so the supervisor stops the stage."""
    logger, handler = logging.getLogger("posttrain.flows"), logging.StreamHandler(out)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        with _signals_raised():
            yield
    finally:
        logger.removeHandler(handler)
        logger.propagate = True


# The commands that take --until/--only (and overrides after them).
SELECTING = ("plan", "run", "submit")


def add_selection_flags(p: argparse.ArgumentParser, trains: bool = True) -> None:
    """--until/--only; for a command that trains (run, submit), --wait-devices too."""
    if trains:
        what = "fail after waiting this long for devices another run holds (infra.wait_devices_s)"
        p.add_argument("--wait-devices", type=float, metavar="SECONDS", help=what)
    for flag, what in (
        ("--until", "run (or reuse) STAGE and what it needs upstream, nothing after it"),
        ("--only", "run STAGE alone; what it needs upstream must be complete (reused)"),
    ):
        what += " (repeatable, or comma-separated: dpo,evaluate)"
        p.add_argument(flag, action="append", default=[], metavar="STAGE", help=what)


def build_parser() -> argparse.ArgumentParser:
    # The kinds come from the registry, so a new kind is named here without an edit.
    kinds = ", ".join(graph_kinds())
    ap = argparse.ArgumentParser(
        prog="posttrain",
        description=f"Post-training pipeline from one recipe: ingest -> a graph of training "
        f"stages ({kinds}), each reading the stages it names -> evaluate -> promotion gate -> "
        "export. Finished stages are reused.",
    )
    sub = ap.add_subparsers(dest="command", required=True)
    _add_recipe_commands(sub)
    _add_workspace_commands(sub)
    _add_served_commands(sub)
    help_text = (
        "run one stage in the foreground without Prefect, supervised as `run` supervises it "
        "(its parents must be complete); for a multi-node stage, run it on every node with "
        "POSTTRAIN_NODE_RANK set"
    )
    p = sub.add_parser("launch", help=help_text, description=help_text)
    p.add_argument("stage", help="stage name, e.g. sft")
    _recipe_args(p)
    return ap


def _recipe_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", type=Path, help="recipe YAML file")
    p.add_argument("overrides", nargs="*", help="key.path=value (values parsed as YAML)")


def _add_recipe_commands(sub: argparse._SubParsersAction) -> None:
    """validate, plan, run and models: a recipe and its overrides."""
    for name, help_text in (
        (
            "validate",
            "check the recipe and every input it names without training: a verdict line, "
            "then what each input is (exit 2 on any problem)",
        ),
        (
            "plan",
            "validate, then show each stage's fingerprint, whether its artifact exists and "
            "the resolved input paths",
        ),
        ("run", "run the pipeline (embedded Prefect unless PREFECT_API_URL is set)"),
        ("models", "list each pipeline's champion (promoted run) and its lineage"),
    ):
        p = sub.add_parser(name, help=help_text, description=help_text)
        _recipe_args(p)
        if name in ("validate", "plan"):
            p.add_argument(
                "--resolved", action="store_true", help="print the resolved recipe (YAML) too"
            )
            what = "read every row of every data file (not the first 5) and tokenize each "
            what += "stage's rows as it will: bad rows by file:line, rows dropped or truncated, "
            what += "token lengths (p50/p95/max) against the stage's limits"
            p.add_argument("--full", action="store_true", help=what)
        if name in SELECTING:
            add_selection_flags(p, trains=name == "run")


def _add_workspace_commands(sub: argparse._SubParsersAction) -> None:
    """runs and clean: a recipe's workspace, or --workspace."""
    help_text = "list the workspace's runs, newest first (status, duration, headline, promoted)"
    p = sub.add_parser("runs", help=help_text, description=help_text)
    _workspace_args(p)
    p.add_argument("--limit", type=int, metavar="N", help="the newest N runs only")
    help_text = (
        "list what can be deleted from the workspace (failed attempts, damaged checkpoints, "
        "artifacts no run or champion uses) and the space it frees; --yes deletes it"
    )
    p = sub.add_parser("clean", help=help_text, description=help_text)
    _workspace_args(p)
    p.add_argument("--yes", action="store_true", help="delete (without it: a dry run)")
    p.add_argument(
        "--keep-last",
        type=int,
        metavar="N",
        help="keep the artifacts of the newest N runs only (default: of every recorded run); "
        "champions' lineages and each pipeline's newest completed run are always kept",
    )


def _add_served_commands(sub: argparse._SubParsersAction) -> None:
    """serve, submit and publish-base: a Prefect server's side."""
    p = sub.add_parser(
        "serve",
        help="serve a deployment per recipe on the Prefect server (PREFECT_API_URL)",
        description="Serve deployments post-train/<run.name> until stopped: runs requested from "
        "the UI, `posttrain submit`, the recipe's schedule or a new-base event execute here.",
    )
    p.add_argument("recipes", type=Path, nargs="+", help="recipe YAML files")
    folders = {"action": "append", "default": [], "metavar": "DIR"}
    what = "a folder served runs may read from besides the served recipes' workspaces and "
    what += f"allowed paths (repeatable; added to ${ALLOWED_ENV})"
    p.add_argument("--allow-path", help=what, **folders)
    what = "a folder served runs may import reward functions from, besides posttrain.rewards "
    what += f"and the served recipes' own reward modules (repeatable; added to ${REWARDS_ENV})"
    p.add_argument("--allow-rewards", help=what, **folders)
    what = "a server command served runs may start (rollout.server.command, a judge's command), "
    what += f"exactly as written, besides the served recipes' own (repeatable; ${COMMANDS_ENV})"
    p.add_argument("--allow-command", action="append", default=[], metavar="CMD", help=what)
    p = sub.add_parser(
        "submit",
        help="start a run of a served deployment and print its URL",
        description="Start a run of post-train/<run.name> with the recipe (and overrides) as "
        "its parameters; print the run's URL.",
    )
    _recipe_args(p)
    p.add_argument("--wait", action="store_true", help="wait for the run; exit 0 if Completed")
    add_selection_flags(p)
    p = sub.add_parser(
        "publish-base",
        help="emit posttrain.base.published for a base checkpoint folder",
        description="Tell deployments with schedule.on_new_base that a new base is ready.",
    )
    p.add_argument("model_dir", type=Path, help="Hugging Face model folder")
    p.add_argument("--pipeline", default="external", help="who published it (default external)")


def recipe_overrides(args: argparse.Namespace) -> list[str]:
    """The command's `key.path=value` overrides, flags that set a recipe field among them
    (`--wait-devices S` is `infra.wait_devices_s=S`: one schema for recipe, CLI and UI)."""
    overrides = list(getattr(args, "overrides", []))
    if getattr(args, "wait_devices", None) is not None:
        overrides.append(f"infra.wait_devices_s={args.wait_devices}")
    return overrides


def main(argv: list[str] | None = None) -> int:
    # Registered before Prefect is imported, so Prefect's exit hooks run first.
    exit_without_collecting()
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    # `run r.yaml --until sft sft.max_steps=5`: argparse leaves overrides after a flag over.
    takes_overrides = isinstance(getattr(args, "overrides", None), list)
    if rest and takes_overrides and not any(a.startswith("-") for a in rest):
        args.overrides += rest
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    out, err = sys.stdout, sys.stderr
    recipe = None if getattr(args, "recipe", None) is None else str(args.recipe)
    ws = None if getattr(args, "workspace", None) is None else str(args.workspace)
    given = (recipe, recipe_overrides(args), out, err)
    selection = Selection.of(args.until, args.only) if args.command in SELECTING else ALL_STAGES
    commands = {
        "launch": lambda: cmd_launch(args.stage, *given),
        "serve": lambda: cmd_serve(
            list(map(str, args.recipes)),
            out,
            err,
            args.allow_path,
            args.allow_rewards,
            args.allow_command,
        ),
        "submit": lambda: cmd_submit(*given, args.wait, selection),
        "runs": lambda: cmd_runs(*given, ws, args.limit),
        "clean": lambda: cmd_clean(*given, ws, args.yes, args.keep_last),
        "publish-base": lambda: cmd_publish_base(str(args.model_dir), args.pipeline, out, err),
        "validate": lambda: cmd_validate(*given, args.resolved, args.full),
        "plan": lambda: cmd_plan(*given, selection, args.resolved, args.full),
        "run": lambda: cmd_run(*given, selection),
        "models": lambda: cmd_models(*given),
    }
    return commands[args.command]()


if __name__ == "__main__":
    raise SystemExit(main())
