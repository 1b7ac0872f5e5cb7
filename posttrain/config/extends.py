"""`extends:` - a recipe built on other recipes, and which file wrote each value.

`extends: base.yaml` (or a list) at the top of a recipe loads the named recipes first (paths
relative to the extending file's folder; they may extend others), deep-merges them in order,
then merges the extending recipe on top. Mappings merge key by key and the later one wins;
anything else, lists included (`stages:`, `evaluate.policies`), is replaced whole; `key: null`
sets the key to null, as if the merged recipe were written out in full. The merged mapping is
all the schema ever sees, so `extends` never reaches a fingerprint.

A relative path means the folder of the file that wrote it (and the current directory when it
came from the command line): `Origins` records that, value by value, for `resolve_paths`.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

from posttrain.config.recipe_file import RecipeError, read_yaml

Key = tuple[str, ...]


class Origins:
    """Which folder each value of a merged recipe came from, by key path.

    A key's folder is that of its longest recorded prefix: `()` is the recipe file's own folder
    (its defaults too), a deeper key what an extended file or an override wrote. None: the
    command line (relative paths there mean the current directory)."""

    def __init__(self, by_key: dict[Key, Path | None] | None = None) -> None:
        self.by_key: dict[Key, Path | None] = dict(by_key or {})

    def folder(self, where: str | Key) -> Path | None:
        """The folder a relative path at field path `where` (`sft.data.path`, or `stages.<name>.
        data.path` for a `stages:` entry) is relative to; None for the command line."""
        key = tuple(where.split(".")) if isinstance(where, str) else where
        for n in range(len(key), -1, -1):
            if key[:n] in self.by_key:
                return self.by_key[key[:n]]
        return None

    def files(self) -> list[Path]:
        """The folders of the recipe files that wrote some value (the command line excluded)."""
        return sorted({f for f in self.by_key.values() if f is not None})

    def set(self, key: Key, folder: Path | None) -> None:
        """`key` (and everything below it) now comes from `folder`."""
        self._clear(key)
        self.by_key[key] = folder

    def take(self, key: Key, other: Origins) -> None:
        """`key` (and everything below it) now comes from where `other` says it does."""
        self._clear(key)
        self.by_key[key] = other.folder(key)
        n = len(key)
        self.by_key.update({k: f for k, f in other.by_key.items() if len(k) > n and k[:n] == key})

    def mark_overrides(self, overrides: list[str]) -> None:
        """Each `key.path=value` override's value comes from the command line."""
        for item in overrides:
            self.set(tuple(item.partition("=")[0].split(".")), None)

    def _clear(self, key: Key) -> None:
        n = len(key)
        for k in [k for k in self.by_key if k[:n] == key]:
            del self.by_key[k]


def deep_merge(
    base: dict[str, Any], over: dict[str, Any], origins: Origins, over_origins: Origins
) -> dict[str, Any]:
    """`over` merged onto `base`: mappings key by key (over wins), anything else replaced.
    Updates `origins` (base's) to say where each replaced value came from."""

    def merge(a: dict[str, Any], b: dict[str, Any], prefix: Key) -> dict[str, Any]:
        out = dict(a)
        for key, value in b.items():
            here = (*prefix, str(key))
            if isinstance(value, dict) and isinstance(out.get(key), dict):
                out[key] = merge(out[key], value, here)
            else:
                out[key] = copy.deepcopy(value)
                origins.take(here, over_origins)
        return out

    return merge(base, over, ())


def _parents(data: dict[str, Any], path: Path, top: Path) -> list[tuple[str, Path]]:
    """(name as written, resolved file) of each recipe `path` extends, in merge order."""
    value = data.pop("extends")
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise RecipeError(
            [f"extends: {value!r} is not a recipe file name or a list of them (in {path})"],
            str(top),
        )
    return [(n, (path.parent / Path(n).expanduser()).resolve()) for n in names]


def _load(path: Path, chain: list[Path], top: Path) -> tuple[dict[str, Any], Origins]:
    data = read_yaml(path)
    origins = Origins()
    if "extends" in data:
        merged: dict[str, Any] = {}
        for name, parent in _parents(data, path, top):
            if parent in chain or parent == path:
                names = [os.path.relpath(p, top.parent) for p in (*chain, path, parent)]
                raise RecipeError([f"extends: cycle {' -> '.join(names)}"], str(top))
            if not parent.is_file():
                raise RecipeError(
                    [f"extends: {name}: no such recipe file (extended by {path})"],
                    str(top),
                    f"correct extends: in {path.name} (a path from that file's folder)",
                )
            parent_data, parent_origins = _load(parent, [*chain, path], top)
            merged = deep_merge(merged, parent_data, origins, parent_origins)
        data = deep_merge(merged, data, origins, Origins({(): path.parent}))
    origins.by_key[()] = path.parent  # what no file wrote (defaults) is this recipe's
    return data, origins


def read_recipe(path: str | os.PathLike[str]) -> tuple[dict[str, Any], Origins]:
    """Recipe file `path` with everything it extends merged in (no `extends` key left), and
    where each value came from. Errors (a missing file, a cycle) are RecipeError lines."""
    if not Path(path).is_file():
        read_yaml(path)  # its own error, naming the file as given: no such recipe file
    top = Path(path).resolve()
    return _load(top, [], top)
