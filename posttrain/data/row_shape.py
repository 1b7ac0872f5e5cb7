"""Which of the accepted row shapes a raw row has, in words, for `posttrain validate`.

The readers (`loading.check_sft_row`, `preference.check_preference_row`, ...) accept several
shapes each and say nothing about which one they found; a new user's own file is best checked by
seeing it named (`sharegpt (conversations/from/value)`). The order of the tests is the readers'
own, so the name is the shape the stage will read the row as.
"""

from __future__ import annotations

from typing import Any

from posttrain.data.loading import SFT_SHAPES

# SFT_SHAPES' field names -> how validate prints them.
SFT_NAMES = {
    "messages": "messages (role/content)",
    "conversations": "sharegpt (conversations/from/value)",
    "alpaca": "alpaca (instruction/input/output)",
    "prompt+completion": "prompt/completion",
}


def _sft(row: dict[str, Any]) -> str:
    field = next((f for key, _, f, _ in SFT_SHAPES if row.get(key) is not None), None)
    if field is None:
        return _keys(row)
    name = SFT_NAMES[field]
    if field == "conversations":
        turns = row["conversations"]
        first = turns[0] if isinstance(turns, list) and turns else {}
        if isinstance(first, dict) and "from" not in first and "role" in first:
            name = "sharegpt (conversations/role/content)"
    return name + (" + tools" if row.get("tools") is not None else "")


def _keys(row: dict[str, Any]) -> str:
    return f"unrecognised (keys {', '.join(sorted(row))})"


def _pairs(row: dict[str, Any]) -> str:
    prompt, chosen = row.get("prompt"), row.get("chosen")
    if chosen is None or row.get("rejected") is None:
        return _keys(row)
    if prompt is None:
        return "chosen/rejected (full conversations, implicit prompt)"
    if isinstance(chosen, list):
        return "prompt/chosen/rejected (message lists, UltraFeedback-style)"
    return "prompt/chosen/rejected (text)"


def _unpaired(row: dict[str, Any]) -> str:
    if "completion" in row or "label" in row:
        return "prompt/completion/label"
    return _pairs(row) + ", each pair as two labelled rows"


def _prompts(row: dict[str, Any]) -> str:
    if row.get("prompt") is not None:
        name = "prompt (text)" if isinstance(row["prompt"], str) else "prompt (messages)"
    elif row.get("messages") is not None:
        name = "messages (prompt = up to the last assistant turn)"
    else:
        return _keys(row)
    columns = sorted(k for k in row if k not in ("prompt", "messages"))
    return name + (f", columns {', '.join(columns)}" if columns else "")


SHAPES = {"messages": _sft, "pairs": _pairs, "unpaired": _unpaired, "prompts": _prompts}


def row_shape(data: str, row: Any) -> str:
    """The shape a stage whose kind reads `data` rows ("messages", "pairs", "unpaired",
    "prompts"; posttrain.kinds) reads `row` as; "unknown" for what no reader accepts."""
    if not isinstance(row, dict):
        return "unknown"
    return SHAPES[data](row)
