"""Which of a plan's stages a run goes through: `--until` and `--only` (issue 29 point 4).

- `--until X`: X and everything it needs upstream (its parents, theirs, ...), each run or
  reused from its artifact; nothing downstream of X, nothing beside it.
- `--only X`: X itself; everything it needs upstream must already be complete in the workspace
  (reused, never run). A stage it needs that is not complete is refused in one line that names
  it and the `--until X` command that would run it.

Several names may be given to either; the run goes through the union, in plan order. The other
stages are left out of the run (its summary names them as not selected). `select_stages` is
pure: what is complete is the caller's answer (`complete_stages` reads the workspace).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from posttrain.kinds import KINDS
from posttrain.plan.planner import RunPlan
from posttrain.runtime.spec import PlannedStage
from posttrain.store.status import status


class SelectionError(ValueError):
    """A selection that cannot run: an unknown stage, or a stage whose inputs are missing."""


@dataclass(frozen=True)
class Selection:
    """The stage names given to `--until` and `--only` (empty: every stage)."""

    until: tuple[str, ...] = ()
    only: tuple[str, ...] = ()

    @classmethod
    def of(cls, until: Iterable[str] | None, only: Iterable[str] | None) -> Selection:
        """From flags that may repeat and hold commas (`--only dpo,evaluate --only export`)."""
        return cls(_names(until), _names(only))

    def __bool__(self) -> bool:
        return bool(self.until or self.only)

    def flags(self) -> str:
        """`--until sft --only dpo`, for messages and the run's record."""
        return " ".join([f"--until {n}" for n in self.until] + [f"--only {n}" for n in self.only])


# No --until/--only: every stage of the recipe.
ALL_STAGES = Selection()


def _names(given: Iterable[str] | None) -> tuple[str, ...]:
    out: list[str] = []
    for item in given or ():
        out += [n.strip() for n in item.split(",") if n.strip()]
    return tuple(dict.fromkeys(out))


def upstream(stages: Sequence[PlannedStage], name: str) -> list[str]:
    """Every stage `name` reads, directly or through others (not `name`), in plan order."""
    by_name = {s.name: s for s in stages}
    seen: set[str] = set()
    todo = list(by_name[name].parents)
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo += list(by_name[n].parents)
    return [s.name for s in stages if s.name in seen]


def select_stages(
    stages: Sequence[PlannedStage],
    selection: Selection,
    complete: set[str],
    command: str = "posttrain run RECIPE",
) -> list[PlannedStage]:
    """The stages a run with `selection` goes through, in plan order. `complete`: the stages
    whose artifact is complete now; `command`: how the user started the run, for the fix of a
    refused `--only` (`<command> --until X`). Raises SelectionError."""
    if not selection:
        return list(stages)
    names = [s.name for s in stages]
    unknown = [
        _unknown(flag, n, names)
        for flag, given in (("--until", selection.until), ("--only", selection.only))
        for n in given
        if n not in names
    ]
    if unknown:
        raise SelectionError("; ".join(unknown) + f"; stages: {', '.join(names)}")
    chosen = set(selection.until) | set(selection.only)
    for n in selection.until:
        chosen |= set(upstream(stages, n))
    for n in selection.only:
        needed = [p for p in upstream(stages, n) if p not in chosen]
        if missing := [p for p in needed if p not in complete]:
            raise SelectionError(
                f"--only {n}: {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not "
                f"complete in this workspace ({n} needs {'it' if len(missing) == 1 else 'them'}); "
                f"run `{command} --until {n}` to run or reuse what {n} needs"
            )
        chosen |= set(needed)  # complete: reused, so the run has their artifacts to pass on
    return [s for s in stages if s.name in chosen]


def _unknown(flag: str, name: str, names: list[str]) -> str:
    """`--until sfft: no stage of that name (did you mean sft?)`"""
    if name in KINDS and KINDS[name].placement == "last":
        return f"{flag} {name}: {name} is off in this recipe (`{name}: null`)"
    close = difflib.get_close_matches(name, names, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return f"{flag} {name}: no stage of that name{hint}"


def complete_stages(stages: Iterable[PlannedStage]) -> set[str]:
    """The stages whose artifact is complete: its manifest there, of the planned fingerprint,
    and the files it lists (sizes, not hashes: the supervisor hashes them when it reuses it)."""
    return {s.name for s in stages if status(s.out_dir, s.fingerprint, hashes=False).complete}


def choose(
    run_plan: RunPlan, selection: Selection, command: str = "posttrain run RECIPE"
) -> RunPlan:
    """`run_plan` narrowed to `selection` (unchanged when empty), the stages left out named in
    its `not_selected`. Raises SelectionError."""
    if not selection:
        return run_plan
    kept = select_stages(run_plan.stages, selection, complete_stages(run_plan.stages), command)
    left = [s.name for s in run_plan.stages if s not in kept]
    return replace(run_plan, stages=kept, not_selected=left)
