"""Tools from the recipe's folder: imported under the reward functions' rules, described to
the model by transformers' schema extraction, refused with a line naming what is missing."""

from __future__ import annotations

from pathlib import Path

import pytest

from posttrain.agents.tools import ToolLoadError, load_tools

CALC = '''
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def shout(text):
    return text.upper()


def vague(x: int) -> int:
    return x
'''


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    (tmp_path / "calc.py").write_text(CALC)
    return tmp_path


def test_a_tool_loads_with_its_schema(folder: Path) -> None:
    (tool,) = load_tools(["calc:add"], [folder])
    assert tool.name == "add" and tool.fn(a=2, b=3) == 5 and len(tool.sha256) == 64
    assert tool.schema == {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "description": "The first number."},
                    "b": {"type": "integer", "description": "The second number."},
                },
                "required": ["a", "b"],
            },
            "return": {"type": "integer"},
        },
    }


@pytest.mark.parametrize(
    ("ref", "words"), [("calc:shout", "type hint"), ("calc:vague", "docstring")]
)
def test_a_tool_the_model_cannot_be_told_about_is_refused(
    folder: Path, ref: str, words: str
) -> None:
    with pytest.raises(ToolLoadError) as info:
        load_tools([ref], [folder])
    msg = str(info.value)
    assert msg.startswith(f"{ref}: cannot describe it to the model") and words in msg.lower()


def test_tools_outside_the_allowed_folders_or_twice_are_refused(
    folder: Path, tmp_path_factory
) -> None:
    elsewhere = tmp_path_factory.mktemp("other")
    with pytest.raises(ToolLoadError, match="no module 'calc' in the folders tool code may come"):
        load_tools(["calc:add"], [elsewhere])
    with pytest.raises(ToolLoadError, match="two tools named add"):
        load_tools(["calc:add", f"{folder / 'calc.py'}:add"], [folder])
    with pytest.raises(ToolLoadError, match="has no function 'sub'"):
        load_tools(["calc:sub"], [folder])
