"""Read every row of a stage's data, as `posttrain validate --full` does: each file to its end
with the stage's own reader (`loading.scan_rows`, the reader `read_rows` uses, read on past a
bad row) and row check (`peek.CHECKS`), every bad row named by file and line (the first LISTED
of a file, then a count), generated rows generated as the stage generates them.

`peek.peek_data` is the default check's quick look at the first rows; this is its full read,
and what it returns is a `DataPeek` too, so the code and template checks read the same rows.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from posttrain.data.errors import DataError
from posttrain.data.loading import DataNotCached, data_source, scan_rows
from posttrain.data.peek import CHECKS, DataPeek, rows_read
from posttrain.data.preference import quickstart_preference_rows, quickstart_unpaired_rows
from posttrain.data.prompts import PROMPT_TASKS
from posttrain.data.row_shape import row_shape
from posttrain.data.sft_data import synthetic_rows

LISTED = 10  # bad rows named per file; the rest are counted: enough to see what is wrong


@dataclass
class FullPeek(DataPeek):
    """Every row of one stage's data, checked."""

    # "path" / "eval_path" -> (where, checked row) of every good row; a source that was not
    # read (a hub dataset the cache does not hold, a file that cannot be read) is absent.
    sources: dict[str, list[tuple[str, Any]]] = field(default_factory=dict)
    generated: list[Any] | None = None  # `synthetic:` rows, as the stage generates them
    read: int = 0  # rows read from files, bad ones included
    seconds: float = 0.0  # spent reading and checking them


def generated_rows(shape: str, cfg: Any) -> list[Any]:
    """The rows `cfg.synthetic` generates for a stage reading `shape` rows, in the form the
    stage uses them (its `read_split` / `read_and_split` generator)."""
    s = cfg.synthetic
    if shape == "messages":
        return synthetic_rows(cfg)
    if shape == "prompts":
        return PROMPT_TASKS[s.task](s.n_examples, s.seed)
    make = quickstart_unpaired_rows if shape == "unpaired" else quickstart_preference_rows
    return make(s.n_examples, s.seed)


def scan_data(where: str, shape: str, cfg: Any) -> FullPeek:
    """Every row of `cfg`'s path and eval_path (a stage's data section at field path
    `<where>.data`, its kind reading `shape` rows), checked as the stage checks them, and its
    generated rows."""
    out = FullPeek()
    if (s := cfg.synthetic) is not None:
        out.generated = generated_rows(shape, cfg)
        task = getattr(s, "task", "quickstart")
        out.lines.append(f"{where}.data: synthetic (task {task}, {s.n_examples} rows, generated)")
        if shape == "prompts":  # their columns, for the reward-function check
            out.rows += [(f"synthetic row {i}", r) for i, r in enumerate(out.generated)]
    for attr in ("path", "eval_path"):
        value = getattr(cfg, attr)
        if value is None:
            continue
        field_path = f"{where}.data.{attr}"
        start = time.perf_counter()
        try:
            line, good = _scan_file(field_path, attr, shape, cfg, out)
        except DataNotCached:
            out.lines.append(
                f"{field_path}: {value}: hub dataset, not in the local cache (rows read when "
                "the stage runs)"
            )
            continue
        except DataError as exc:
            out.problems.append(f"{field_path}: {exc}")
            continue
        finally:
            out.seconds += time.perf_counter() - start
        out.sources[attr] = good
        out.rows += good
        out.lines.append(line)
    return out


def _scan_file(
    field_path: str, attr: str, shape: str, cfg: Any, out: FullPeek
) -> tuple[str, list[tuple[str, Any]]]:
    """(section line, good rows) of one file read to its end; its bad rows are `out`'s
    problems. Under `on_invalid: skip` a bad row the stage would skip is counted, not a
    problem; a line that is not JSON is one in both modes, as at the stage."""
    skip = getattr(cfg, "on_invalid", "error") == "skip"
    good: list[tuple[str, Any]] = []
    bad: list[str] = []
    skipped: Counter[str] = Counter()
    shapes: Counter[str] = Counter()
    read, value = 0, getattr(cfg, attr)
    for where, raw in scan_rows(data_source(cfg, attr)):
        read += 1
        if isinstance(raw, DataError):
            bad.append(str(raw))
            continue
        shapes[row_shape(shape, raw)] += 1
        try:
            good.append((where, CHECKS[shape](raw, where)))
        except DataError as exc:
            reason = getattr(exc, "reason", None)  # a PreferenceDataError's: skip may drop it
            if skip and reason is not None:
                skipped[reason] += 1
            else:
                bad.append(str(exc))
    if not read:
        raise DataError(f"{value}: no rows")
    out.read += read
    out.problems += _listed(field_path, value, bad)
    if skipped and not good:  # the stage's reader refuses a file it skipped every row of
        out.problems.append(f"{field_path}: {value}: no valid row (dropped: {dict(skipped)})")
    renamed = f" (columns renamed: {cfg.columns})" if cfg.columns else ""
    text = f"{field_path}: {value}: {_shapes(shapes.items())}{renamed}, {rows_read(read, None)}"
    text += f": {len(good)} ok"
    if skipped:
        text += f", {sum(skipped.values())} would be skipped ({dict(skipped)})"
    if bad:
        text += f", {len(bad)} bad"
    return text, good


def _listed(field_path: str, value: str, bad: list[str]) -> list[str]:
    """The problem lines for one file's bad rows: the first LISTED, then how many more."""
    lines = [f"{field_path}: {message}" for message in bad[:LISTED]]
    if len(bad) > LISTED:
        more = len(bad) - LISTED
        lines.append(f"{field_path}: {value}: {more} more bad rows not listed ({len(bad)} in all)")
    return lines


def _shapes(counts: Iterable[tuple[str, int]]) -> str:
    """`sharegpt (conversations/from/value)`, or with several shapes each one's row count,
    the commonest first (three at most)."""
    ranked = sorted(counts, key=lambda kv: -kv[1])
    if len(ranked) == 1:
        return ranked[0][0]
    text = " | ".join(f"{name} ({n} rows)" for name, n in ranked[:3])
    return text + (f" | {len(ranked) - 3} more shapes" if len(ranked) > 3 else "")
