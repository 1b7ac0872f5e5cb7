"""Docs that are generated from code must match the code."""

import re
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


def test_a_constrained_member_of_a_union_reads_as_its_type_and_limit() -> None:
    # `Annotated[int, Field(ge=1)] | Literal["auto"]`: the int's constraint goes to the limits
    # column; pydantic's repr of the FieldInfo (`annotation=NoneType required=True ...`) never
    # reaches the page.
    text = render()
    assert '| `parallel_stages` | int \\| `auto` | `"auto"` | >= 1 | no |' in text
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    leaked = [r for r in rows if re.search(r"annotation=|metadata=|FieldInfo|Annotated", r)]
    assert leaked == []


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


def _code_units() -> set[str]:
    """Every package folder and top-level module of posttrain/ and flows/ (what the
    architecture's folder table names)."""
    units = set()
    for layer in ("posttrain", "flows"):
        for p in (ROOT / layer).iterdir():
            if p.is_dir() and (p / "__init__.py").exists():
                units.add(f"{layer}/{p.name}/")
            elif p.suffix == ".py" and p.name != "__init__.py":
                units.add(f"{layer}/{p.name}")
    return units


def test_the_architecture_folder_table_matches_the_tree() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    table = text.split("## Where the code lives", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"^\| `((?:posttrain|flows)/[^`]*)` \|", table, re.MULTILINE))
    tree = _code_units()
    assert not tree - named, f"in the tree, not in docs/architecture.md: {sorted(tree - named)}"
    assert not named - tree, f"in docs/architecture.md, not in the tree: {sorted(named - tree)}"


def test_docs_name_only_modules_that_exist() -> None:
    """Every `posttrain/...py` or `flows/...py` path the docs mention is a file of the tree."""
    missing = []
    for doc in [*(ROOT / "docs").glob("*.md"), ROOT / "README.md"]:
        for path in set(re.findall(r"\b((?:posttrain|flows)/[\w/]+\.py)\b", doc.read_text())):
            if not (ROOT / path).is_file():
                missing.append(f"{doc.name}: {path}")
    assert not missing, missing


def test_the_monitoring_section_lists_every_exported_series_and_alert() -> None:
    from flows.trackers.prom_names import BY_NAME

    text = (ROOT / "docs" / "monitoring.md").read_text()
    listed = set(re.findall(r"^\| `(posttrain_\w+)` \|", text, re.MULTILINE))
    assert listed == set(BY_NAME), set(BY_NAME) ^ listed
    rules = (ROOT / "docs" / "monitoring" / "alerts.yml").read_text()
    alerts = set(re.findall(r"- alert: (\w+)", rules))
    documented = set(re.findall(r"^\| `(Posttrain\w+)` \|", text, re.MULTILINE))
    assert alerts and alerts == documented, alerts ^ documented
