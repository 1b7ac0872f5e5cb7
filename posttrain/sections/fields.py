"""The base of every recipe section, and the one decision every field of a stage's sections
makes: does it change what the stage makes (`Result`), or only how it runs (`Execution`)?

A stage's fingerprint hashes its `Result` fields and nothing else (`posttrain.plan.fingerprints`),
so a new field is either part of the result or not, said where it is declared; a test walks the
schema and fails on a field that says neither (tests/test_fingerprint_rule.py). A field holding
a nested section (or a list of them) needs no word of its own, its fields decide; marked
`Execution`, its whole subtree is left out (timeouts, the Slurm and Kubernetes sections).

`source` names an outside-world input whose content, not only its name, decides the result:
  - "data": a data file or folder (by content), or a hub dataset id (by the commit its sibling
    `revision` resolves to);
  - "model": a checkpoint folder (by its files' identity) or a hub model id (by commit);
  - "template": a chat template given inline or as a file (a file by content);
  - "files": a folder whose files are read (by content);
  - "code": a reward function `module:fn` (by its function name and its module's source);
  - "served_model": the model a server loads by name (a judge's): a local folder by its files'
    identity, anything else by its text (an API's model name is no hub id to resolve).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.fields import FieldInfo

Effect = Literal["result", "execution"]
Source = Literal["data", "model", "template", "files", "code", "served_model"]
EFFECT_KEY = "fingerprint"  # in the field's JSON schema: the UI form and docs show it too
SOURCE_KEY = "input_source"
READERS_KEY = "fingerprint_readers"


class _Section(BaseModel):
    # extra="forbid": a misspelt key is an error that names it, never silently ignored.
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def _marked(effect: Effect, kwargs: dict[str, Any], **marks: Any) -> dict[str, Any]:
    extra = dict(kwargs.pop("json_schema_extra", None) or {})
    extra[EFFECT_KEY] = effect
    extra.update({k: v for k, v in marks.items() if v is not None})
    return {**kwargs, "json_schema_extra": extra}


def Result(  # noqa: N802
    *args: Any, source: Source | None = None, training_only: bool = False, **kwargs: Any
) -> Any:
    """A field whose value changes what the stage makes: part of its fingerprint. Takes what
    `pydantic.Field` takes. `training_only`: a shared field only the training kinds' results
    depend on (the frozen base's dtype, fp16 loss scaling): for the others it is execution."""
    marks = {SOURCE_KEY: source, READERS_KEY: "training" if training_only else None}
    return Field(*args, **_marked("result", kwargs, **marks))


def Execution(*args: Any, **kwargs: Any) -> Any:  # noqa: N802
    """A field that changes how the stage runs (timeouts, batch layout where the rows of a step
    do not change, progress, tracking, the launcher), never what it makes: left out of the
    fingerprint, so changing it reuses the artifact."""
    return Field(*args, **_marked("execution", kwargs))


def _mark(info: FieldInfo, key: str) -> Any:
    extra = info.json_schema_extra
    return extra.get(key) if isinstance(extra, dict) else None


def effect_of(info: FieldInfo) -> Effect | None:
    """What a field declared (None: nothing, which only a nested section may do)."""
    return _mark(info, EFFECT_KEY)


def effect_for(info: FieldInfo, trains: bool) -> Effect | None:
    """What a field is for a stage of a kind that trains (`trains`) or not."""
    effect = effect_of(info)
    if effect == "result" and _mark(info, READERS_KEY) == "training" and not trains:
        return "execution"
    return effect


def source_of(info: FieldInfo) -> Source | None:
    return _mark(info, SOURCE_KEY)
