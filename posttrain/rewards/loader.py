"""Find, import and fingerprint the reward functions a recipe names.

Naming a function in a recipe runs its code, so where it may come from is decided here, not by
the recipe: built-ins (`posttrain.rewards.*`) always; anything else only as a file inside the
folders the caller allows (`roots`: the recipe's folder and `run.allowed_paths` for `posttrain
run`; the worker's reward folders for a served run, see `posttrain.config.served_access`). A user module
is imported from its file under a private name, never through `sys.path`, so a recipe cannot
reach an installed package (`os:system`) or shadow one. While it executes, its own folder is on
`sys.path` so it can import its sibling helpers.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from posttrain.sections.rewards import RewardSpec, is_builtin, is_file_ref, split_ref


class RewardLoadError(ValueError):
    """A reward function that cannot be found, is not allowed or is not callable."""


def locate(fn: str, roots: Sequence[Path], what: str = "reward") -> Path:
    """The source file of `fn`'s module: a built-in's own file, else the first of
    `<root>/<a>/<b>.py`, `<root>/<a>/<b>/__init__.py` (for module `a.b`) or the named file,
    symlinks resolved, inside one of `roots`. Imports nothing (a built-in's parent package
    aside). `what` names the code in errors (reward, tool, environment)."""
    module, _ = split_ref(fn)
    if is_builtin(fn):
        return source_file(fn)
    real_roots = [Path(r).expanduser().resolve() for r in roots]
    if is_file_ref(module):
        candidates = [Path(module).expanduser()]
        if not candidates[0].is_absolute():
            candidates = [r / candidates[0] for r in real_roots]
    else:
        rel = Path(*module.split("."))
        candidates = [c for r in real_roots for c in (r / f"{rel}.py", r / rel / "__init__.py")]
    for c in candidates:
        if c.is_file():
            real = c.resolve()
            if any(real == r or real.is_relative_to(r) for r in real_roots):
                return real
            raise RewardLoadError(
                f"{fn}: {real} is outside the folders {what} code may come from "
                f"({_describe(real_roots)})"
            )
    raise RewardLoadError(
        f"{fn}: no module {module!r} in the folders {what} code may come from "
        f"({_describe(real_roots)}); built-ins are posttrain.rewards.<module>:<function>"
    )


def source_file(fn: str) -> Path:
    """The source file of a built-in or an already-resolved (absolute file) reference, for the
    fingerprint: no search, no import of user code."""
    module, _ = split_ref(fn)
    if is_builtin(fn):
        found = importlib.util.find_spec(module)
        if found is None or not found.origin:
            raise RewardLoadError(f"{fn}: no built-in module {module!r}")
        return Path(found.origin)
    return Path(module).expanduser()


def _describe(roots: Sequence[Path]) -> str:
    return ", ".join(str(r) for r in roots) or "none"


def source_sha256(path: Path) -> str:
    """What the fingerprint records of a reward function: its module's source. A package's
    `__init__.py` stands for the package (its other files are the author's to version)."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _import_file(path: Path) -> Any:
    name = f"posttrain_reward_{hashlib.sha256(str(path).encode()).hexdigest()[:12]}"
    if name in sys.modules:
        return sys.modules[name]
    is_pkg = path.name == "__init__.py"
    spec = importlib.util.spec_from_file_location(
        name, path, submodule_search_locations=[str(path.parent)] if is_pkg else None
    )
    if spec is None or spec.loader is None:
        raise RewardLoadError(f"{path}: not an importable Python file")
    module = importlib.util.module_from_spec(spec)
    home = str(path.parent.parent if is_pkg else path.parent)
    sys.path.insert(0, home)  # its sibling helpers, for the import only
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(home)
    return module


def load_function(
    fn: str, roots: Sequence[Path] | None = None, what: str = "reward"
) -> tuple[Callable[..., Any], str]:
    """(the function, its module's source sha256), or a RewardLoadError naming `fn`. `roots`:
    the folders to find a user module in (`locate`); None for a reference a resolved recipe
    already pointed at its file (what a stage process gets)."""
    path = locate(fn, roots, what) if roots is not None else source_file(fn)
    if not path.is_file():
        raise RewardLoadError(f"{fn}: {path} does not exist (moved since the run was planned?)")
    module_name, attr = split_ref(fn)
    try:
        module = importlib.import_module(module_name) if is_builtin(fn) else _import_file(path)
    except RewardLoadError:
        raise
    except Exception as exc:
        raise RewardLoadError(
            f"{fn}: importing {path} failed: {type(exc).__name__}: {exc}"
        ) from exc
    func = getattr(module, attr, None)
    if not callable(func):
        raise RewardLoadError(f"{fn}: {path.name} has no function {attr!r} ({_has(module)})")
    return func, source_sha256(path)


def _has(module: Any) -> str:
    """`it has: a, b` -- the module's own public functions and classes, for a misspelt name."""
    names = sorted(
        n
        for n, v in vars(module).items()
        if not n.startswith("_")
        and callable(v)
        and getattr(v, "__module__", None) == module.__name__
    )
    return f"it has: {', '.join(names)}" if names else "it defines no function"


def bind(spec: RewardSpec, roots: Sequence[Path] | None = None) -> tuple[Callable[..., Any], str]:
    """`spec`'s function with its recipe kwargs bound, and its source sha256 (a function
    entry: a judge entry has no code, `posttrain.rewards.judge`)."""
    if spec.fn is None:
        raise RewardLoadError("a judge entry names no function to import")
    func, sha = load_function(spec.fn, roots)
    return (partial(func, **spec.kwargs) if spec.kwargs else func), sha
