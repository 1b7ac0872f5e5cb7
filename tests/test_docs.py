"""Docs that are generated from code must match the code."""

from pathlib import Path

from posttrain.config.docs import render

ROOT = Path(__file__).resolve().parents[1]


def test_recipe_reference_is_current() -> None:
    committed = (ROOT / "docs" / "recipes.md").read_text()
    assert committed == render(), "regenerate: python -m posttrain.config.docs > docs/recipes.md"


def test_reference_documents_every_field() -> None:
    text = render()
    for key in (
        "`micro_batch_size`",
        "`precision`",
        "`max_seq_len`",
        "`target_modules`",
        "`logits_atol`",
        "`top_p`",
    ):
        assert key in text
    assert "| `lr` | float | `0.001` | > 0 |" in text


def test_readme_commands_exist() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "bash scripts/dev.sh quickstart" in readme and "bash scripts/dev.sh test" in readme
    ci = (ROOT / ".ci" / "run").read_text()
    assert "scripts/dev.sh test" in ci


def test_prefect_yaml_is_current() -> None:
    from flows.prefect_yaml import render as render_prefect_yaml

    recipes = [str(p) for p in (ROOT / "recipes").glob("*.yaml")]
    assert (ROOT / "prefect.yaml").read_text() == render_prefect_yaml(recipes), (
        "regenerate: python -m flows.prefect_yaml recipes/*.yaml > prefect.yaml"
    )
