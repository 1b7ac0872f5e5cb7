"""Fingerprints, manifests and the stage plan."""

import json
from pathlib import Path

import pytest
import yaml

from posttrain.config.loader import load_recipe
from posttrain.plan.planner import plan
from posttrain.store.artifacts import fingerprint, verify, write_manifest


def test_fingerprint_depends_on_every_input() -> None:
    base = fingerprint("sft", "1", {"lr": 1}, {"policy": "p"})
    assert base == fingerprint("sft", "1", {"lr": 1}, {"policy": "p"})
    assert (
        len(
            {
                base,
                fingerprint("dpo", "1", {"lr": 1}, {"policy": "p"}),
                fingerprint("sft", "2", {"lr": 1}, {"policy": "p"}),
                fingerprint("sft", "1", {"lr": 2}, {"policy": "p"}),
                fingerprint("sft", "1", {"lr": 1}, {"policy": "q"}),
                # The same parent in another role is another result (a reference, not a start).
                fingerprint("sft", "1", {"lr": 1}, {"reference": "p"}),
            }
        )
        == 6
    )


def test_fingerprint_ignores_key_order() -> None:
    assert fingerprint("s", "1", {"a": 1, "b": 2}, {}) == fingerprint(
        "s", "1", {"b": 2, "a": 1}, {}
    )


def _artifact(tmp_path: Path) -> Path:
    d = tmp_path / "art"
    (d / "sub").mkdir(parents=True)
    (d / "weights.bin").write_bytes(b"\x00" * 100)
    (d / "sub" / "a.txt").write_text("hello")
    (d / "checkpoints").mkdir()
    (d / "checkpoints" / "x").write_text("transient")
    write_manifest(
        d, stage="s", fp="f", parents=["p"], section={"k": 1}, seed=0, summary={"loss": 1.0}
    )
    return d


def test_manifest_lists_files_and_verifies(tmp_path: Path) -> None:
    d = _artifact(tmp_path)
    m = json.loads((d / "manifest.json").read_text())
    assert sorted(m["files"]) == ["sub/a.txt", "weights.bin"]
    assert m["parents"] == ["p"] and m["seed"] == 0
    assert m["summary"] == {"loss": 1.0} and "device" in m
    assert verify(d) == (True, "")
    assert not list(d.glob(".tmp*")), "temp file must be renamed away"


def test_verify_detects_altered_and_missing_files(tmp_path: Path) -> None:
    d = _artifact(tmp_path)
    (d / "checkpoints" / "x").write_text("changed")  # not covered: still fine
    assert verify(d)[0]
    (d / "sub" / "a.txt").write_text("HELLO")
    ok, why = verify(d)
    assert not ok and "sub/a.txt was altered" in why
    (d / "sub" / "a.txt").unlink()
    assert verify(d) == (False, "sub/a.txt is missing")
    (d / "manifest.json").unlink()
    assert not verify(d)[0]


@pytest.fixture()
def recipe_file(tmp_path: Path) -> Path:
    data = yaml.safe_load((Path(__file__).parents[1] / "recipes" / "quickstart.yaml").read_text())
    data["run"]["workspace"] = str(tmp_path / "ws")
    p = tmp_path / "r.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


def _fps(recipe_file: Path, *overrides: str) -> dict[str, str]:
    return {s.name: s.fingerprint for s in plan(load_recipe(recipe_file, list(overrides))).stages}


def test_section_change_moves_only_downstream(recipe_file: Path) -> None:
    base = _fps(recipe_file)
    assert list(base) == ["ingest", "sft", "reward", "dpo", "evaluate", "export"]
    sft = _fps(recipe_file, "sft.optim.lr=1e-4")
    assert sft["ingest"] == base["ingest"]
    assert all(sft[s] != base[s] for s in ("sft", "reward", "dpo", "evaluate", "export"))
    ev = _fps(recipe_file, "evaluate.num_prompts=3")
    assert [ev[s] == base[s] for s in base] == [True, True, True, True, False, False]
    # The reward model feeds evaluation only: the DPO policy and its export do not move.
    rw = _fps(recipe_file, "reward.margin=0.5")
    assert [rw[s] == base[s] for s in base] == [True, True, False, True, False, False]
    # Without the optional stages, downstream stages just lose those parents.
    bare = _fps(recipe_file, "reward=null", "dpo=null")
    assert list(bare) == ["ingest", "sft", "evaluate", "export"]
    # Run name, workspace-independent settings and timeouts change nothing.
    assert _fps(recipe_file, "run.name=other", "infra.timeouts.sft=5") == base


def test_data_file_content_is_an_input(recipe_file: Path, tmp_path: Path) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "a", "completion": "b"}\n')
    over = ["sft.data.synthetic=null", f"sft.data.path={data}"]
    first = _fps(recipe_file, *over)
    data.write_text('{"prompt": "a", "completion": "c"}\n')
    second = _fps(recipe_file, *over)
    assert first["ingest"] == second["ingest"] and first["sft"] != second["sft"]


def test_planned_dirs_live_in_the_workspace(recipe_file: Path, tmp_path: Path) -> None:
    for s in plan(load_recipe(recipe_file)).stages:
        assert s.out_dir == tmp_path / "ws" / "artifacts" / s.name / s.fingerprint
        assert s.nprocs == 1
