"""docs/migrating.md's worked examples are real recipes: each loads through the real loader
(hub ids resolved from a hand-built offline cache, tests/hub_cache.py), so the page cannot rot."""

from __future__ import annotations

from pathlib import Path

import pytest

from posttrain.config.loader import load_recipe
from tests.hub_cache import cache_recipe_hub_ids

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "docs" / "examples").glob("*.yaml"))


def test_there_is_one_example_per_peer() -> None:
    names = {p.name for p in EXAMPLES}
    assert {"from-trl.yaml", "from-axolotl.yaml", "from-llamafactory.yaml"} <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_each_worked_example_loads_and_is_linked_from_the_page(
    path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    cache_recipe_hub_ids(path, tmp_path)
    recipe = load_recipe(path)
    assert recipe.graph().names() == ["sft", "dpo"]  # SFT then DPO, as on the page
    assert path.read_text().startswith("#"), "an example needs a header saying how to run it"
    assert f"examples/{path.name}" in (ROOT / "docs" / "migrating.md").read_text()
