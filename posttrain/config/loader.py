"""Load a recipe: YAML file + dotted overrides -> validated `Recipe` -> `ResolvedRecipe`.

Resolution turns every `auto` into a concrete value (device, devices_per_node, precision) and
fills the derived batch field, so the recipe written into a run folder says exactly what ran.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import ValidationError

from posttrain.config.batch import ResolvedBatch, stage_batch
from posttrain.config.recipe_file import (
    RecipeError,
    apply_overrides,
    check_plain,
    read_yaml,
)
from posttrain.config.schema import Recipe, ResolvedRecipe
from posttrain.config.sp_check import sp_errors
from posttrain.config.vocab_check import vocab_errors
from posttrain.data.chat import looks_like_template_file
from posttrain.hub import HubError, RepoType, is_hub_id, resolve_sha
from posttrain.secrets import find_secrets

if TYPE_CHECKING:
    from posttrain.config.extends import Origins

R = TypeVar("R", bound=Recipe)


def _loc(loc: tuple[Any, ...], data: Any) -> str:
    """A pydantic error location as the recipe's field path: `stages.<i>.<kind tag>.x` becomes
    `stages.<name>.x` (the entry's name, or its kind when it has none)."""
    parts = list(loc)
    if len(parts) >= 2 and parts[0] == "stages" and isinstance(parts[1], int):
        entries = data.get("stages") if isinstance(data, dict) else None
        entry = entries[parts[1]] if isinstance(entries, list) and parts[1] < len(entries) else {}
        entry = entry if isinstance(entry, dict) else {}
        label = entry.get("name") or entry.get("kind")
        if isinstance(label, str) and label:
            parts[1] = label
        if len(parts) >= 3 and parts[2] == entry.get("kind"):
            del parts[2]  # the union's tag: the entry's own kind
    return ".".join(str(p) for p in parts)


def format_validation_error(err: ValidationError, data: Any = None) -> list[str]:
    """One line per error, each starting with its dotted field path (`sft.optim.lr: ...`,
    `stages.dpo2.beta: ...`), in plain words with the value found and the field or choice
    probably meant (`posttrain.config.error_text`)."""
    from posttrain.config.error_text import describe
    from posttrain.config.graph import GraphError

    def path_of(loc: Any) -> str:
        return _loc(tuple(loc), data)

    lines = []
    for e in err.errors():
        cause = (e.get("ctx") or {}).get("error")
        if isinstance(cause, GraphError):  # one line per problem, each with its own field path
            lines += cause.errors
            continue
        path = path_of(e["loc"])
        if e["type"].startswith("union_tag"):  # the entry's `kind` picks its section
            path += ".kind"
        msg = describe(e, path_of)
        lines.append(f"{path}: {msg}" if path else msg)
    return lines


def secret_errors(data: Any) -> list[str]:
    """One `field.path: ...` line per secret-looking value. The recipe has no secret fields, so
    a token anywhere in it is a mistake, and a recipe is copied into run folders, specs, the
    Prefect UI and manifests. The value itself is never echoed."""
    return [
        f"{where}: looks like a secret ({kind}); a recipe holds no credentials (they would be "
        "copied into run folders, manifests and the Prefect UI): pass them through the "
        "environment, e.g. HF_TOKEN"
        for where, kind in find_secrets(data)
    ]


def validate_recipe(data: dict[str, Any], source: str = "recipe") -> Recipe:
    if errors := check_plain(data, source) or secret_errors(data):
        raise RecipeError(errors, source)
    try:
        return Recipe.model_validate(data)
    except ValidationError as exc:
        raise RecipeError(format_validation_error(exc, data), source) from exc


def _cuda_devices() -> int:
    # No NVIDIA device node: no GPU, and the orchestrating process need not import torch (2-4 s).
    if not any(Path("/dev").glob("nvidia[0-9]*")):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _bf16_supported() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.is_bf16_supported()


def resolve(
    recipe: Recipe,
    recipe_dir: str | os.PathLike[str] | None = None,
    code_roots: list[Path] | None = None,
    origins: Origins | None = None,
) -> ResolvedRecipe:
    """Make every `auto` concrete and every path absolute; check batch arithmetic and that
    every input path stays inside the allowed folders (`resolve_paths`; `code_roots`: where
    reward functions may come from instead of the recipe's folder and run.allowed_paths, for a
    served run; `origins`: which file wrote each value)."""
    r = recipe.model_copy(deep=True)
    infra = r.infra
    gpus = None
    autos = (infra.device, infra.devices_per_node, infra.precision, infra.parallel_stages)
    if "auto" in autos or (infra.device == "cuda" and infra.parallel_stages != 1):
        gpus = _cuda_devices()
    if infra.device == "auto":
        infra.device = "cuda" if gpus else "cpu"
    if infra.devices_per_node == "auto":
        infra.devices_per_node = gpus if infra.device == "cuda" else 1
    if infra.precision == "auto":
        infra.precision = "bf16" if infra.device == "cuda" and _bf16_supported() else "fp32"
    if infra.base_dtype == "auto":
        infra.base_dtype = (
            "bf16" if infra.device == "cuda" and infra.precision == "bf16" else "fp32"
        )
    errors = []
    per_stage = int(infra.devices_per_node)
    if infra.parallel_stages == "auto":
        fits = (gpus or 0) // max(1, per_stage) if infra.device == "cuda" else 1
        infra.parallel_stages = max(1, fits) if infra.nnodes == 1 else 1
    elif infra.device == "cuda" and infra.parallel_stages * per_stage > (gpus or 0):
        errors.append(
            f"infra.parallel_stages: {infra.parallel_stages} stages x {per_stage} devices each "
            f"need {infra.parallel_stages * per_stage} GPUs; {gpus or 0} are visible"
        )
    elif infra.nnodes > 1 and infra.parallel_stages > 1:
        errors.append("infra.parallel_stages: multi-node runs run one stage at a time")
    if infra.device == "cpu" and infra.precision in ("bf16", "fp16"):
        errors.append(
            f"infra.precision: {infra.precision} on CPU is refused: half-precision matmul on CPU is "
            "~100x slower than fp32 here; use fp32 (or precision: auto)"
        )
    try:
        r = resolve_paths(r, recipe_dir, code_roots, origins)
    except RecipeError as exc:
        errors.extend(exc.errors)
    errors.extend(hub_id_errors(r))
    lm_eval = r.evaluate.lm_eval if r.evaluate is not None else None
    include = lm_eval.include_path if lm_eval else None
    if include and not Path(include).is_dir():
        errors.append(f"evaluate.lm_eval.include_path: {include} is not a folder of task YAMLs")
    errors.extend(gguf_errors(r))
    errors.extend(vocab_errors(r))
    errors.extend(sp_errors(r, local_bases=True))
    for name, section in r.training_sections().items():
        try:
            b = section_batch(r, name)
            section.batch.micro_batch_size = b.micro_batch_size
            section.batch.grad_accum_steps = b.grad_accum_steps
            section.batch.global_batch_size = b.global_batch_size
        except ValueError as exc:
            errors.append(str(exc))
    if errors:
        raise RecipeError(errors)
    return ResolvedRecipe.model_validate(r, from_attributes=True)  # its sections, validated again


def gguf_errors(recipe: Recipe) -> list[str]:
    """export.gguf with a base known now (a local folder) that cannot go to GGUF: refused at
    load, before any stage runs. from_config builds only convertible families; a hub base is
    checked by the export stage at its start (its files may not be in the cache yet)."""
    base = recipe.ingest.path
    if (
        recipe.export is None
        or not recipe.export.gguf
        or recipe.ingest.source != "path"
        or not base
        or is_hub_id(base)
    ):
        return []
    if not (Path(base) / "config.json").is_file():
        return []  # resolve_paths reports a missing folder
    from posttrain.export.gguf import GGUFUnsupported, check_convertible

    try:
        check_convertible(base)
    except GGUFUnsupported as exc:
        return [str(exc)]
    return []


def input_paths(recipe: Recipe, base: Callable[[str], Path] | None = None) -> dict[str, str]:
    """{field path: value} of every path the recipe reads from (not the workspace it writes).
    Hub ids (`org/name` that is no local path under `base(field path)`, default the current
    directory) are not paths: the hub cache serves them."""

    def local(where: str, value: str | None) -> bool:
        return bool(value) and not is_hub_id(value, base(where) if base else None)

    out = {}
    graph = recipe.graph()
    for b in graph.bases.values():  # `ingest.path`, `stages.<base>.path`
        if local(f"{b.where}.path", b.section.path):
            out[f"{b.where}.path"] = b.section.path
    # A chat template given as a file is read by the stage (and saved into its artifact).
    guards = [(s.where, s.section) for s in [*graph.bases.values(), *graph]]
    for where, section in guards:
        value = getattr(section, "chat_template", None)
        if value and looks_like_template_file(value):
            out[f"{where}.chat_template"] = value
    for s in graph:
        for attr in ("path", "eval_path"):
            value = getattr(s.section.data, attr)
            if local(f"{s.where}.data.{attr}", value):
                out[f"{s.where}.data.{attr}"] = value
    lm_eval = recipe.evaluate.lm_eval if recipe.evaluate is not None else None
    if lm_eval is not None and lm_eval.include_path:
        out["evaluate.lm_eval.include_path"] = lm_eval.include_path
    out |= _judge_folders(recipe, base)
    return out


def _judge_folders(recipe: Recipe, base: Callable[[str], Path] | None) -> dict[str, str]:
    """{field path: value} of each judge `model` that is a local folder (relative to the
    recipe's); a judge's model may also be a name its server knows, which is no path."""
    specs = [
        (f"{s.where}.rewards.{i}", spec)
        for s in recipe.graph()
        for i, spec in enumerate(getattr(s.section, "rewards", None) or [])
    ]
    verifiers = (recipe.evaluate and recipe.evaluate.verifiers) or []
    specs += [(f"evaluate.verifiers.{i}", spec) for i, spec in enumerate(verifiers)]
    out = {}
    for where, spec in specs:
        if spec.judge is None:
            continue
        at = f"{where}.judge.model"
        folder = base(at) if base else Path.cwd()
        if (folder / Path(spec.judge.model).expanduser()).is_dir():
            out[at] = spec.judge.model
    return out


@dataclass
class CodeRef:
    """A piece of user code a recipe names: a reward function, a tool or an environment."""

    where: str  # its field path: grpo.rewards.0.fn, grpo.rollout.tools.1, evaluate.verifiers.0.fn
    kind: str  # "reward", "tool" or "environment": how errors name it
    owner: Any  # the object holding the field
    attr: str
    index: int | str | None = None  # the item of a list field (tools), the key of a mapping

    @property
    def ref(self) -> str:
        value = getattr(self.owner, self.attr)
        return value if self.index is None else value[self.index]

    def point_at(self, ref: str) -> None:
        if self.index is None:
            setattr(self.owner, self.attr, ref)
        else:
            getattr(self.owner, self.attr)[self.index] = ref


def code_refs(recipe: Recipe) -> list[CodeRef]:
    """Every piece of user code the recipe names: each stage's reward functions, its rollout's
    tools and environment, and evaluate's verifiers."""
    out = []
    for s in recipe.graph():
        for i, spec in enumerate(getattr(s.section, "rewards", None) or []):
            if spec.fn is not None:  # a judge entry names no code
                out.append(CodeRef(f"{s.where}.rewards.{i}.fn", "reward", spec, "fn"))
        rollout = getattr(s.section, "rollout", None)
        if rollout is None:
            continue
        for i, _ in enumerate(rollout.tools):
            out.append(CodeRef(f"{s.where}.rollout.tools.{i}", "tool", rollout, "tools", i))
        if isinstance(rollout.environment, dict):  # several classes, each by its name
            for name in rollout.environment:
                where = f"{s.where}.rollout.environment.{name}"
                out.append(CodeRef(where, "environment", rollout, "environment", name))
        elif rollout.environment is not None:
            where = f"{s.where}.rollout.environment"
            out.append(CodeRef(where, "environment", rollout, "environment"))
    for i, spec in enumerate((recipe.evaluate and recipe.evaluate.verifiers) or []):
        if spec.fn is not None:
            out.append(CodeRef(f"evaluate.verifiers.{i}.fn", "reward", spec, "fn"))
    return out


def _resolve_code(
    r: Recipe,
    code_roots: list[Path],
    home: Callable[[str], Path] | None,
    errors: list[str],
) -> list[Path]:
    """Point each piece of user code (reward functions, tools, environments) at its module's
    absolute file (`/dir/mod.py:name`), found in `home(field path)` (the folder of the recipe
    file that named it) or `code_roots` only (no current directory, no workspace: code is not
    data). Returns the home folders a module was found in."""
    from posttrain.rewards.loader import RewardLoadError, locate
    from posttrain.sections.rewards import is_builtin, split_ref

    needed: list[Path] = []
    for code in code_refs(r):
        if is_builtin(code.ref):
            continue
        folder = home(code.where) if home is not None else None
        try:
            path = locate(code.ref, [*([folder] if folder else []), *code_roots], code.kind)
        except RewardLoadError as exc:
            errors.append(f"{code.where}: {exc}")
            continue
        if folder is not None and _inside(path, folder) and folder not in needed:
            needed.append(folder)
        code.point_at(f"{path}:{split_ref(code.ref)[1]}")
    return needed


def _set(recipe: Recipe, where: str, value: str) -> None:
    """Set the field at dotted `where` (`sft.data.path`, `stages.dpo2.data.path`)."""
    *parts, attr = where.split(".")
    target: Any = recipe
    if parts[0] == "stages":
        target, parts = recipe.stage(parts[1]), parts[2:]
    for part in parts:  # a list's item by its index (`grpo.rewards.0.judge.model`)
        target = target[int(part)] if part.isdigit() else getattr(target, part)
    setattr(target, attr, value)


def hub_ids(recipe: Recipe) -> dict[str, tuple[str, str, RepoType]]:
    """{field path: (hub id, revision, repo type)} of every input given as a hub id."""
    out: dict[str, tuple[str, str, RepoType]] = {}
    graph = recipe.graph()
    for b in graph.bases.values():
        if b.section.source == "path" and is_hub_id(b.section.path):
            out[f"{b.where}.path"] = (str(b.section.path), b.section.revision, "model")
    for s in graph:
        for attr in ("path", "eval_path"):
            value = getattr(s.section.data, attr)
            if is_hub_id(value):
                out[f"{s.where}.data.{attr}"] = (value, s.section.data.revision, "dataset")
    return out


def hub_id_errors(recipe: Recipe) -> list[str]:
    """One `field.path: ...` line per hub id whose revision does not resolve (from the cache
    offline, from the hub online): checked where the run resolves, before any work starts.
    Not in `resolve_paths`: a recipe sent to a server is resolved against the server's cache."""
    errors = []
    for where, (repo_id, revision, repo_type) in hub_ids(recipe).items():
        try:
            resolve_sha(repo_id, revision, repo_type)
        except HubError as exc:
            errors.append(f"{where}: {exc}")
    return errors


def _inside(path: Path, root: Path) -> bool:
    return path == root or path.is_relative_to(root)


def _real(value: str, where: str, errors: list[str], base: Path | None = None) -> Path | None:
    """`value` made absolute against `base` (default: the current directory) with `~` expanded
    and symlinks resolved; None (and an error line) when it cannot be: a NUL byte, `~user` of
    no such user, a name too long for the system."""
    try:
        return (Path(base or ".") / Path(value).expanduser()).resolve()
    except (RuntimeError, ValueError, OSError) as exc:
        errors.append(f"{where}: {value[:200]!r} is not a usable path ({exc})")
        return None


def resolve_paths(
    recipe: Recipe,
    recipe_dir: str | os.PathLike[str] | None = None,
    code_roots: list[Path] | None = None,
    origins: Origins | None = None,
) -> Recipe:
    """A copy with the workspace and every data/model path absolute, symlinks resolved. What
    `posttrain serve`/`submit` send: paths are the sender's, while `auto` devices and precision
    stay for the machine that runs the flow to resolve.

    A relative path is relative to the folder of the recipe file that wrote it (`origins`: an
    extended recipe's values to its own folder; with no origins, `recipe_dir`), and to the
    current directory when it came from the command line or there is no recipe file.

    Every input path must lie inside an allowed folder: the recipe files' folders, the current
    directory, the workspace, or one of `run.allowed_paths`. Symlinks are resolved first, so
    neither `..` nor a link out of an allowed folder reaches /etc or ~/.ssh. A recipe folder or
    current directory that a path needed is appended to `run.allowed_paths`, so the resolved
    recipe (what a run folder records and what a server runs, in another directory) passes the
    same check again.
    """
    r = recipe.model_copy(deep=True)
    cwd = Path.cwd().resolve()
    home = Path(recipe_dir).resolve() if recipe_dir is not None else None

    def base(where: str) -> Path:
        if origins is not None:
            return origins.folder(where) or cwd
        return home or cwd

    errors: list[str] = []
    workspace = _real(r.run.workspace, "run.workspace", errors, base("run.workspace"))
    explicit = [
        x
        for i, p in enumerate(r.run.allowed_paths)
        if (x := _real(p, f"run.allowed_paths.{i}", errors, base(f"run.allowed_paths.{i}")))
        is not None
    ]
    if workspace is None or len(explicit) < len(r.run.allowed_paths):
        raise RecipeError(errors)
    r.run.workspace = str(workspace)
    files = [*([home] if home else []), *(origins.files() if origins else [])]
    implicit = [*dict.fromkeys([*files, cwd])]
    roots = [workspace, *explicit]
    needed = _resolve_inputs(r, base, implicit, roots, errors)
    # Reward code: from the folder of the recipe file that names it or run.allowed_paths (a
    # served run: only the worker's reward folders, `code_roots`).
    if code_roots is not None:
        _resolve_code(r, list(code_roots), None, errors)
    else:

        def code_home(where: str) -> Path:
            return (origins.folder(where) if origins else None) or home or cwd

        for found in _resolve_code(r, explicit, code_home, errors):
            if found not in needed and not any(_inside(found, x) for x in explicit):
                needed.append(found)
    if errors:
        raise RecipeError(errors)
    r.run.allowed_paths = [*(str(x) for x in [*explicit, *needed])]
    return r


def _resolve_inputs(
    r: Recipe,
    base: Callable[[str], Path],
    implicit: list[Path],
    roots: list[Path],
    errors: list[str],
) -> list[Path]:
    """Make each input path of `r` absolute (against `base(field path)`), refusing any outside
    `implicit` and `roots`; returns the implicit folders a path needed."""
    needed: list[Path] = []
    for where, value in input_paths(r, base).items():
        folder = base(where)
        resolved = _real(value, where, errors, folder)
        if resolved is None:
            continue
        given = folder / Path(value).expanduser()
        root = next((x for x in [*roots, *implicit] if _inside(resolved, x)), None)
        if root is None:
            via = "" if value == str(resolved) else f" (given as {value}"
            if via and resolved != Path(os.path.abspath(given)):
                via += ", through a symlink"
            via += ")" if via else ""
            errors.append(
                f"{where}: {resolved}{via} is outside the folders a recipe may read from: the "
                f"recipe's folder, the current directory, the workspace and run.allowed_paths "
                f"({', '.join(str(x) for x in [*implicit, *roots])}); add its folder to "
                "run.allowed_paths to allow it"
            )
            continue
        if root in implicit and root not in needed and not any(_inside(root, x) for x in roots):
            needed.append(root)
        _set(r, where, str(resolved))
    return needed


def rebase_paths(recipe: Recipe, origins: Origins, root: Path) -> Recipe:
    """A copy whose relative workspace and input paths are relative to `root` instead of the
    folders of the recipe files that wrote them: the recipe of a deployment that runs in `root`
    (prefect.yaml), where relative paths mean its working directory."""
    r = recipe.model_copy(deep=True)

    def base(where: str) -> Path:
        return origins.folder(where) or root

    def moved(where: str, value: str) -> str:
        if value.startswith("~") or Path(value).is_absolute():
            return value
        return os.path.relpath(os.path.normpath(base(where) / value), root)

    r.run.workspace = moved("run.workspace", r.run.workspace)
    for where, value in input_paths(r, base).items():
        _set(r, where, moved(where, value))
    return r


def section_batch(recipe: Recipe, name: str) -> ResolvedBatch:
    """The resolved batch triple of graph stage `name`."""
    return stage_batch(recipe.graph().get(name), recipe.infra.dp_size())


def _extends_hint(line: str) -> str:
    """An error that merging made likelier, with the hint: a recipe that extends one with
    synthetic data and names its own file keeps the inherited `synthetic:` too."""
    if line.endswith("give exactly one of data.path or data.synthetic"):
        return line + (
            " (one of them may come from the recipe this one extends: set the other to null, "
            "e.g. synthetic: null)"
        )
    return line


def load_recipe(path: str | os.PathLike[str], overrides: list[str] | None = None) -> ResolvedRecipe:
    """Read (with what it `extends`), override, validate and resolve a recipe file. Raises
    RecipeError listing every problem. Relative paths: see `resolve_paths`."""
    return _load(path, overrides, resolve)


def load_for_deployment(path: str | os.PathLike[str], overrides: list[str] | None = None) -> Recipe:
    """`load_recipe` with its paths resolved only (`resolve_paths`): a served deployment's
    recipe, whose devices the machine that runs it resolves (`posttrain serve`, `submit`)."""
    return _load(path, overrides, resolve_paths)


def _load(path: str | os.PathLike[str], overrides: list[str] | None, finish: Callable[..., R]) -> R:
    from posttrain.config.extends import read_recipe

    data, origins = read_recipe(path)
    data = apply_overrides(data, overrides or [])
    origins.mark_overrides(overrides or [])
    try:
        recipe = validate_recipe(data, str(path))
    except RecipeError as exc:
        if "extends" in read_yaml(path):
            exc.errors = [_extends_hint(line) for line in exc.errors]
        raise
    try:
        return finish(recipe, Path(path).resolve().parent, origins=origins)
    except RecipeError as exc:
        raise RecipeError(exc.errors, str(path), exc.fix) from None
