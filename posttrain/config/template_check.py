"""Does the chat template support what the recipe needs: tool calls (tool-use SFT rows, agentic
rollouts), a system turn (rows that have one), a generation prompt (online RL's rollouts)?

Checked with the functions ingest and the stages run (`format_of_template`, `template_info`,
`check_system_role`, `render`). A local base's tokenizer is loaded (no weights); a built
(`from_config`) base's template text is known without one, so tool calls are checked on it and
the rest at ingest; a hub base is checked at ingest.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from posttrain.agents.tool_calls import format_of_template
from posttrain.config.schema import Recipe
from posttrain.data.chat import TemplateError, read_template
from posttrain.data.tool_rows import has_tools

NO_TOOLS = (
    "the chat template renders no tool calls; set ingest.chat_template to one that does "
    "(hermes <tool_call>, Llama 3.1 JSON, Mistral [TOOL_CALLS]) or, for a built base, "
    "ingest.from_config.template: chatml_tools"
)


def _messages(row: dict[str, Any]) -> list[dict[str, Any]]:
    # A checked row of any shape: SFT/prompt rows have messages, pair/unpaired rows a prompt.
    if isinstance(row, list):  # an unpaired source row: its labelled rows share the prompt
        return row[0]["prompt"] if row else []
    return row.get("messages") or row.get("prompt") or []


def _template_text(recipe: Recipe, tok: Any, report: Any) -> str | None:
    from posttrain.models.chatml import TEMPLATES

    ingest = recipe.ingest
    if ingest.chat_template:
        try:
            return read_template(ingest.chat_template, "ingest.chat_template")[0]
        except TemplateError as exc:
            report.problems.append(str(exc))
            return None
    if tok is not None:
        return tok.chat_template
    return TEMPLATES[ingest.from_config.template] if ingest.source == "from_config" else None


def _tokenizer(folder: Path, report: Any) -> Any:
    from posttrain.models.loading import load_tokenizer

    try:
        return load_tokenizer(folder)
    except Exception as exc:  # no or broken tokenizer files: transformers' many errors
        report.problems.append(f"ingest.path: {folder}: no usable tokenizer ({exc})")
        return None


def check_template(
    recipe: Recipe, folder: Path | None, peeks: dict[str, Any], tools: set[str], report: Any
) -> None:
    """Problems and one line for the template the stages will format with. `folder`: a local
    base's folder (None: not checkable now); `peeks`: {stage field path: its DataPeek};
    `tools`: stages whose rollouts give the model tools."""
    tok = _tokenizer(folder, report) if folder is not None else None
    if folder is not None and tok is None:
        return
    text = _template_text(recipe, tok, report)
    if text is None:
        if tok is not None and not recipe.ingest.chat_template:
            report.problems.append(
                f"ingest.chat_template: the tokenizer of {folder} has no chat template; set one"
            )
        return
    rows = {w: p.rows for w, p in peeks.items()}
    need_tools = {f"{w}.rollout.tools" for w in tools} | {
        f"{w}.data"
        for w, located in rows.items()
        if any(isinstance(r, dict) and "messages" in r and has_tools(r) for _, r in located)
    }
    fmt = format_of_template(text)
    if fmt is None:
        report.problems += [f"{where}: {NO_TOOLS}" for where in sorted(need_tools)]
    if tok is None:
        return
    tok.chat_template = text
    _render_checks(tok, rows, tools, report, fmt, folder)


def _render_checks(
    tok: Any,
    rows: dict[str, list[tuple[str, Any]]],
    tools: set[str],
    report: Any,
    fmt: str | None,
    folder: Path | None,
) -> None:
    from posttrain.data.chat import check_system_role, render, template_info

    try:
        info = template_info(tok)
    except TemplateError as exc:
        report.problems.append(f"ingest.chat_template: {exc}")
        return
    for where, located in rows.items():
        try:
            check_system_role(tok, [(w, _messages(r)) for w, r in located])
        except TemplateError as exc:
            report.problems.append(f"{where}.data: {exc}")
    user = [{"role": "user", "content": "hi"}]
    opens_reply = render(tok, user, True) != render(tok, user, False)
    if not opens_reply:
        for where in sorted({w for w in rows if rows[w] and "columns" in rows[w][0][1]} | tools):
            report.problems.append(
                f"{where}: the chat template writes nothing for add_generation_prompt, so "
                "rollouts would start without the assistant's header; use a template that does"
            )
    report.lines.append(
        f"chat template of {folder}: {info.strategy} strategy, system turn "
        f"{'accepted' if info.system_role else 'refused'}, tool calls {fmt or 'none'}, "
        f"generation prompt {'ok' if opens_reply else 'missing'}"
    )
