"""What a stage's fingerprint hashes, by one rule with no per-kind branch:

  - the `Result` fields of the sections the stage reads: its own section, and the shared
    sections its kind declares (`StageKind.reads`: `run` and `infra`, plus `guard` for the
    training kinds); `Execution` fields are left out (`posttrain.sections.fields`);
  - the outside-world inputs those fields name, by content (`source=`): data files and
    folders, a local checkpoint, a template file, a task folder by their files' identity
    (`posttrain.store.artifacts.path_identity`), hub ids by the commit their revision resolves to,
    reward functions by their name and their module's source, a judge's model folder by its
    files (its name by its text);
  - what the kind adds of its own (`StageKind.inputs`: the data-parallel size for the kinds
    whose rollouts each rank samples with its own seed);
  - its parents' fingerprints, by role (the planner: `posttrain.store.artifacts.fingerprint`).

The result is the stage's `inputs`: hashed into its fingerprint, recorded in its spec, its
`config.json` and its manifest. `inputs["hub"]` holds the commits the stage process pins.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import to_jsonable_python

from posttrain.config.schema import Recipe
from posttrain.data.chat import looks_like_template_file
from posttrain.hub import RepoType, is_hub_id, resolve_sha
from posttrain.kinds import StageKind
from posttrain.sections.fields import effect_for, source_of
from posttrain.store.artifacts import path_identity


class UndecidedField(TypeError):
    """A recipe field that declares neither `Result` nor `Execution` (a bug, not a user error)."""


@dataclass
class FieldWalk:
    """One pass over a section for a stage of a kind that trains or not: its `Result` values,
    and the outside inputs they name."""

    trains: bool
    files: dict[str, Any] = field(default_factory=dict)
    hub: dict[str, Any] = field(default_factory=dict)

    def section(self, obj: BaseModel, where: str = "") -> dict[str, Any]:
        out = {}
        for name, info in type(obj).model_fields.items():
            if effect_for(info, self.trains) == "execution":
                continue
            out[name] = self.value(getattr(obj, name), info, obj, f"{where}{name}")
        return out

    def value(self, value: Any, info: FieldInfo, owner: BaseModel, where: str) -> Any:
        if isinstance(value, BaseModel):
            return self.section(value, f"{where}.")
        if isinstance(value, list) and value and all(isinstance(v, BaseModel) for v in value):
            return [self.section(v, f"{where}.{i}.") for i, v in enumerate(value)]
        # A field typed as a nested section (or a list or an optional of them) needs no
        # decision of its own, its sections' fields decide (here: it is None or []).
        if effect_for(info, self.trains) is None and not _has_model(info.annotation):
            raise UndecidedField(
                f"{type(owner).__name__}.{where.rsplit('.', 1)[-1]}: declare it Result(...) or "
                "Execution(...) (posttrain.sections.fields)"
            )
        source = source_of(info)
        if source is None or value is None:
            return to_jsonable_python(value)
        return self.outside(source, value, owner, where)

    def outside(self, source: str, value: Any, owner: BaseModel, where: str) -> Any:
        """Record what an input field names (its identity) and return the field's value."""
        if source == "code":  # a function or environment; tools: a list; environments: a mapping
            if isinstance(value, list):
                return [code_identity(v) for v in value]
            if isinstance(value, dict):
                return {k: code_identity(v) for k, v in value.items()}
            return code_identity(value)
        if source == "served_model":
            if Path(value).expanduser().is_dir():
                self.files[where] = path_identity(Path(value).expanduser())
            return value
        if source in ("data", "model") and is_hub_id(value):
            kind: RepoType = "dataset" if source == "data" else "model"
            self.hub[where] = hub_record(value, getattr(owner, "revision", "main"), kind)
        elif source != "template" or (looks_like_template_file(value) and Path(value).is_file()):
            self.files[where] = path_identity(value)
        return value


def _has_model(tp: Any) -> bool:
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return True
    return any(_has_model(arg) for arg in get_args(tp))


def stage_inputs(recipe: Recipe, kind: StageKind, section: BaseModel) -> dict[str, Any]:
    """The fingerprint inputs of a stage of `kind` whose recipe section is `section`."""
    walk = FieldWalk(trains=kind.trains)
    inputs: dict[str, Any] = {"section": walk.section(section)}
    for shared in kind.reads:
        inputs[shared] = walk.section(getattr(recipe, shared))
    if kind.inputs is not None:
        inputs["kind"] = kind.inputs(recipe)
    if walk.files:
        inputs["files"] = walk.files
    if walk.hub:
        inputs["hub"] = walk.hub
    return inputs


def code_identity(fn: str) -> dict[str, str]:
    """A piece of user code's identity (a reward function, tool or environment class): its name
    and its module's source (sha256), not where the module's file lies."""
    from posttrain.rewards.loader import source_file, source_sha256
    from posttrain.sections.rewards import split_ref

    return {"function": split_ref(fn)[1], "source_sha256": source_sha256(source_file(fn))}


def hub_record(repo_id: str, revision: str, repo_type: RepoType) -> dict[str, str]:
    """A hub id's identity: the commit its revision resolves to now (a moved branch is a new
    run). The stage process pins this commit (`posttrain.hub.pin`), so it reads exactly what
    was fingerprinted. Raises HubError (what, where, offline or not)."""
    sha = resolve_sha(repo_id, revision, repo_type)
    return {"repo_type": repo_type, "hub_repo": repo_id, "revision": revision, "commit_sha": sha}
