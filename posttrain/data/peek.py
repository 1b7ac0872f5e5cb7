"""Read the first rows of a stage's data with the stage's own reader and row check, and name
their shape: what `posttrain validate` says per data section, without tokenizing or training.

The rows go through the same `read_rows` and the same check function the stage uses
(`CHECKS`, by the kind's data shape), so validate and the stage cannot disagree on a row.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posttrain.data.errors import DataError
from posttrain.data.loading import check_sft_row, data_source, read_rows
from posttrain.data.preference import check_preference_row, check_unpaired_row
from posttrain.data.prompts import PROMPT_TASKS, check_prompt_row
from posttrain.data.row_shape import row_shape
from posttrain.hub import is_hub_id

HEAD = 5  # rows read per file: enough to see the shape and a first bad row, quick on any file

# A kind's data shape (posttrain.kinds) -> the row check its stage applies.
CHECKS: dict[str, Callable[[Any, str], Any]] = {
    "messages": check_sft_row,
    "pairs": check_preference_row,
    "unpaired": check_unpaired_row,
    "prompts": check_prompt_row,
}


@dataclass
class DataPeek:
    """What the first rows of one stage's data showed."""

    lines: list[str] = field(default_factory=list)  # `sft.data.path: /x.jsonl: sharegpt ...`
    problems: list[str] = field(default_factory=list)  # `field.path: message`
    # (where, checked row) pairs: the code and template checks read their columns and turns
    rows: list[tuple[str, Any]] = field(default_factory=list)


def missing_paths(where: str, cfg: Any) -> list[str]:
    """`<where>.data.path: /x does not exist` for each local data path of `cfg` (a data section)
    that names nothing (hub ids are the hub's to resolve): what a stage checks before it loads
    anything, in the words `read_rows` and `peek_data` use."""
    out = []
    for attr in ("path", "eval_path"):
        value = getattr(cfg, attr, None)
        if value and not is_hub_id(value) and not Path(value).expanduser().exists():
            out.append(f"{where}.data.{attr}: {value} does not exist")
    return out


def peek_data(where: str, shape: str, cfg: Any, head: int = HEAD) -> DataPeek:
    """The first `head` rows of `cfg`'s path and eval_path (a stage's data section at field
    path `<where>.data`, its kind reading `shape` rows), checked as the stage checks them."""
    out = DataPeek()
    if (s := cfg.synthetic) is not None:
        task = getattr(s, "task", "quickstart")
        out.lines.append(f"{where}.data: synthetic (task {task}, {s.n_examples} rows)")
        if shape == "prompts":  # generated as the stage generates them: their columns
            rows = PROMPT_TASKS[s.task](s.n_examples, s.seed)[:head]
            out.rows += [(f"synthetic row {i}", r) for i, r in enumerate(rows)]
    for attr in ("path", "eval_path"):
        value = getattr(cfg, attr)
        if value is None:
            continue
        field_path = f"{where}.data.{attr}"
        if is_hub_id(value):
            out.lines.append(f"{field_path}: {value}: hub dataset (rows read when the stage runs)")
            continue
        try:
            located = read_rows(data_source(cfg, attr), head=head)
        except DataError as exc:
            out.problems.append(f"{field_path}: {exc}")
            continue
        out.lines.append(_checked(field_path, value, shape, cfg, located, out, head))
    return out


def rows_read(read: int, head: int | None) -> str:
    """How much of a file a line speaks for: `first 5 rows read (--full reads all)` when the
    check stopped at `head` rows (None: it read on to the end)."""
    if head is not None and read >= head:
        return f"first {read} rows read (--full reads all)"
    return f"all {read} row{'s' * (read != 1)} read"


def _checked(
    field_path: str,
    value: str,
    shape: str,
    cfg: Any,
    located: list[Any],
    out: DataPeek,
    head: int,
) -> str:
    """One section line for rows read from `value`. The first bad row is a problem, as it stops
    the stage; under `on_invalid: skip` bad rows are counted as the stage would skip them."""
    skip = getattr(cfg, "on_invalid", "error") == "skip"
    skipped: Counter[str] = Counter()
    ok = 0
    for where, raw in located:
        try:
            out.rows.append((where, CHECKS[shape](raw, where)))
            ok += 1
        except DataError as exc:
            reason = getattr(exc, "reason", None)  # a PreferenceDataError's: skip may drop it
            if skip and reason is not None:
                skipped[reason] += 1
                continue
            out.problems.append(f"{field_path}: {exc}")
            break
    shapes = list(dict.fromkeys(row_shape(shape, raw) for _, raw in located))
    renamed = f" (columns renamed: {cfg.columns})" if cfg.columns else ""
    read = rows_read(len(located), head)
    text = f"{field_path}: {value}: {' | '.join(shapes)}{renamed}, {read}: {ok} ok"
    if skipped:
        text += f", {sum(skipped.values())} would be skipped ({dict(skipped)})"
    return text
