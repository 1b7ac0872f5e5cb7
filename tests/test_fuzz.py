"""Property tests over hostile input: whatever a recipe, an override or a data line holds, the
outcome is a value or the project's own error with a message (RecipeError, DataError), never
another exception from deep inside a parser, validator or checker."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from posttrain.config.loader import (
    RecipeError,
    apply_overrides,
    load_recipe,
    resolve,
    validate_recipe,
)
from posttrain.config.schema import Recipe
from posttrain.data.loading import DataError, check_sft_row, parse_json_line, read_rows
from posttrain.data.preference import check_preference_row
from posttrain.data.prompts import check_prompt_row

# 200 examples per property keeps the file near 15 s; POSTTRAIN_FUZZ_EXAMPLES=5000 hunts longer.
FUZZ = settings(
    max_examples=int(os.environ.get("POSTTRAIN_FUZZ_EXAMPLES", "200")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

# Scalars as JSON, YAML and the Prefect form can deliver them.
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=30)
    | st.sampled_from(["auto", "cpu", "fp16", "path", "from_config", "~nosuchuser/x", "a\0b"])
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4)
    ),
    max_leaves=16,
)

BASE: dict[str, Any] = {
    "run": {"name": "fuzz", "workspace": "/tmp/posttrain-fuzz-ws", "seed": 0},
    "infra": {"device": "cpu", "devices_per_node": 1, "precision": "fp32"},
    "ingest": {"source": "from_config", "from_config": {"hidden_size": 64, "num_heads": 4}},
    "sft": {
        "data": {"synthetic": {"n_examples": 20}, "max_seq_len": 64},
        "batch": {"micro_batch_size": 4, "grad_accum_steps": 1},
        "optim": {"lr": 1e-3},
    },
    "reward": {"data": {"synthetic": {}}},
    "evaluate": {"sampling": [{"name": "greedy", "strategy": "greedy"}]},
    "schedule": {"cron": "0 3 * * *", "timezone": "UTC"},
}


def _paths(node: Any, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out = [prefix] if prefix else []
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, (*prefix, k))
    return out


# Known field paths (to reach the validators behind them), plus names of other fields.
FIELDS = _paths(BASE) + [
    ("run", "allowed_paths"),
    ("ingest", "path"),
    ("ingest", "source"),
    ("sft", "data", "path"),
    ("sft", "data", "eval_path"),
    ("sft", "lora", "target_modules"),
    ("infra", "nnodes"),
    ("infra", "rdzv_endpoint"),
    ("dpo",),
    ("ppo",),
    ("grpo",),
    ("promotion", "rules"),
    ("schedule", "interval_s"),
]


def _set(data: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    node = data
    for part in path[:-1]:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[path[-1]] = value


@st.composite
def mutated_recipes(draw: st.DrawFn) -> dict[str, Any]:
    data = copy.deepcopy(BASE)
    for _ in range(draw(st.integers(1, 4))):
        _set(data, draw(st.sampled_from(FIELDS)), draw(json_values))
    return data


def _recipe_error(exc: RecipeError) -> None:
    assert exc.errors and all(isinstance(e, str) and e for e in exc.errors)
    assert str(exc)


@FUZZ
@given(mutated_recipes())
def test_validate_and_resolve_mutated_recipes(data: dict[str, Any]) -> None:
    try:
        recipe = validate_recipe(data)
    except RecipeError as exc:
        _recipe_error(exc)
        return
    assert isinstance(recipe, Recipe)
    try:
        resolve(recipe)
    except RecipeError as exc:
        _recipe_error(exc)


@FUZZ
@given(st.dictionaries(st.text(max_size=10) | st.sampled_from(list(BASE)), json_values, max_size=6))
def test_validate_arbitrary_dicts(data: dict[str, Any]) -> None:
    try:
        validate_recipe(data)
    except RecipeError as exc:
        _recipe_error(exc)


keys = st.lists(
    st.sampled_from(["run", "infra", "sft", "data", "path", "optim", "lr", "x", ""])
    | st.text(max_size=6),
    min_size=1,
    max_size=4,
).map(".".join)
override_values = st.text(max_size=40) | st.sampled_from(
    ["[", "{a: [1, 2", "2023-02-30", "!!binary x", "!!python/object:os.system x", "1e-4", "nan",
     "[" * 3000, "&a [*a]", "~", "null", "a: b: c", "'unterminated", "\t- a"]
)  # fmt: skip
overrides = st.builds(lambda k, v: f"{k}={v}", keys, override_values) | st.text(max_size=30)


@FUZZ
@given(st.lists(overrides, max_size=4))
def test_overrides(items: list[str]) -> None:
    try:
        data = apply_overrides(BASE, items)
    except RecipeError as exc:
        _recipe_error(exc)
        return
    try:
        validate_recipe(data)
    except RecipeError as exc:
        _recipe_error(exc)


yaml_text = st.text(max_size=200) | st.builds(
    lambda parts: "\n".join(parts),
    st.lists(
        st.sampled_from(
            ["run:", "  name: x", "  seed: 2023-02-30", "sft:", "  data: [", "- a", "? [a, b]\n: c",
             "ingest: {source: path, path: /etc}", "a: &x [*x]", "!!set {a, b}", "\t", "'", "---",
             "infra: {device: cpu, devices_per_node: 1}", "schedule: {timezone: " + "a" * 300 + "}"]
        ),
        max_size=8,
    ),
)  # fmt: skip


@FUZZ
@given(
    st.one_of(yaml_text.map(lambda t: t.encode("utf-8", "surrogatepass")), st.binary(max_size=200))
)
def test_recipe_files(content: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "recipe.yaml"
        path.write_bytes(content)
        try:
            load_recipe(path)
        except RecipeError as exc:
            _recipe_error(exc)


ROLES = st.sampled_from(["system", "user", "assistant", "bot", "", None, 3])
message = st.fixed_dictionaries(
    {"role": ROLES, "content": st.text(max_size=10) | json_values}, optional={"extra": json_values}
)
messages = st.lists(message | json_values, max_size=4)
row_fields = st.sampled_from(["messages", "prompt", "completion", "chosen", "rejected"])
rows = (
    st.dictionaries(row_fields, messages | st.text(max_size=10) | json_values, max_size=5)
    | json_values
)
CHECKERS = (check_sft_row, check_preference_row, check_prompt_row)


@FUZZ
@given(rows)
def test_row_checkers(row: Any) -> None:
    for check in CHECKERS:
        try:
            out = check(row, "data.jsonl:7")
        except DataError as exc:
            assert str(exc).startswith("data.jsonl:7: ") and len(str(exc)) > len("data.jsonl:7: ")
            continue
        json.dumps(out)  # a checked row is plain JSON of strings, lists and dicts


@FUZZ
@given(st.binary(max_size=300) | json_values.map(lambda v: json.dumps(v).encode()))
def test_json_lines(raw: bytes) -> None:
    try:
        value = parse_json_line(raw, "rows.jsonl:3")
    except DataError as exc:
        assert str(exc).startswith("rows.jsonl:3: ")
        return
    assume(value is not None)
    for check in CHECKERS:
        with contextlib.suppress(DataError):
            check(value, "rows.jsonl:3")


@FUZZ
@given(st.lists(st.binary(max_size=60), max_size=6), st.sampled_from([".jsonl", ".json"]))
def test_data_files(lines: list[bytes], suffix: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"rows{suffix}"
        path.write_bytes(b"\n".join(lines))
        try:
            rows = read_rows(path, max_line_bytes=40)
        except DataError as exc:
            assert str(exc).startswith(str(path))
            return
        assert rows


LAUGHS = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{b}: &{b} [{', '.join([f'*{a}'] * 10)}]\n"
    for a, b in zip("abcdefgh", "bcdefghi", strict=True)
)


def test_what_fuzzing_found_is_refused_by_name(tmp_path: Path) -> None:
    """Each of these once escaped as RecursionError, ValueError, RuntimeError or OSError."""
    cases = {
        "run.name=&a [*a]": "run.name: nested more than 64 levels deep",
        "run.name=" + "[" * 3000: "run.name: cannot parse value",
        "run.seed=2023-02-30": "run.seed: cannot parse value",
    }
    for item, message in cases.items():
        try:
            apply_overrides(BASE, [item])
        except RecipeError as exc:
            assert exc.errors[0].startswith(message), exc.errors
        else:
            raise AssertionError(item)
    files = {
        "laughs.yaml": (LAUGHS.encode(), "more than 100000 values once YAML aliases are expanded"),
        "latin1.yaml": (b"run: {name: caf\xe9}", "not UTF-8 text"),
        "date.yaml": (b"run: {seed: 2023-02-30}", "not valid YAML: ValueError"),
    }
    for name, (content, message) in files.items():
        (tmp_path / name).write_bytes(content)
        try:
            load_recipe(tmp_path / name)
        except RecipeError as exc:
            assert message in exc.errors[0], exc.errors
        else:
            raise AssertionError(name)
    fields = {
        ("run", "workspace"): ("~nosuchuser-posttrain/ws", "run.workspace: '~nosuchuser-posttrain"),
        ("sft", "data", "eval_path"): (
            "a\0b",
            "sft.data.eval_path: 'a\\x00b' is not a usable path",
        ),
        ("schedule", "timezone"): ("Europe/" + "a" * 300, "schedule.timezone: unknown time zone"),
    }
    for path, (value, message) in fields.items():
        data = copy.deepcopy(BASE)
        _set(data, path, value)
        try:
            resolve(validate_recipe(data))
        except RecipeError as exc:
            assert any(e.startswith(message) for e in exc.errors), exc.errors
        else:
            raise AssertionError(path)
