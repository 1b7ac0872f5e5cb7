"""One pydantic error as the message a recipe's author can act on: what was expected in plain
words (no internal class names), the value found (short, never a secret-looking one), and the
field or choice probably meant (`posttrain.config.field_hints`).

    sft.optim.learning_rate: unknown field; did you mean sft.optim.lr?
    sft.lora: expected a mapping of lora settings (r, alpha, dropout, ...), got 16
    dpo.loss: expected one of: sigmoid, ipo, robust, hinge, simpo; got 'sigmod'; did you mean sigmoid?
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Sequence
from typing import Any

from posttrain.config.field_hints import CUTOFF, keys_of, link_hint, model_at, suggestion
from posttrain.secrets import find_secrets

# An echoed value is cut to this many characters: enough to recognise, never a wall.
MAX_SHOWN = 60

# pydantic error type -> what was expected, in the recipe's words.
EXPECTED = {
    "int_type": "a whole number",
    "int_parsing": "a whole number",
    "int_from_float": "a whole number",
    "float_type": "a number",
    "float_parsing": "a number",
    "bool_type": "true or false",
    "bool_parsing": "true or false",
    "string_type": "text",
    "list_type": "a list",
    "tuple_type": "a list",
    "dict_type": "a mapping (key: value lines)",
}
BOUNDS = {
    "greater_than": ("gt", ">"),
    "greater_than_equal": ("ge", ">="),
    "less_than": ("lt", "<"),
    "less_than_equal": ("le", "<="),
}


def shown(value: Any, key: Any = "value") -> str | None:
    """`value` as an error may echo it: short, and None for anything secret-looking."""
    if find_secrets({str(key): value}):
        return None
    text = repr(value) if isinstance(value, str) else _plain_repr(value)
    return text if len(text) <= MAX_SHOWN else text[: MAX_SHOWN - 3] + "..."


def _plain_repr(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value)


def _choices(expected: str) -> list[str]:
    """pydantic's `'a', 'b' or 'c'` as ['a', 'b', 'c']."""
    quoted = re.findall(r"'((?:[^'\\]|\\.)*)'", expected)
    return quoted or [x.strip() for x in re.split(r",| or ", expected) if x.strip()]


def _one_of(choices: list[str], value: Any, got: str | None) -> str:
    msg = f"expected one of: {', '.join(choices)}"
    if got is None:
        return msg
    msg += f"; got {got}"
    if isinstance(value, str):
        close = difflib.get_close_matches(value, choices, n=1, cutoff=CUTOFF)
        if close:
            msg += f"; did you mean {close[0]}?"
    return msg


def _unknown(loc: Sequence[Any], value: Any, path_of: Callable[[Sequence[Any]], str]) -> str:
    key, place = loc[-1], tuple(loc[:-1])
    what = "unknown section" if not place else "unknown field"
    if hint := link_hint(str(key), place, value):
        return f"{what}; {hint}"
    if target := suggestion(str(key), place, path_of):
        return f"{what}; did you mean {target}?"
    return f"{what} (check the spelling; docs/recipes.md lists every field)"


def _mapping(loc: Sequence[Any]) -> str:
    """`a mapping of lora settings (r, alpha, dropout, ...)` for the section at `loc`."""
    model = model_at(loc)
    keys = keys_of(model) if model is not None else []
    listed = ", ".join(keys[:3]) + (", ..." if len(keys) > 3 else "")
    name = loc[-1] if loc and isinstance(loc[-1], str) else None
    what = f"a mapping of {name} settings" if name else "a mapping of settings"
    return f"{what} ({listed})" if listed else what


def describe(e: dict[str, Any], path_of: Callable[[Sequence[Any]], str]) -> str:
    """The message (without its field path) for pydantic error `e`."""
    kind, loc, value = e["type"], tuple(e["loc"]), e.get("input")
    ctx = e.get("ctx") or {}
    got = shown(value, loc[-1] if loc else "value")
    tail = f", got {got}" if got is not None else ""
    if kind == "extra_forbidden":
        return _unknown(loc, value, path_of)
    if kind == "missing":
        return "required field is missing"
    if kind in ("model_type", "model_attributes_type", "dataclass_type"):
        return f"expected {_mapping(loc)}{tail}"
    if kind == "literal_error":
        return _one_of(_choices(str(ctx.get("expected", ""))), value, got)
    if kind == "union_tag_invalid":
        tag = ctx.get("tag")
        return _one_of(_choices(str(ctx.get("expected_tags", ""))), tag, repr(tag))
    if kind == "union_tag_not_found":
        return "required, one of: " + ", ".join(_choices(str(ctx.get("expected_tags", ""))))
    if kind in EXPECTED:
        return f"expected {EXPECTED[kind]}{tail}"
    if kind in BOUNDS:
        key, sign = BOUNDS[kind]
        bound = ctx.get(key)
        return f"must be {sign} {f'{bound:g}' if isinstance(bound, float) else bound}{tail}"
    msg = str(e["msg"]).removeprefix("Value error, ")
    if kind.startswith(("value_error", "assertion_error")) or got is None:
        return msg
    return f"{msg}{tail}"
