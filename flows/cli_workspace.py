"""`posttrain models`, `runs` and `clean`: what a workspace holds."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TextIO

from flows.cli_common import EXIT_INVALID, EXIT_OK, load_or_report
from flows.report.tables import text_table


def cmd_models(path: str, overrides: list[str], out: TextIO, err: TextIO) -> int:
    """The champion of every pipeline in the recipe's workspace, with its metrics and lineage."""
    from posttrain.workspace.promotion import champions

    recipe = load_or_report(path, overrides, err)
    if recipe is None:
        return EXIT_INVALID
    found = champions(recipe.run.workspace)
    if not found:
        print(f"no champion yet in {recipe.run.workspace}", file=out)
        return EXIT_OK
    rows = [
        (
            c["name"],
            c["run_id"],
            c["decided_at"],
            ", ".join(f"{k}={v}" for k, v in c["metrics"].items()),
            c.get("export_path") or "-",
        )
        for c in found
    ]
    print(text_table(rows, ("pipeline", "run", "promoted at", "metrics", "export")), file=out)
    for c in found:
        chain = " -> ".join(f"{stage}@{fp}" for stage, fp in c["lineage"].items())
        print(f"\n{c['name']} lineage: {chain}", file=out)
    return EXIT_OK


def _workspace_of(
    path: str | None, overrides: list[str], workspace: str | None, err: TextIO
) -> str | None:
    """The workspace a command looks at: `--workspace DIR`, or the recipe's `run.workspace`;
    None after saying what is wrong."""
    if (path is None) == (workspace is None):
        print("posttrain: give a recipe or --workspace DIR (one of them)", file=err)
        return None
    if workspace is not None:
        if overrides:
            print("posttrain: overrides need a recipe, not --workspace", file=err)
            return None
        if not Path(workspace).is_dir():
            print(f"posttrain: {workspace}: no such workspace folder", file=err)
            return None
        return workspace
    recipe = load_or_report(str(path), overrides, err)
    return None if recipe is None else recipe.run.workspace


def cmd_runs(
    path: str | None,
    overrides: list[str],
    out: TextIO,
    err: TextIO,
    workspace: str | None = None,
    limit: int | None = None,
) -> int:
    """The workspace's runs, newest first: status, when, how long, evaluate headline, gate."""
    from flows.workspace_report import runs_lines
    from posttrain.workspace.runs import list_runs

    ws = _workspace_of(path, overrides, workspace, err)
    if ws is None:
        return EXIT_INVALID
    runs = list_runs(ws, limit)
    for line in runs_lines(runs) if runs else [f"no runs yet in {ws}"]:
        print(line, file=out)
    return EXIT_OK


def cmd_clean(
    path: str | None,
    overrides: list[str],
    out: TextIO,
    err: TextIO,
    workspace: str | None = None,
    yes: bool = False,
    keep_last: int | None = None,
) -> int:
    """Failed attempts, damaged checkpoints and unreferenced artifacts: listed (dry run), or
    deleted with `yes` (posttrain.workspace.clean, posttrain.workspace.trash)."""
    from flows.workspace_report import clean_lines
    from posttrain.workspace.clean import plan_clean

    if keep_last is not None and keep_last < 0:
        print(f"posttrain: --keep-last {keep_last}: must be 0 or more", file=err)
        return EXIT_INVALID
    ws = _workspace_of(path, overrides, workspace, err)
    if ws is None:
        return EXIT_INVALID
    plan = plan_clean(ws, keep_last)
    outcome = None
    if yes:
        from posttrain.workspace.trash import delete

        outcome = delete(plan)
    for line in clean_lines(plan, outcome):
        print(line, file=out)
    return EXIT_OK


def _workspace_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", type=Path, nargs="?", help="recipe YAML file (its run.workspace)")
    p.add_argument("overrides", nargs="*", help="key.path=value (values parsed as YAML)")
    p.add_argument("--workspace", type=Path, metavar="DIR", help="a workspace, not a recipe's")
