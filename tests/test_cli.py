"""CLI: validation errors name the field and exit 2 before anything starts."""

from __future__ import annotations

import io
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from flows.cli import cmd_plan, cmd_validate, main
from flows.prefect_env import apply_prefect_defaults, prefect_target

REPO = Path(__file__).resolve().parents[1]


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(textwrap.dedent(text))
    return path


# device/precision given: resolving needs no torch import, so these tests stay fast.
GOOD = """
    run: {{name: cli-test, workspace: {ws}}}
    infra: {{device: cpu, precision: fp32}}
    ingest: {{source: from_config}}
    sft:
      data: {{synthetic: {{n_examples: 50}}}}
"""

BAD = """
    infra: {device: cpu, precision: fp32}
    ingest: {source: from_config}
    sft:
      data: {synthetic: {n_examples: 50}}
      optim: {lr: -1}
      epochz: 2
"""


def test_validate_bad_recipe_exits_2_and_names_every_field(tmp_path: Path) -> None:
    out, err = io.StringIO(), io.StringIO()
    assert cmd_validate(str(_write(tmp_path, BAD)), [], out, err) == 2
    assert out.getvalue() == ""
    lines = err.getvalue().splitlines()
    assert any(line.strip().startswith("sft.optim.lr:") for line in lines)
    assert any(line.strip().startswith("sft.epochz: unknown field") for line in lines)


def test_validate_bad_override_through_main(tmp_path: Path, capsys) -> None:
    path = _write(tmp_path, GOOD.format(ws=tmp_path / "ws"))
    assert main(["validate", str(path), "sft.lora.r=0"]) == 2
    assert "sft.lora.r:" in capsys.readouterr().err


def test_validate_prints_resolved_recipe_only_when_asked(tmp_path: Path) -> None:
    out, err = io.StringIO(), io.StringIO()
    path = _write(tmp_path, GOOD.format(ws=tmp_path / "ws"))
    assert cmd_validate(str(path), ["sft.optim.lr=0.0003"], out, err) == 0
    assert out.getvalue().splitlines()[0] == "recipe ok: 4 stages, 4 to run"
    assert "--- # resolved recipe" not in out.getvalue()
    out = io.StringIO()
    assert cmd_validate(str(path), ["sft.optim.lr=0.0003"], out, err, resolved=True) == 0
    data = yaml.safe_load(out.getvalue().split("--- # resolved recipe\n")[1])
    assert data["sft"]["optim"]["lr"] == 0.0003
    assert data["sft"]["batch"]["global_batch_size"] == 8  # derived: 8 x 1 x 1
    assert data["run"]["workspace"] == str(tmp_path / "ws")


def _table(text: str) -> list[str]:
    """The stage rows of `plan`'s table (after its verdict and input lines)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("stage "))
    return lines[start + 2 : start + 6]


def test_plan_lists_stages_and_missing_artifacts(tmp_path: Path) -> None:
    out, err = io.StringIO(), io.StringIO()
    path = _write(tmp_path, GOOD.format(ws=tmp_path / "ws"))
    assert cmd_plan(str(path), [], out, err) == 0
    assert out.getvalue().splitlines()[0] == "recipe ok: 4 stages, 4 to run"
    rows = _table(out.getvalue())
    assert [r.split()[0] for r in rows] == ["ingest", "sft", "evaluate", "export"]
    assert all(r.split()[-1] == "missing" and len(r.split()[-3]) == 16 for r in rows)
    assert " from ingest " in rows[1] and rows[2].split()[2] == "sft"  # evaluate's policy
    assert [r.split()[-2] for r in rows] == ["local"] * 4
    out = io.StringIO()
    overrides = ["infra.launcher=slurm", "infra.nnodes=4", "infra.devices_per_node=8"]
    assert cmd_plan(str(path), overrides, out, err) == 0, err.getvalue()
    rows = _table(out.getvalue())
    assert [r.split()[-2] for r in rows] == ["local", "slurm:4x8", "slurm:1", "slurm:1"]


def _cli_in_fresh_python(*args: str | Path) -> subprocess.CompletedProcess[str]:
    """`posttrain ARGS` in a fresh interpreter that fails if the command imported Prefect."""
    code = (
        "import sys; from flows.cli import main; rc = main(sys.argv[1:]); "
        "assert 'prefect' not in sys.modules, 'prefect was imported'; sys.exit(rc)"
    )
    argv = [sys.executable, "-c", code, *map(str, args)]
    return subprocess.run(argv, cwd=REPO, capture_output=True, text=True)


def test_launch_refuses_a_parent_that_is_not_complete_in_one_line(tmp_path: Path) -> None:
    """`posttrain launch sft` before ingest ran: one line naming the parent and the command
    that builds it; nothing is started, nothing written, Prefect not imported."""
    path = _write(tmp_path, GOOD.format(ws=tmp_path / "ws"))
    proc = _cli_in_fresh_python("launch", "sft", path)
    assert proc.returncode == 1, proc.stderr
    (line,) = proc.stderr.splitlines()
    assert line.startswith(f"error: parent stage 'ingest' is not complete ({tmp_path / 'ws'}/")
    assert line.endswith(f"does not exist); run it first: posttrain run {path} --until ingest")
    assert proc.stdout == "" and not (tmp_path / "ws").exists()


def test_run_with_bad_recipe_exits_2_without_importing_prefect(tmp_path: Path) -> None:
    path = _write(tmp_path, BAD)
    proc = _cli_in_fresh_python("run", path)
    assert proc.returncode == 2, proc.stderr
    assert "sft.optim.lr:" in proc.stderr
    assert proc.stdout == ""


def test_flow_modules_do_not_import_torch() -> None:
    # The flow process stays light: torch is for the stage processes it launches. It reads a
    # stage's health when the stage ends (imported then): a run stopped by a signal held the
    # devices while that imported torch.
    code = (
        "import sys, flows.cli, flows.post_train, flows.stage.task; "
        "from flows.report.health_summary import stage_health; stage_health('.'); "
        "heavy = [m for m in ('torch', 'transformers', 'peft') if m in sys.modules]; "
        "assert not heavy, heavy"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_prefect_defaults_never_override_the_user() -> None:
    env = {"PREFECT_SERVER_ANALYTICS_ENABLED": "true"}
    apply_prefect_defaults(env)
    assert env == {
        "PREFECT_SERVER_ANALYTICS_ENABLED": "true",
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
        "PREFECT_CLIENT_MAX_RETRIES": "7",
    }
    assert prefect_target(env) == "embedded Prefect (local SQLite)"
    assert "http://h:4200/api" in prefect_target({"PREFECT_API_URL": "http://h:4200/api"})


def test_help_describes_the_stage_graph_of_the_registered_kinds(capsys) -> None:
    from posttrain.kinds import graph_kinds

    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "ingest -> SFT -> evaluate -> export" not in text
    kinds = ", ".join(graph_kinds())
    assert kinds.startswith("sft, reward, dpo") and "grpo" in kinds
    assert (
        f"ingest -> a graph of training stages ({kinds}), each reading the stages it names -> "
        "evaluate -> promotion gate -> export" in text
    )


def test_wait_devices_is_the_recipe_field_and_only_for_commands_that_train() -> None:
    from flows.cli import build_parser, recipe_overrides

    parser = build_parser()
    args = parser.parse_args(["run", "r.yaml", "sft.max_steps=3", "--wait-devices", "90"])
    assert recipe_overrides(args) == ["sft.max_steps=3", "infra.wait_devices_s=90.0"]
    args = parser.parse_args(["submit", "r.yaml", "--wait-devices", "0"])
    assert recipe_overrides(args) == ["infra.wait_devices_s=0.0"]
    assert recipe_overrides(parser.parse_args(["run", "r.yaml"])) == []
    with pytest.raises(SystemExit):
        parser.parse_args(["plan", "r.yaml", "--wait-devices", "5"])
