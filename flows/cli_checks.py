"""`posttrain validate` and `posttrain plan`: the verdict on a recipe and its inputs, and the
stages a run (or a selection of it) would go through."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

import yaml

from flows.cli_common import EXIT_INVALID, EXIT_OK, load_or_report, refused_head
from flows.report.tables import text_table
from posttrain.config.schema import Recipe
from posttrain.kinds import KINDS
from posttrain.plan.planner import RunPlan, plan
from posttrain.plan.selection import ALL_STAGES, Selection, SelectionError, choose, complete_stages
from posttrain.runtime.spec import PlannedStage
from posttrain.store.status import status


def cmd_validate(
    path: str,
    overrides: list[str],
    out: TextIO,
    err: TextIO,
    resolved: bool = False,
    full: bool = False,
) -> int:
    """The verdict on the recipe and every input it names (exit 2 on any problem), then what
    each input is; `resolved`: the resolved recipe as YAML too; `full`: every data row read
    and tokenized (`posttrain.config.full_check`)."""
    recipe = load_or_report(path, overrides, err)
    if recipe is None:
        return EXIT_INVALID
    stages = plan(recipe).stages
    # Complete by manifest and file sizes: validate hashes no artifact (plan verifies them).
    done = complete_stages(stages)
    ingested = _ingested(stages, done) if full else None
    ok = _check_inputs(path, recipe, (len(stages), len(stages) - len(done)), out, ingested)
    _print_resolved(recipe, resolved, out)
    return EXIT_OK if ok else EXIT_INVALID


def _print_resolved(recipe: Recipe, resolved: bool, out: TextIO) -> None:
    """`--resolved`: the resolved recipe as YAML, after a marker line."""
    if resolved:
        out.write("--- # resolved recipe\n")
        out.write(yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False))


def _ingested(stages: Sequence[PlannedStage], done: set[str]) -> dict[str, Path]:
    """Base name -> the saved tokenizer of its ingest artifact, for each one complete for
    this recipe: the tokenizer its stages load, which `--full` tokenizes with."""
    bases = [s for s in stages if KINDS[s.kind].placement == "first" and s.name in done]
    return {s.name: s.out_dir / "tokenizer" for s in bases}


def _check_inputs(
    path: str,
    recipe: Recipe,
    counts: tuple[int, int],
    out: TextIO,
    ingested: dict[str, Path] | None = None,
) -> bool:
    """Print the verdict (`recipe ok: 4 stages, 3 to run` from `counts`, or each problem and
    the fix), then one line per input; True when nothing is wrong. `ingested` given: the full
    check (`--full`), tokenizing with those saved tokenizers (`check_inputs`)."""
    from posttrain.config.inputs_check import check_inputs

    report = check_inputs(recipe, ingested=ingested)
    if report.problems:
        print(refused_head(path, len(report.problems)), file=out)
        what, again = ("rows and fields", " --full") if ingested is not None else ("fields", "")
        fix = f"correct the {what} named above (or create the files they name), then "
        fix += f"`posttrain validate{again}` again; nothing ran"
        print(*(f"  {line}" for line in report.problems), f"  fix:  {fix}", sep="\n", file=out)
    else:
        print(f"recipe ok: {counts[0]} stages, {counts[1]} to run", file=out)
    for line in report.lines:
        print(line, file=out)
    return not report.problems


def resolved_inputs(recipe: Recipe) -> list[tuple[str, str]]:
    """(field path, resolved value) of every input: paths absolute, hub ids with their
    revision, code as the file it is imported from."""
    from posttrain.config.loader import code_refs, hub_ids, input_paths

    found = dict(input_paths(recipe))
    found |= {at: f"{repo}@{rev} (hub {kind})" for at, (repo, rev, kind) in hub_ids(recipe).items()}
    found |= {code.where: code.ref for code in code_refs(recipe)}
    return sorted(found.items())


# How `posttrain plan` names a stage's inputs (the base is every stage's: left out).
ROLE_LABELS = {"policy": "from", "reference": "ref", "reward_model": "rm", "teacher": "teacher"}


def inputs_text(roles: dict[str, str]) -> str:
    """`from dpo, ref sft, rm reward` (graph stages' links; "" for the fixed stages)."""
    return ", ".join(f"{ROLE_LABELS[r]} {n}" for r, n in roles.items() if r in ROLE_LABELS)


def plan_rows(
    stages: Sequence[PlannedStage], selected: set[str] | None = None
) -> list[tuple[str, str, str, str, str, str]]:
    """(stage, kind, inputs, fingerprint, where it runs, artifact state) per planned stage; a
    stage outside `selected` is `not selected`. Where: `slurm:4x8` (nodes x processes),
    `local:2`, or `local` for one process here."""
    rows = []
    for stage in stages:
        if selected is not None and stage.name not in selected:
            state = "not selected"
        else:
            # Sizes only: `plan` answers in a stat per file however large the workspace; the
            # run hashes an artifact before it reuses it, and rebuilds one whose bytes changed.
            look = status(stage.out_dir, stage.fingerprint, hashes=False)
            state = {"unsealed": "incomplete (started, no manifest)"}.get(look.state, look.state)
            state += f" ({look.why})" if look.state == "invalid" else ""
        graph_stage = KINDS[stage.kind].placement == "graph"
        links = inputs_text(stage.roles) if graph_stage else stage.roles.get("policy", "")
        where = stage.launcher
        if stage.nnodes > 1:
            where += f":{stage.nnodes}x{stage.nprocs}"
        elif stage.nprocs > 1 or stage.launcher != "local":
            where += f":{stage.nprocs}"
        rows.append((stage.name, stage.kind, links, stage.fingerprint, where, state))
    return rows


def selected_stages(
    run_plan: RunPlan, path: str, selection: Selection, err: TextIO
) -> set[str] | None | int:
    """The names `selection` keeps (None: no selection, every stage), or EXIT_INVALID after
    printing why it cannot run (an unknown stage, an `--only` whose inputs are missing)."""
    if not selection:
        return None
    try:
        run_plan = choose(run_plan, selection, f"posttrain run {path}")
    except SelectionError as exc:
        print(f"posttrain: {exc}", file=err)
        return EXIT_INVALID
    return {s.name for s in run_plan.stages}


def cmd_plan(
    path: str,
    overrides: list[str],
    out: TextIO,
    err: TextIO,
    selection: Selection = ALL_STAGES,
    resolved: bool = False,
    full: bool = False,
) -> int:
    """The verdict and inputs (as `validate`, `full` too), each stage's fingerprint and
    artifact, and every input's resolved path; `resolved`: the resolved recipe as YAML too."""
    recipe = load_or_report(path, overrides, err)
    if recipe is None:
        return EXIT_INVALID
    run_plan = plan(recipe)  # once: fingerprints read the data files
    selected = selected_stages(run_plan, path, selection, err)
    if isinstance(selected, int):
        return selected
    rows = plan_rows(run_plan.stages, selected)
    to_run = sum(row[-1] not in ("complete", "not selected") for row in rows)
    ingested = _ingested(run_plan.stages, complete_stages(run_plan.stages)) if full else None
    ok = _check_inputs(path, recipe, (len(rows), to_run), out, ingested)
    header = ("stage", "kind", "inputs", "fingerprint", "runs on", "artifact")
    print("\n" + text_table(rows, header), f"workspace: {recipe.run.workspace}", sep="\n", file=out)
    inputs = resolved_inputs(recipe)
    width = max((len(where) for where, _ in inputs), default=0)
    print("resolved inputs:", file=out)
    for where, value in inputs:
        print(f"  {where:<{width}}  {value}", file=out)
    _print_resolved(recipe, resolved, out)
    return EXIT_OK if ok else EXIT_INVALID
