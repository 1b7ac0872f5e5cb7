"""Generate docs/recipes.md from the recipe schema, so the reference cannot drift from the code.

    python -m posttrain.config.docs > docs/recipes.md
(tests/test_docs.py fails when the committed file differs from this output.)
"""

from __future__ import annotations

import json
import sys
from typing import Annotated, Any, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from posttrain.config.graph import __doc__ as _graph_module_doc
from posttrain.config.schema import ENTRY_KINDS, Recipe, StageLinks
from posttrain.kinds import KINDS
from posttrain.sections.fields import effect_for, effect_of

# How shorthand sections and `stages:` entries make one graph (the graph module's docstring,
# from its second paragraph).
GRAPH_DOC = " ".join((_graph_module_doc or "").split("\n\n", 1)[-1].split())

INTRO = """# Recipe reference

A recipe is one YAML file that describes a whole run. Every key below is checked when the recipe
is loaded (`posttrain validate RECIPE`), before any work starts; an unknown key, a wrong type or
an out-of-range value is an error that names its field, the value found and the field or choice
probably meant (`sft.optim.learning_rate: unknown field; did you mean sft.optim.lr?`,
`sft.optim.lr: must be > 0, got 0`; the names TRL, axolotl and LLaMA-Factory use are
recognised, see migrating.md). Any key can be overridden on the command line as
`key.path=value`, for example
`posttrain run recipes/quickstart.yaml sft.optim.lr=5e-4 sft.max_steps=100`; values are parsed
as YAML (`true`, `[q_proj, v_proj]`, `{micro_batch_size: 4}`).

The same schema is the form of the Prefect UI and the parameters of deployments.

## Relative paths

Every relative path in a recipe (`run.workspace`, `ingest.path`, `<stage>.data.path` and
`data.eval_path`, chat template files, `evaluate.lm_eval.include_path`, reward and tool modules)
is resolved against the folder of the recipe file that wrote it, not the current directory:
`cd work; posttrain validate proj/my.yaml` reads `data/x.jsonl` as `work/proj/data/x.jsonl`, and
`posttrain validate` prints the resolved recipe. A path given on the command line
(`sft.data.path=rows.jsonl`, `run.workspace=ws`) is resolved against the current directory, where
the person typing it is. The shipped recipes say `workspace: ../workspace`: the repository's
`workspace/`, from wherever they are run.

## Extends

`extends: base.yaml` (or a list, `extends: [a.yaml, b.yaml]`) at the top of a recipe builds it
on other recipes, named relative to its own folder. They are loaded first (they may extend
others), merged in order, then the recipe itself is merged on top:

- mappings merge key by key, and the later recipe wins (`sft: {optim: {lr: 1e-4}}` changes only
  the learning rate);
- anything else is replaced whole, lists included: a `stages:` list or `evaluate.policies` in
  the extending recipe replaces the base's, it is not appended to;
- `key: null` sets the key to null, as if written so in the base: `dpo: null` drops the base's
  DPO stage, `schedule: null` its schedule; a value that cannot be null is refused by name.

Overrides on the command line apply after the merge. A recipe that extends another is the same
recipe as the merge written out in full: the same stage fingerprints, so the stages it shares
with its base (same sections, same workspace) are reused from the artifact cache. `extends`
itself is read only from a recipe file (the UI form and deployments take the merged recipe). A
cycle (`extends: cycle a.yaml -> b.yaml -> a.yaml`) or a missing file (`extends: other.yaml: no
such recipe file (extended by /abs/a.yaml)`) is refused. `recipes/chain.yaml` is the example: the
quickstart's sections plus a GRPO stage, a name of its own and no schedule.

**re-runs** says what changing a key does to the stage that reads it: `yes`, its fingerprint
changes, so the stage and everything after it run again; `no`, it only changes how the stage
runs (timeouts, the batch layout, progress, the launcher), so a complete artifact is reused.
Blank for a section (its keys decide) and for the run-level sections no stage reads
(`promotion`, `schedule`, `tracking`). Data files, checkpoints, templates and reward code count
by content, hub ids by the commit they resolve to.

Generated from the stage registry (`posttrain/kinds/`), `posttrain/config/schema.py`, `posttrain/sections/` (`shared.py`, `infra.py`, `run.py`) by `python -m posttrain.config.docs`; do not edit.
"""


def _type_name(annotation: Any) -> str:
    origin = get_origin(annotation)
    if origin is Annotated:
        # `Annotated[int, Field(ge=1)]` inside a union: the type is its first argument; the
        # constraints go to the limits column (`_limits`), not into the type's name.
        return _type_name(get_args(annotation)[0])
    if origin is None:
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            return "section"
        return getattr(annotation, "__name__", str(annotation))
    args = get_args(annotation)
    if str(origin) == "typing.Literal":
        return " \\| ".join(f"`{a}`" for a in args)
    if origin is list:
        return f"list of {_type_name(args[0])}"
    if origin is dict:
        return f"mapping of {_type_name(args[0])} to {_type_name(args[1])}"
    if origin is tuple:
        return "[" + ", ".join(_type_name(a) for a in args) + "]"
    return " \\| ".join(_type_name(a) for a in args if a is not type(None)) + (
        " \\| null" if type(None) in args else ""
    )


def _default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
        if isinstance(value, BaseModel):
            return "(section defaults)"
        if isinstance(value, list) and value and isinstance(value[0], BaseModel):
            return f"{len(value)} entries (see below)"
        return f"`{json.dumps(value)}`"
    if field.default is PydanticUndefined:
        return "**required**"
    if isinstance(field.default, BaseModel):
        return "`" + json.dumps(field.default.model_dump(mode="json")) + "`"
    return f"`{json.dumps(field.default)}`"


def _constraints(field: FieldInfo) -> list[Any]:
    """The field's own constraints, and those of an `Annotated` member of its union
    (`Annotated[int, Field(ge=1)] | Literal["auto"]`: the `ge` holds for the int)."""
    out = list(field.metadata)
    for arg in get_args(field.annotation):
        if get_origin(arg) is Annotated:
            for extra in get_args(arg)[1:]:
                out += extra.metadata if isinstance(extra, FieldInfo) else [extra]
    return out


def _limits(field: FieldInfo) -> str:
    out = []
    for m in _constraints(field):
        for attr, sym in (
            ("gt", ">"),
            ("ge", ">="),
            ("lt", "<"),
            ("le", "<="),
            ("pattern", "matches"),
        ):
            v = getattr(m, attr, None)
            if v is not None:
                # A pattern is code: unquoted, markdown reads `[a-z]([-a-z]*)` as a link.
                out.append(f"{sym} `{v}`" if attr == "pattern" else f"{sym} {v}")
    return ", ".join(out)


def _reruns(field: FieldInfo) -> str:
    """yes / no by the field's fingerprint decision (posttrain.sections.fields)."""
    if effect_of(field) == "result" and effect_for(field, trains=False) == "execution":
        return "yes (training stages)"
    return {"result": "yes", "execution": "no"}.get(effect_of(field) or "", "")


def _nested_model(annotation: Any) -> type[BaseModel] | None:
    candidates = [annotation, *get_args(annotation)]
    for c in candidates:
        if isinstance(c, type) and issubclass(c, BaseModel):
            return c
        for inner in get_args(c):
            if isinstance(inner, type) and issubclass(inner, BaseModel):
                return inner
    return None


def _section(model: type[BaseModel], path: str, out: list[str], inherited: str = "") -> None:
    """One section's table, then its nested sections'; `inherited`: "no" inside a section
    marked Execution as a whole (every key of it only changes how the stage runs)."""
    doc = (model.__doc__ or "").strip()
    out.append(f"\n## `{path}`\n")
    if doc and not doc.startswith("!"):
        out.append(" ".join(doc.split()) + "\n")
    out.append("| key | type | default | limits | re-runs | meaning |\n|---|---|---|---|---|---|")
    nested = []
    for name, field in model.model_fields.items():
        sub = _nested_model(field.annotation)
        kind = (
            f"[section](#{(path + '.' + name).replace('.', '')})"
            if sub
            else _type_name(field.annotation)
        )
        if sub and get_origin(field.annotation) is list:
            kind = f"list of [entries](#{(path + '.' + name).replace('.', '')})"
        desc = " ".join((field.description or "").split())
        reruns = inherited or _reruns(field)
        cells = (f"`{name}`", kind, _default(field), _limits(field), reruns, desc)
        out.append("| " + " | ".join(cells) + " |")
        if sub:
            nested.append((sub, f"{path}.{name}", "no" if reruns == "no" else ""))
    for sub, sub_path, sub_inherited in nested:
        _section(sub, sub_path, out, sub_inherited)


def _stages(out: list[str]) -> None:
    """The `stages:` list: its link fields, then which kinds an entry may be (each takes the
    fields of its kind's section, documented under the shorthand section of that name)."""
    out.append("\n## `stages`\n")
    out.append(" ".join((StageLinks.__doc__ or "").split()) + " " + GRAPH_DOC + "\n")
    out.append("| key | type | default | limits | re-runs | meaning |\n|---|---|---|---|---|---|")
    kinds = " \\| ".join(f"`{n}`" for n in ENTRY_KINDS)
    out.append(f"| `kind` | {kinds} | **required** |  | yes | The stage kind (see below). |")
    for name, field in StageLinks.model_fields.items():
        key = field.alias or name
        default = "its kind" if name == "name" else _default(field)
        desc = " ".join((field.description or "").split())
        # A link's parent counts by its fingerprint in that role, not by the stage's name.
        reruns = "no" if name == "name" else "yes (its parent, by role)"
        cells = (f"`{key}`", _type_name(field.annotation), default, _limits(field), reruns, desc)
        out.append("| " + " | ".join(cells) + " |")
    out.append("\n| kind | its fields | what it is |\n|---|---|---|")
    for name in ENTRY_KINDS:
        kind = KINDS[name]
        what = kind.help
        if kind.placement == "first":  # one more base: a name, no links
            what += " One more base model, named by its `name` (no links; `ingest` is taken)."
        out.append(f"| `{name}` | [`{name}`](#{name}) | {what} |")


def render() -> str:
    out = [INTRO, "| section | meaning |\n|---|---|"]
    for name, field in Recipe.model_fields.items():
        out.append(f"| [`{name}`](#{name}) | {field.description} |")
    for name, field in Recipe.model_fields.items():
        if name == "stages":
            _stages(out)
            continue
        sub = _nested_model(field.annotation)
        assert sub is not None
        _section(sub, name, out)
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
