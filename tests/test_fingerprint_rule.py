"""The fingerprint rule, field by field, generated from the schema (posttrain.plan.fingerprints).

For every stage kind, every field a stage of that kind reads (its own section's, and those of
the shared sections its kind declares) is changed to another valid value, and the stage's
fingerprint must change exactly when the field is declared `Result` (or when what the kind
adds of its own changes, e.g. the data-parallel size of online RL). A field that declares
neither, or that no case here reaches, or that no valid change can be found for, fails: a new
field cannot land without a decision. Fast: planning only, nothing runs.
"""

from __future__ import annotations

import copy
import json
import typing
from pathlib import Path
from types import UnionType
from typing import Any, Literal, get_args, get_origin

import pytest
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from posttrain.config.loader import RecipeError, resolve, validate_recipe
from posttrain.config.schema import Recipe
from posttrain.kinds import KINDS, StageKind
from posttrain.kinds._online import CLIPPED_UPDATE_FIELDS
from posttrain.plan.planner import plan
from posttrain.sections.fields import effect_for, effect_of
from tests.stage_helpers import TINY

PREFS = {"synthetic": {"n_examples": 40}, "max_seq_len": 64, "max_prompt_len": 24}
# Two of the batch triple given, the global batch among them: the rows of a step stay the same
# when the number of ranks changes (micro is derived), as in most real recipes.
BATCH = {"global_batch_size": 8, "grad_accum_steps": 1}
REWARD_FN = {"fn": "posttrain.rewards.match:exact_match", "weight": 1.0, "name": "m"}
JUDGE = {"url": "http://127.0.0.1:9", "model": "judge-m", "rubric": "Grade: {completion}"}
RL = {
    "data": {"synthetic": {"n_examples": 40}},
    "rollout": {"prompts_per_step": 4, "samples_per_prompt": 2, "max_new_tokens": 8},
    "max_steps": 2,
}


def _base(tmp: Path) -> dict[str, Any]:
    """One recipe with a stage of every kind, every optional section present (so that each of
    their fields is reached), every input file real."""
    data = copy.deepcopy(TINY)
    data["run"]["workspace"] = str(tmp / "ws")
    data["infra"]["precision"] = "fp32"
    data["ingest"]["from_config"]["template"] = "chatml_tools"  # the RL stages may get tools
    data["sft"]["batch"] = dict(BATCH)
    data["reward"] = {"data": copy.deepcopy(PREFS), "min_accuracy": 0.1, "batch": dict(BATCH)}
    for kind in ("dpo", "orpo", "kto"):
        data[kind] = {"data": copy.deepcopy(PREFS), "batch": dict(BATCH)}
    for kind in ("ppo", "grpo", "online_dpo"):
        data[kind] = copy.deepcopy(RL) | {"rewards": [REWARD_FN], "batch": dict(BATCH)}
    data["grpo"]["rollout"] |= {"engine": "server", "server": dict(SERVER)}
    data["ppo"]["rewards"] = [{"judge": dict(JUDGE), "weight": 1.0}]  # a model as judge
    # A teacher is never defaulted, and a shorthand section takes no links: distill is an entry.
    data["stages"] = [
        {"kind": "distill", "name": "distill", "teacher": "sft", "batch": dict(BATCH)}
        | copy.deepcopy(RL)
        | {"rewards": [REWARD_FN], "rollout": {**RL["rollout"], "samples_per_prompt": 1}}
    ]
    data["evaluate"] |= {
        "verifiers": [REWARD_FN],
        "lm_eval": {"tasks": ["t"], "include_path": str(_tasks(tmp))},
    }
    data["export"] = {"gguf": []}
    data["guard"] = {"loss_spike_k": 3.0}
    data["infra"]["kubernetes"] = {"tolerations": [{"key": "gpu", "operator": "Exists"}]}
    return data


def _tasks(tmp: Path, name: str = "tasks") -> Path:
    folder = tmp / name
    folder.mkdir(exist_ok=True)
    (folder / "t.yaml").write_text(f"task: t\n# {name}\n")
    return folder


def _files(tmp: Path) -> dict[str, str]:
    """Real input files for the path fields (what a change of path points to)."""
    out = {}
    for name, row in {
        "sft.jsonl": {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
        "pairs.jsonl": {"prompt": "a", "chosen": "b", "rejected": "c"},
        "prompts.jsonl": {"prompt": "a", "answer": "b"},
        "unpaired.jsonl": {"prompt": "a", "completion": "b", "label": True},
    }.items():  # fmt: skip
        (tmp / name).write_text(json.dumps(row) + "\n")
        out[name] = str(tmp / name)
    (tmp / "chat.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    out["template"] = str(tmp / "chat.jinja")
    (tmp / "rewards_mod.py").write_text("def fn(prompts, completions, **kw):\n    return [1.0]\n")
    (tmp / "agent_mod.py").write_text(AGENT_MODULE)
    model = tmp / "model"
    model.mkdir(exist_ok=True)
    config = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
              "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 512}  # fmt: skip
    (model / "config.json").write_text(json.dumps(config))
    out["model"] = str(model)
    out["tasks2"] = str(_tasks(tmp, "tasks2"))
    out["rewards"] = f"{tmp / 'rewards_mod.py'}:fn"
    out["tool"] = f"{tmp / 'agent_mod.py'}:add"
    out["environment"] = f"{tmp / 'agent_mod.py'}:Counter"
    out["root"] = str(tmp)
    return out


# A tool and an environment for the rollout's code fields.
AGENT_MODULE = '''
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


class Counter:
    def reset(self, **columns):
        self.n = 0

    def step(self, message):
        self.n += 1
        return [], 0.0, self.n > 1
'''


# Changes that must move several fields at once to stay valid (batch arithmetic, exclusive
# sources), or need a real file: {field path suffix: [edits]}, each edit {relative path: value}.
def _coupled(files: dict[str, str], section: str) -> dict[str, list[dict[str, Any]]]:
    path_file = {
        "sft": "sft.jsonl", "reward": "pairs.jsonl", "dpo": "pairs.jsonl", "orpo": "pairs.jsonl",
        "kto": "unpaired.jsonl", "ppo": "prompts.jsonl", "grpo": "prompts.jsonl",
        "online_dpo": "prompts.jsonl", "distill": "prompts.jsonl",
    }.get(section, "sft.jsonl")  # fmt: skip
    data_file = files[path_file]
    # ppo's reward is a judge, which takes no kwargs: they need a function instead.
    judge_kwargs = {"kwargs": {"k": 1}, "fn": files["rewards"], "judge": None}
    return _rollout_engine_edits(section) | {
        **({"kwargs": [judge_kwargs]} if section == "ppo" else {}),
        "batch.micro_batch_size": [{"batch.micro_batch_size": 4, "batch.grad_accum_steps": 2}],
        "batch.grad_accum_steps": [{"batch.micro_batch_size": 2, "batch.grad_accum_steps": 4}],
        "batch.global_batch_size": [
            {"batch.micro_batch_size": 4, "batch.grad_accum_steps": 1, "batch.global_batch_size": 4}
        ],
        "data.path": [{"data.path": data_file, "data.synthetic": None}],
        "data.eval_path": [{"data.eval_path": data_file}],
        "data.synthetic": [{"data.synthetic": None, "data.path": data_file}],
        "chat_template": [{"chat_template": files["template"]}],
        "path": [{"source": "path", "path": files["model"]}],
        "source": [{"source": "path", "path": files["model"]}],
        "include_path": [{"include_path": files["tasks2"]}],
        "fn": [{"fn": files["rewards"], "judge": None}],
        "judge": [{"judge": dict(JUDGE), "fn": None}],
        "judge.url": [{"judge.url": "http://127.0.0.1:10"}],
        "judge.command": [{"judge.command": "serve --port {port}", "judge.url": None}],
        "judge.rubric": [{"judge.rubric": "Score: {completion}"}],
        "judge.score": [{"judge.score": "choice", "judge.choices": {"A": 1.0}}],
        "judge.choices": [{"judge.choices": {"A": 1.0}}],
        "judge.range": [{"judge.range": [1.0, 5.0]}],
        "judge.api_key_env": [{"judge.api_key_env": "JUDGE_KEY"}],
        "judge.health_path": [{"judge.health_path": "/ready"}],
        "rollout.tools": [{"rollout.tools": [files["tool"]]}],
        "rollout.environment": [{"rollout.environment": files["environment"]}],
        "max_prompt_len": [{"max_prompt_len": 20}],
        "allowed_paths": [{"allowed_paths": [files["root"]]}],
        "embedding_rows": [{"embedding_rows": 1024}],
        "policies": [{"policies": ["sft"]}],
        "policy": [{"policy": "sft"}],
        # The engines' sections: values in their own formats.
        "slurm.time": [{"slurm.time": "4:00:00"}],
        "slurm.mem": [{"slurm.mem": "64G"}],
        "slurm.sbatch_args": [{"slurm.sbatch_args": ["--nice=10"]}],
        "slurm.rdzv_port": [{"slurm.rdzv_port": 29500}],
        "cpu_request": [{"cpu_request": "500m"}],
        "cpu_limit": [{"cpu_limit": "2"}],
        "memory_request": [{"memory_request": "1Gi"}],
        "memory_limit": [{"memory_limit": "2Gi"}],
        "workspace_host_path": [{"workspace_host_path": "/srv/posttrain"}],
        "tolerations.0.value": [{"tolerations.0.operator": "Equal", "tolerations.0.value": "a100"}],
        "pass_k": [{"pass_k": 2}],
        "rollout.samples_per_prompt": [{"rollout.samples_per_prompt": 4}],
        "rollout.prompts_per_step": [{"rollout.prompts_per_step": 8}],
        "devices_per_node": [{"devices_per_node": 2}],
        "nnodes": [{"nnodes": 2, "rdzv_endpoint": "127.0.0.1:29400"}],
        "rdzv_endpoint": [{"rdzv_endpoint": "10.0.0.1:29400"}],
        "parallel_stages": [{"parallel_stages": 2}],
    }


REFUSED = (*CLIPPED_UPDATE_FIELDS, "kl.coef", "kl.adaptive", "rollout.max_staleness")


# Fields no valid change exists for on this machine, with why; their declaration is still
# checked (they must be what is said here).
NO_CHANGE_HERE = {
    "infra.device": ("result", "cuda needs a GPU to resolve"),
    "infra.precision": ("result", "CPU runs refuse half precision"),
    "infra.base_dtype": ("result", "a bf16 base needs a GPU"),
    # Splits each sequence across ranks with the same results (the data-parallel size it
    # changes reaches the print through the batch and rollout inputs, as devices_per_node's).
    "infra.sequence_parallel": ("execution", "above 1 is refused until the stages are wired"),
    # Inherited from the online-RL section, refused unless left as they are: DPO's `beta` is
    # its KL constraint, distillation's loss is its divergence to the teacher, neither step is
    # the clipped update, and both sample with the policy they update (refuse_rl_fields).
    **{f"online_dpo.{f}": ("result", "online DPO accepts only the default") for f in REFUSED},
    **{
        f"distill.{f}": ("result", "distillation accepts only the default")
        for f in (*REFUSED, "dynamic_sampling")
    },
}


# The base recipe's ppo stage samples in process, its grpo stage from a server (so that the
# server section's fields are reached): the edits that switch each to the other engine.
SERVER = {"command": "transformers serve --port {port}"}


def _rollout_engine_edits(section: str) -> dict[str, list[dict[str, Any]]]:
    if section == "grpo":
        to_hf = {"rollout.engine": "hf", "rollout.server": None, "rollout.max_staleness": 0}
        url = {"rollout.server.url": "http://127.0.0.1:9", "rollout.server.command": None}
        return {"rollout.engine": [to_hf], "rollout.server.url": [url]}
    to_server = {"rollout.engine": "server", "rollout.server": SERVER}
    return {
        "rollout.engine": [to_server],
        "rollout.server": [to_server],
        "rollout.max_staleness": [to_server | {"rollout.max_staleness": 1}],
    }


def _candidates(value: Any, info: FieldInfo) -> list[Any]:
    """Other values of a field's type, by its annotation and its bounds."""
    tp = info.annotation
    options: list[Any] = []
    for t in _flat(tp):
        if get_origin(t) is Literal:
            options += [v for v in get_args(t) if v != value]
        elif t is bool:
            options.append(not value)
        elif t is int and not isinstance(value, bool):
            options += [value + 1, value * 2, 1] if isinstance(value, int) else [1, 2, 64]
        elif t is float:
            number = isinstance(value, int | float) and not isinstance(value, bool)
            options += [value * 1.5, value + 0.1, -0.5, 0.5] if number else [0.5, 1.0, -0.5]
        elif t is str:
            options.append((value or "") + "x")
        elif get_origin(t) is list:
            item = get_args(t)[0] if get_args(t) else str
            unused = [v for v in get_args(item) if v not in (value or [])]
            options.append([*(value or []), unused[0] if get_origin(item) is Literal else "x"])
        elif get_origin(t) is dict:
            options.append({**(value or {}), "x": "y"})
        elif get_origin(t) is tuple:
            options.append([value[0] * 0.9, *value[1:]])
        elif t is type(None) and value is not None:
            options.append(None)
    return [o for o in options if o != value and _within(o, info)]


def _flat(tp: Any) -> list[Any]:
    if get_origin(tp) in (typing.Union, UnionType):
        return [x for a in get_args(tp) for x in _flat(a)]
    if get_origin(tp) is typing.Annotated:
        return _flat(get_args(tp)[0])
    return [tp]


def _within(value: Any, info: FieldInfo) -> bool:
    """Whether a number keeps the field's bounds (ge, gt, le, lt)."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return True
    checks = {
        "ge": lambda b: value >= b,
        "gt": lambda b: value > b,
        "le": lambda b: value <= b,
        "lt": lambda b: value < b,
    }
    for m in info.metadata:
        for attr, ok in checks.items():
            bound = getattr(m, attr, None)
            if bound is not None and not ok(bound):
                return False
    return True


def _leaves(
    obj: BaseModel, prefix: str = "", inherited: str | None = None
) -> list[tuple[str, FieldInfo, Any, type, str | None]]:
    """(path, field, value, owning model, effect) of every leaf field reachable in `obj`: the
    fields of an `Execution` subtree (timeouts, the Slurm and Kubernetes sections) are
    execution whatever they say, and must keep the print too."""
    out = []
    for name, info in type(obj).model_fields.items():
        value = getattr(obj, name)
        effect = inherited or effect_of(info)
        path = f"{prefix}{name}"
        if isinstance(value, BaseModel):
            out += _leaves(value, f"{path}.", "execution" if effect == "execution" else None)
        elif isinstance(value, list) and value and all(isinstance(v, BaseModel) for v in value):
            out += _leaves(value[0], f"{path}.0.", "execution" if effect == "execution" else None)
        else:
            out.append((path, info, value, type(obj), effect))
    return out


def _set(data: dict[str, Any], path: str, value: Any) -> None:
    *head, last = path.split(".")
    node: Any = data
    for part in head:
        node = node[int(part)] if isinstance(node, list) else node.setdefault(part, {})
    if isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value


def _prints(data: dict[str, Any], stages: list[str]) -> dict[str, tuple[str, Any]] | None:
    """Per stage: (its fingerprint, what else may move it: its kind's own inputs and its
    parents' fingerprints); None when `data` is not a valid recipe."""
    try:
        recipe = Recipe.model_validate(copy.deepcopy(data))
        recipe = resolve(recipe, Path(data["run"]["workspace"]).parent)
    except (RecipeError, ValueError):
        return None
    out = {}
    for planned in plan(recipe).stages:
        if planned.name in stages:
            kind: StageKind = KINDS[planned.kind]
            extra = (kind.inputs(recipe) if kind.inputs else None, planned.parents)
            out[planned.name] = (planned.fingerprint, extra)
    return out


def _readers(section: str) -> list[str]:
    """The stages whose fingerprint a section's fields enter: its own, or every kind that
    declares it among the shared sections it reads."""
    return [k.name for k in KINDS.values() if section in (k.name, *k.reads)]


SECTIONS = [*KINDS, "run", "infra", "guard"]
# Sections the base recipe writes as `stages:` entries (their kinds need a link), by position.
ENTRIES = {"distill": "stages.0"}
LINKS = ("kind", "name", "from_", "reference", "reward_model", "base", "teacher")


def _section(recipe: Recipe, section: str) -> BaseModel:
    return recipe.stage(section) if section in ENTRIES else getattr(recipe, section)


@pytest.mark.parametrize("section", SECTIONS)
def test_result_fields_change_the_print_and_execution_fields_keep_it(
    tmp_path: Path, section: str
) -> None:
    files = _files(tmp_path)
    # Every section written out, so a nested field can be changed on its own.
    base = Recipe.model_validate(_base(tmp_path)).model_dump(mode="json", by_alias=True)
    readers = _readers(section)
    before = _prints(base, readers)
    assert before is not None, "the base recipe must be valid"
    recipe = Recipe.model_validate(copy.deepcopy(base))
    coupled = _coupled(files, section)
    problems = []
    for path, info, value, owner, effect in _leaves(_section(recipe, section)):
        if effect is None:
            problems.append(f"{section}.{path} ({owner.__name__}): neither Result nor Execution")
            continue
        if section in ENTRIES and path in LINKS:
            continue  # where the entry sits in the graph: its parents' prints, by role
        if f"{section}.{path}" in NO_CHANGE_HERE:
            declared, _why = NO_CHANGE_HERE[f"{section}.{path}"]
            if effect != declared:
                problems.append(f"{section}.{path}: {effect}, expected {declared}")
            continue
        edits = _edits(path, value, info, coupled)
        # Per reading stage: a training-only result is execution for the other kinds.
        effects = {
            stage: effect if effect == "execution" else effect_for(info, KINDS[stage].trains)
            for stage in before
        }
        problems += _check(base, before, section, path, effects, edits)
    assert not problems, "\n".join(problems)


def _edits(
    path: str, value: Any, info: FieldInfo, coupled: dict[str, list[dict[str, Any]]]
) -> list[dict[str, Any]]:
    """The changes to try for one field: its coupled edits, else other values of its type."""
    key = next((k for k in coupled if path == k or path.endswith("." + k)), None)
    if key is None:
        return [{path: c} for c in _candidates(value, info)]
    prefix = path[: len(path) - len(key)]
    return [{prefix + k: v for k, v in e.items()} for e in coupled[key]]


def _check(
    base: dict[str, Any],
    before: dict[str, tuple[str, Any]],
    section: str,
    path: str,
    effects: dict[str, str | None],
    edits: list[dict[str, Any]],
) -> list[str]:
    """The first valid edit of a field must move each reading stage's print exactly when the
    field is a result for it (or when that stage's own kind inputs or parents moved)."""
    for edit in edits:
        changed = copy.deepcopy(base)
        for k, v in edit.items():
            _set(changed, f"{ENTRIES.get(section, section)}.{k}", v)
        after = _prints(changed, list(before))
        if after is None:
            continue  # not a valid recipe: try the next value
        wrong = []
        for stage, (fp, extra) in after.items():
            moved = fp != before[stage][0]
            if moved != (effects[stage] == "result" or extra != before[stage][1]):
                verb = "changed" if moved else "kept"
                wrong.append(f"{verb} {stage}'s fingerprint ({effects[stage]} for it)")
        return [f"{section}.{path}: {edit} " + ", ".join(wrong)] if wrong else []
    return [f"{section}.{path}: no valid change found (add one to _coupled)"]


def _section_types(tp: Any) -> list[type[BaseModel]]:
    return [t for t in _flat(tp) for t in [t, *get_args(t)] if isinstance(t, type) and issubclass(t, BaseModel)]  # fmt: skip


def _all_fields(model: type[BaseModel], seen: set[type]) -> set[tuple[str, str]]:
    if model in seen:
        return set()
    seen.add(model)
    out = set()
    for name, info in model.model_fields.items():
        nested = _section_types(info.annotation)
        if nested:
            for m in nested:
                out |= _all_fields(m, seen)
        else:
            out.add((model.__name__, name))
    return out


def test_every_field_a_stage_reads_is_reached_by_the_cases(tmp_path: Path) -> None:
    """The cases above see every field of every section a stage reads: none is left untested
    because the base recipe lacks its section."""
    recipe = validate_recipe(_base(tmp_path))
    reached = set()
    for section in SECTIONS:
        leaves = _leaves(_section(recipe, section))
        reached |= {(owner.__name__, p.rsplit(".", 1)[-1]) for p, _, _, owner, _ in leaves}
    wanted: set[tuple[str, str]] = set()
    for kind in KINDS.values():
        section_type = type(_section(recipe, kind.name))
        wanted |= _all_fields(section_type, set())
        for shared in kind.reads:
            wanted |= _all_fields(type(getattr(Recipe.model_validate(TINY), shared)), set())
    missing = sorted(wanted - reached)
    assert not missing, f"fields no case reaches (extend _base): {missing}"


def test_a_stage_section_names_its_outside_inputs_by_content(tmp_path: Path) -> None:
    """The same data path with other content is another fingerprint; the same content under
    another run name or workspace is the same one."""
    files = _files(tmp_path)
    base = _base(tmp_path)
    _set(base, "sft.data.path", files["sft.jsonl"])
    _set(base, "sft.data.synthetic", None)
    first = _prints(base, ["sft"])
    Path(files["sft.jsonl"]).write_text(Path(files["sft.jsonl"]).read_text() * 2)
    assert _prints(base, ["sft"]) != first
    renamed = copy.deepcopy(base)
    renamed["run"]["name"] = "other"
    assert _prints(renamed, ["sft"]) == _prints(base, ["sft"])


def test_an_episode_stage_names_its_tools_and_environment_by_content(tmp_path: Path) -> None:
    """A tool's (or an environment's) module with other source is another fingerprint."""
    files = _files(tmp_path)
    for field in ("tools", "environment"):
        base = _base(tmp_path)
        _set(base, f"grpo.rollout.{field}", [files["tool"]] if field == "tools" else files[field])
        first = _prints(base, ["grpo"])
        module = tmp_path / "agent_mod.py"
        module.write_text(module.read_text() + "\n# edited\n")
        assert _prints(base, ["grpo"]) != first, field
        module.write_text(AGENT_MODULE)
