"""Check every input of a resolved recipe without training: what `posttrain validate` and
`posttrain plan` print under their verdict line.

- model: `ingest.path` exists and is a Hugging Face model folder (config.json), or a hub id
  that resolves (`loader.hub_id_errors` ran at load); weights are never loaded.
- data: the first rows of every data file, read and checked by the stage's own reader and row
  check (`posttrain.data.peek`), their shape named per section; with `--full` every row
  (`posttrain.data.scan`), then tokenized as the stage will (`posttrain.config.full_check`).
- code: every reward function, tool, environment and verifier imported by name, as the stage
  imports it, and its signature held against the call posttrain makes.
- chat template: a local base's tokenizer, with the recipe's template installed, checked by the
  functions ingest and the stages use (strategy, system turn, tool calls, generation prompt).

Each check reuses what the stage runs, so validate and the stage cannot disagree. Problems are
`field.path: message` lines; section lines say what was found.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posttrain.config.loader import code_refs
from posttrain.config.schema import Recipe
from posttrain.hub import is_hub_id


@dataclass
class InputReport:
    lines: list[str] = field(default_factory=list)  # what each input is, per section
    problems: list[str] = field(default_factory=list)  # `field.path: message`


def model_folder_problem(path: str) -> str | None:
    """Why local folder `path` is no base model (None: it has a config.json). A missing folder
    and a folder without config.json are told apart: the fixes differ."""
    folder = Path(path).expanduser()
    if not folder.exists():
        return f"{folder} does not exist"
    if not (folder / "config.json").is_file():
        return f"{folder} exists but is not a Hugging Face model folder (no config.json)"
    return None


def _check_model(ingest: Any, where: str, report: InputReport) -> Path | None:
    """A base's line (or problem); its folder when its tokenizer can be checked now.
    `ingest`: its section, `where`: its field path (`ingest`, `stages.<name>`)."""
    if ingest.source == "from_config":
        c = ingest.from_config
        report.lines.append(
            f"{where}: from_config ({c.architecture}, {c.num_layers} blocks, hidden "
            f"{c.hidden_size}, vocab {c.vocab_size}); tokenizer and chat template "
            f"({'recipe text' if ingest.chat_template else c.template}) built and checked at "
            "ingest"
        )
        return None
    path = str(ingest.path)
    if is_hub_id(path):
        report.lines.append(
            f"{where}.path: {path}@{ingest.revision}: hub model (resolves); tokenizer and chat "
            "template checked at ingest"
        )
        return None
    if problem := model_folder_problem(path):
        report.problems.append(f"{where}.path: {problem}")
        return None
    config = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    weights = sorted(p.name for p in Path(path).glob("*.safetensors"))
    report.lines.append(
        f"{where}.path: {path}: {config.get('model_type', '?')} model folder (config.json, "
        f"{len(weights)} safetensors file{'s' * (len(weights) != 1)}; weights not loaded)"
    )
    return Path(path)


def check_inputs(
    recipe: Recipe, head: int | None = None, ingested: dict[str, Path] | None = None
) -> InputReport:
    """Every input of resolved `recipe`, checked; `head`: rows read per data file (default
    `posttrain.data.peek.HEAD`). `ingested` given: the full check (`--full`), every row read
    and tokenized, with per base name the saved tokenizer folder of its complete ingest
    artifact (`posttrain.config.full_check`)."""
    from posttrain.config.code_check import check_code
    from posttrain.config.judge_check import check_judges
    from posttrain.config.template_check import check_template
    from posttrain.data.peek import HEAD, peek_data
    from posttrain.data.scan import scan_data

    report = InputReport()
    bases = recipe.graph().bases.values()
    # The default base's folder: its tokenizer's template is checked against the data.
    folder, *_ = [_check_model(b.section, b.where, report) for b in bases]
    peeks = {}
    for s in recipe.graph():
        if s.kind.data == "none":
            continue
        if ingested is None:
            peek = peek_data(s.where, s.kind.data, s.section.data, head or HEAD)
        else:
            peek = scan_data(s.where, s.kind.data, s.section.data)
        peeks[s.where] = peek
        report.lines += peek.lines
        report.problems += peek.problems
    needs_tools = check_code(recipe, code_refs(recipe), peeks, report)
    check_judges(recipe, peeks, report)
    check_template(recipe, folder, peeks, needs_tools, report)
    if ingested is not None:
        from posttrain.config.full_check import check_full

        check_full(recipe, peeks, ingested, report)
    # The full check may find again what the template check found (one row, one template).
    report.problems = list(dict.fromkeys(report.problems))
    return report


def stage_data_problems(recipe: Recipe, stage: str) -> list[str]:
    """Data paths of graph stage `stage` that name nothing: what the stage refuses first."""
    from posttrain.data.peek import missing_paths

    graph = recipe.graph()
    if stage not in graph:
        return []
    node = graph.get(stage)
    data = getattr(node.section, "data", None)
    return missing_paths(node.where, data) if data is not None else []
