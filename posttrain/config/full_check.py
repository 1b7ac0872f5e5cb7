"""`posttrain validate --full` (and `plan --full`): after every row of every data file was read
and checked (`posttrain.data.scan`), each stage's rows tokenized as the stage will tokenize them
(`posttrain.data.token_stats`), and the check's speed.

The tokenizer is the one the stages load, chosen per base model:
- its ingest artifact's saved tokenizer, when the workspace holds a complete one for this
  recipe (the chat template ingest installed in it);
- before ingest has run, a local base folder's tokenizer, or a hub base's from the local hub
  cache (never downloaded), with the recipe's `chat_template` installed, as ingest will save it;
- a built base (`from_config`) trains its tokenizer at ingest: its stages' rows are read and
  checked, and tokenized once ingest has run (the check says so and how).
A stage's own `chat_template` (preference and RL stages) is installed over it, as the stage does.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttrain import hub
from posttrain.config.schema import Recipe
from posttrain.data.chat import TemplateError, read_template


@dataclass
class Speed:
    """What the check read and tokenized, and how long each took."""

    read: int = 0
    read_s: float = 0.0
    tokenized: int = 0
    tokenize_s: float = 0.0

    def line(self) -> str:
        """`full check: 12,000 rows read and checked in 0.80 s (6.7 s per 100k rows); ...`."""
        text = "full check: "
        text += (
            self._part(self.read, "read and checked", self.read_s)
            if self.read
            else "no data file read"
        )
        if self.tokenized:
            text += f"; {self._part(self.tokenized, 'tokenized', self.tokenize_s)}"
        return text

    @staticmethod
    def _part(rows: int, done: str, seconds: float) -> str:
        per = f" ({seconds / rows * 1e5:.1f} s per 100k rows)" if rows else ""
        return f"{rows:,} row{'s' * (rows != 1)} {done} in {seconds:.2f} s{per}"


def base_tokenizer(base: Any, ingested: dict[str, Path]) -> tuple[Any, str]:
    """(tokenizer or None, the line that says which it is) for `base` (a base's GraphStage);
    `ingested`: base name -> saved tokenizer folder of its complete ingest artifact."""
    name, section = base.name, base.section
    label = f"tokenizer for the stages on base {name}"
    template = None if name in ingested else section.chat_template
    if name in ingested:
        folder, what = ingested[name], "its ingest artifact's, as the stages load it"
    elif section.source == "from_config":
        return None, (
            f"{label}: trained at ingest (from_config), so rows cannot be tokenized before "
            f"ingest has run; run the recipe `--until {name}` once, then --full again"
        )
    elif hub.is_hub_id(section.path):
        folder = hub.cached_snapshot(section.path, section.revision, "model")
        if folder is None:
            return None, (
                f"{label}: {section.path} is not in the local hub cache (never downloaded "
                "here); rows are tokenized when the stages run"
            )
        what = f"{section.path}@{section.revision} from the local hub cache, as ingest saves it"
    else:
        folder, what = Path(section.path), "the base folder's, as ingest saves it"
    from posttrain.models.loading import load_tokenizer

    try:
        tok = load_tokenizer(folder)
        if template:
            tok.chat_template, _ = read_template(template, f"{base.where}.chat_template")
    except Exception as exc:  # no or broken tokenizer files: transformers' many errors
        return None, f"{label}: {folder}: no usable tokenizer ({type(exc).__name__}: {exc})"
    if not tok.chat_template:
        return None, f"{label}: {folder}: no chat template; rows are not tokenized"
    template_note = " with the recipe's chat_template" if template else ""
    return tok, f"{label}: {folder} ({what}{template_note})"


@contextlib.contextmanager
def stage_template(tok: Any, section: Any, where: str) -> Iterator[Any]:
    """`tok` with the stage's own `chat_template` installed (preference and RL stages may set
    one), the base's restored after. Raises TemplateError for a template file that is not."""
    base_template = tok.chat_template
    if value := getattr(section, "chat_template", None):
        tok.chat_template, _ = read_template(value, f"{where}.chat_template")
    try:
        yield tok
    finally:
        tok.chat_template = base_template


def check_full(
    recipe: Recipe, peeks: dict[str, Any], ingested: dict[str, Path], report: Any
) -> None:
    """Lines and problems of the tokenization of every stage whose rows `peeks` holds (field
    path -> `scan.FullPeek`), then the speed line."""
    from posttrain.data.token_stats import stage_tokens

    graph = recipe.graph()
    speed = Speed(sum(p.read for p in peeks.values()), sum(p.seconds for p in peeks.values()))
    stages = [s for s in graph if s.where in peeks]
    tokenizers = {}
    for base in dict.fromkeys(s.base for s in stages):
        tokenizers[base], line = base_tokenizer(graph.bases[base], ingested)
        report.lines.append(line)
    for s in stages:
        peek, tok = peeks[s.where], tokenizers[s.base]
        if tok is None:
            continue
        if peek.generated is None and "path" not in peek.sources:
            report.lines.append(f"{s.where}: rows not read here, so not tokenized")
            continue
        start = time.perf_counter()
        try:
            with stage_template(tok, s.section, s.where):
                found = stage_tokens(s.where, s.kind.data, s.section, recipe.run.seed, peek, tok)
        except TemplateError as exc:
            report.problems.append(str(exc))
            continue
        speed.tokenize_s += time.perf_counter() - start
        speed.tokenized += found.rows
        report.lines += found.lines
        report.problems += found.problems
        if "teacher" in s.links and s.kind.data == "messages":  # off-policy distillation
            report.lines.append(
                f"{s.where}: its teacher rewrites the training answers when it runs"
            )
    report.lines.append(speed.line())
