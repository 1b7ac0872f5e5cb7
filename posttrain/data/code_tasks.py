"""The code task: generated requests for a tiny Python function, with tests to run it against.

A row asks, e.g., "Write a function solve(x) that returns x plus 5."; the SFT reply is the
program in a ```python block, and a prompt row carries MBPP-style `test_list` (three asserts
computed from the same spec, so the reference program passes them) for the code verifier
(`posttrain.rewards.code:code_tests`).

A spec is (operation, function name, argument name, constant). The specs are split in two by a
hash of the spec: SFT rows and the warm-up corpus draw only `train` specs, RL prompts only
`fresh` ones, each at most once. So the RL stage's held-out prompts (a seeded split of its
prompts) are combinations neither SFT nor the RL updates saw, every part of which (the
operation, the name, the constant) they did see: pass@1 measures generalisation, not recall.

Names and constants follow a space in the prompt as in the program (`function solve(x)`,
`def solve(x):`; `plus 5`, `x + 5`), so a byte-level BPE gives them the same token in both and
the policy copies a token rather than spelling it.
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass
from typing import Any

from posttrain.data.synthetic import WORDS

FUNC_NAMES = ("solve", "compute", "calc", "helper", "transform", "answer", "process", "apply")
NUM_ARGS = ("x", "n", "num", "value")
TEXT_ARGS = ("s", "text", "word")
LIST_ARGS = ("xs", "nums", "items")
PAIR_ARGS = (("a", "b"), ("x", "y"), ("m", "n"))
CONSTANTS = tuple(range(2, 10))
FRESH_SHARE = 5  # one spec in FRESH_SHARE is `fresh` (RL prompts only)


@dataclass(frozen=True)
class Op:
    """One kind of function: what the prompt asks (`{a}`: the argument, `{b}` the second,
    `{k}`: the constant), the returned expression, and its inputs' kind."""

    ask: str
    expr: str
    kind: str  # "num", "text", "list" or "pair"
    const: bool = False


OPS: dict[str, Op] = {
    "add": Op("returns {a} plus {k}", "{a} + {k}", "num", const=True),
    "sub": Op("returns {a} minus {k}", "{a} - {k}", "num", const=True),
    "mul": Op("returns {a} times {k}", "{a} * {k}", "num", const=True),
    "mod": Op("returns the remainder of {a} divided by {k}", "{a} % {k}", "num", const=True),
    "gt": Op("returns whether {a} is greater than {k}", "{a} > {k}", "num", const=True),
    "repeat": Op("returns {a} repeated {k} times", "{a} * {k}", "text", const=True),
    "square": Op("returns {a} squared", "{a} * {a}", "num"),
    "even": Op("returns whether {a} is even", "{a} % 2 == 0", "num"),
    "max": Op("returns the larger of {a} and {b}", "max({a}, {b})", "pair"),
    "min": Op("returns the smaller of {a} and {b}", "min({a}, {b})", "pair"),
    "reverse": Op("returns {a} reversed", "{a}[::-1]", "text"),
    "upper": Op("returns {a} in upper case", "{a}.upper()", "text"),
    "length": Op("returns the length of {a}", "len({a})", "list"),
    "total": Op("returns the sum of {a}", "sum({a})", "list"),
    "first": Op("returns the first element of {a}", "{a}[0]", "list"),
    "last": Op("returns the last element of {a}", "{a}[-1]", "list"),
}

_ARGS = {"num": NUM_ARGS, "text": TEXT_ARGS, "list": LIST_ARGS, "pair": PAIR_ARGS}


@dataclass(frozen=True)
class Spec:
    op: str
    name: str
    args: tuple[str, ...]
    k: int | None

    @property
    def fresh(self) -> bool:
        """Whether the spec is for RL prompts only (never in SFT rows or the warm-up corpus)."""
        return zlib.crc32(repr(self).encode()) % FRESH_SHARE == 0

    def _fill(self, template: str) -> str:
        b = self.args[1] if len(self.args) > 1 else ""
        return template.format(a=self.args[0], b=b, k=self.k)

    def prompt(self) -> str:
        return (
            f"Write a function {self.name}({', '.join(self.args)}) that "
            f"{self._fill(OPS[self.op].ask)}."
        )

    def program(self) -> str:
        """The reference program (no fence)."""
        expr = self._fill(OPS[self.op].expr)
        return f"def {self.name}({', '.join(self.args)}):\n    return {expr}\n"

    def reply(self) -> str:
        return f"```python\n{self.program()}```"

    def tests(self) -> list[str]:
        """Three asserts, the inputs drawn from the spec (the same in every run); the expected
        values are the reference program's own results."""
        rng = random.Random(zlib.crc32(repr(self).encode()))
        scope: dict[str, Any] = {}
        exec(self.program(), scope)  # our own template, never model output
        out = []
        for inputs in _inputs(self, rng):
            call = f"{self.name}({', '.join(map(repr, inputs))})"
            out.append(f"assert {call} == {scope[self.name](*inputs)!r}")
        return out


def _inputs(spec: Spec, rng: random.Random) -> list[tuple[Any, ...]]:
    """Three argument tuples that tell the operation apart from its neighbours: both parities
    for `even`, the constant itself and one past it for `gt`, unequal pairs for `max`/`min`."""
    kind = OPS[spec.op].kind
    if spec.op == "gt":
        assert spec.k is not None
        return [(spec.k,), (spec.k + 1,), (rng.randint(0, 20),)]
    if spec.op == "even":
        return [(2 * rng.randint(0, 20),), (2 * rng.randint(0, 20) + 1,), (rng.randint(0, 40),)]
    if kind == "num":
        return [(rng.randint(1, 30),) for _ in range(3)]
    if kind == "pair":
        return [tuple(rng.sample(range(0, 30), 2)) for _ in range(3)]
    if kind == "text":
        return [(w,) for w in rng.sample(WORDS, 3)]
    return [(rng.sample(range(1, 20), rng.randint(2, 5)),) for _ in range(3)]


def all_specs() -> list[Spec]:
    """Every spec, in a fixed order."""
    out = []
    for op, o in OPS.items():
        for name in FUNC_NAMES:
            for args in _ARGS[o.kind]:
                arg_tuple = args if isinstance(args, tuple) else (args,)
                for k in CONSTANTS if o.const else (None,):
                    out.append(Spec(op, name, arg_tuple, k))
    return out


def _pool(fresh: bool) -> list[Spec]:
    return [s for s in all_specs() if s.fresh == fresh]


def _draw(n: int, seed: int, fresh: bool) -> list[Spec]:
    """n specs of one side of the split, deterministic in seed. `train` specs are drawn with
    replacement, operations in round-robin (SFT sees every operation as often); `fresh` ones
    without (an RL prompt is never also a held-out prompt), at most all of them."""
    rng = random.Random(seed)
    pool = _pool(fresh)
    if fresh:
        return rng.sample(pool, min(n, len(pool)))
    by_op: dict[str, list[Spec]] = {}
    for s in pool:
        by_op.setdefault(s.op, []).append(s)
    ops = list(OPS)
    return [rng.choice(by_op[ops[i % len(ops)]]) for i in range(n)]


def code_sft_rows(n: int, seed: int) -> list[dict[str, Any]]:
    """n SFT rows {"messages", "task"} of `train` specs: the request and the fenced program."""
    return [
        {
            "messages": [
                {"role": "user", "content": s.prompt()},
                {"role": "assistant", "content": s.reply()},
            ],
            "task": "code",
        }
        for s in _draw(n, seed, fresh=False)
    ]


def code_prompts(n: int, seed: int) -> list[dict[str, Any]]:
    """Up to n prompt rows (`posttrain.data.prompts` shape) of distinct `fresh` specs, with
    their `test_list` (MBPP's column: the code verifier's tests) and `task`."""
    return [
        {
            "messages": [{"role": "user", "content": s.prompt()}],
            "columns": {"test_list": s.tests(), "task": "code"},
        }
        for s in _draw(n, seed, fresh=True)
    ]


def code_corpus(n: int, seed: int) -> list[str]:
    """Plain-text documents of `train` specs for the tokenizer and a from-config warm-up: the
    request and its program, so fences, `def`, indentation and operators get merges and the
    base has seen code before SFT teaches the chat format."""
    return [f"{s.prompt()}\n{s.reply()}" for s in _draw(n, seed, fresh=False)]
