"""What a person sees on the terminal of a real `posttrain run` (a subprocess, stdout+stderr
merged as on a terminal): each kind of failure ends in one short block naming the stage, the
file:line or field, the fix and the stage's log, with no traceback and no repeats; training
shows rate-limited progress lines through a pipe; a CLI interrupted mid-stage leaves no Prefect
server and no stage process behind.

The failing runs talk to the session's Prefect server (tests/prefect_server.py: none of them is
about a server's start) and share one workspace whose ingest and SFT are built in this process
first, so each starts no stage but the ones it needs. So does the progress run of stand-in
stages (its server has nothing to do with its progress lines); the interrupted one keeps the
embedded server, whose start and stop it checks, with the Prefect home of the module, so its
migrations are paid once (tests/faults/fault_runs.py starts the CLI as the fault tests do).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from tests.faults.fault_runs import Run, kill_all, run_env, wait_gone
from tests.stage_helpers import TINY, run_inprocess

TRACEBACK = "Traceback (most recent call last)"


def _tiny(ws: Path, name: str, **sections: dict) -> dict:
    data = yaml.safe_load(yaml.safe_dump(TINY))
    data["run"] = {**data["run"], "name": name, "workspace": str(ws)}
    data["ingest"]["from_config"]["pretrain_steps"] = 5
    data["sft"]["max_steps"] = 4
    data.update(sections)
    return data


def _cli(folder: Path, env: dict, data: dict, *overrides: str) -> tuple[int, str]:
    recipe = folder / f"{data['run']['name']}.yaml"
    recipe.write_text(yaml.safe_dump(data))
    return Run(recipe, env, *overrides).finish()


def _block(out: str, head: str, what: str, fix: str, log: bool = True) -> list[str]:
    """The closing block: `head`, then a few lines with `what` and `fix` and (`log`) an
    existing log file, at the very end of the output; no traceback anywhere, `what` once."""
    lines = out.rstrip("\n").splitlines()
    assert head in lines, out[-4000:]
    block = lines[lines.index(head) :]
    assert len(block) <= 9, block
    text = "\n".join(block)
    assert what in text and fix in text, text
    assert TRACEBACK not in out, out[-4000:]
    assert out.count(what) == 1, out[-4000:]  # no repeats of the failure above the block
    if log:
        found = re.search(r"full log: (\S+)", block[-1])
        assert found and Path(found.group(1)).is_file(), block
        assert found.group(1).endswith("logs/stage.log")
    return block


def test_a_refused_recipe_is_one_block_naming_each_field(tmp_path: Path) -> None:
    data = _tiny(tmp_path / "ws", "refused")
    data["sft"]["optim"]["lr"] = -1
    data["sft"]["epochz"] = 2
    # An empty Prefect home, not a migrated copy (seed_home: a migration the first time in a
    # session): a refused recipe starts nothing, so nothing may need one.
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    rc, out = _cli(tmp_path, env | {"PREFECT_HOME": str(tmp_path / "home")}, data)
    assert rc == 2
    head = f"posttrain: recipe {tmp_path / 'refused.yaml'} refused: 2 problems (nothing ran)"
    block = _block(out, head, "sft.optim.lr:", "fix:", log=False)
    assert any(x.strip().startswith("sft.epochz: unknown field") for x in block)
    assert out.splitlines()[0] == head  # nothing started before it


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict]]:
    folder = tmp_path_factory.mktemp("cli-terminal")
    yield folder, run_env(folder / "home", folder / "locks")


@pytest.fixture(scope="module")
def served(shared: tuple[Path, dict], prefect_server: Any) -> tuple[Path, dict]:
    """`shared`, its workspace `ws` holding the runs' ingest and SFT (built here: a few seconds
    each, against a stage launch of ~15-20 s under load), its CLI runs flows on the session's
    Prefect server. The gate and bad-pair runs fail in a stage after the SFT, which they reuse;
    the other runs fail in an SFT of their own."""
    folder, env = shared
    recipe = folder / "ingest.yaml"
    recipe.write_text(yaml.safe_dump(_tiny(folder / "ws", "ingest")))
    run_inprocess("ingest", recipe)
    run_inprocess("sft", recipe)
    return folder, _on_server(env, prefect_server)


def _on_server(env: dict, prefect_server: Any) -> dict:
    """`env` with the session's Prefect server in place of an embedded one."""
    return {**env, **{k: v for k, v in prefect_server.env.items() if k.startswith("PREFECT_")}}


def _rows(path: Path, rows: list[str]) -> Path:
    path.write_text("\n".join(rows) + "\n")
    return path


def _chat(i: int) -> str:
    return json.dumps(
        {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]}
    )


@pytest.mark.slow
def test_a_bad_data_row_is_one_block_with_its_file_and_line(served: tuple[Path, dict]) -> None:
    # One bad row is enough: the block's fix line is chosen by the exception class (DataError,
    # flows/verdict_block.py), and every shape of bad row naming its file:line is checked on
    # load_sft_rows itself (tests/test_data.py::test_bad_rows_name_file_and_line).
    folder, env = served
    rows = [_chat(i) for i in range(20)]
    rows[2] = '{"messages": [{"role": "user", "content": "oops"'
    # The row stops short: the column is its end, not column 1 of the line after it.
    where = (
        f"{folder / 'broken-json'}.jsonl:3: invalid JSON: Expecting ',' delimiter "
        "(column 49, the end of the line)"
    )
    data = _tiny(folder / "ws", "broken-json")
    path = _rows(folder / "broken-json.jsonl", rows)
    data["sft"]["data"] = {"path": str(path), "max_seq_len": 64}
    rc, out = _cli(folder, env, data)
    assert rc == 1
    block = _block(out, "posttrain: stage sft failed", where, "fix:  correct or remove that row")
    log = Path(block[-1].split("full log: ")[1]).read_text()
    assert TRACEBACK in log  # the stage's traceback is kept, in its log


@pytest.mark.slow
def test_a_bad_pair_s_fix_names_on_invalid_of_its_stages_entry(served: tuple[Path, dict]) -> None:
    folder, env = served
    pair = {"prompt": "What is 1 + 1?", "chosen": "2", "rejected": "3"}
    rows = [json.dumps(pair)] * 6 + [json.dumps({**pair, "rejected": "2"})]
    path = _rows(folder / "pairs.jsonl", rows)
    dpo = {"kind": "dpo", "name": "dpo2", "max_steps": 1, "data": {"path": str(path)}}
    rc, out = _cli(folder, env, _tiny(folder / "ws", "bad-pair", stages=[dpo]))
    assert rc == 1
    _block(
        out,
        "posttrain: stage dpo2 failed",
        f"{path}:7: chosen and rejected are identical",
        "fix:  correct or remove that row, or set stages.dpo2.data.on_invalid: skip to leave "
        "bad rows out",
    )


@pytest.mark.slow
def test_a_memory_refusal_is_one_block_with_what_would_fit(
    served: tuple[Path, dict],
) -> None:
    folder, env = served
    data = _tiny(folder / "ws", "memory")
    # An SFT of its own: the shared one is complete (`served`), and this run would reuse it
    # without a pre-flight.
    data["sft"]["max_steps"] = 3
    rc, out = _cli(folder, env, data, "infra.device_memory_gb=0.001")
    assert rc == 1
    block = _block(
        out,
        "posttrain: stage sft failed",
        "does NOT fit in 50% of 1.0 MiB (infra.device_memory_gb override)",
        "infra.memory_preflight=warn",
    )
    # At 1 MiB no setting of the stage fits: the block says what device would.
    assert any("this stage needs a device with at least" in x for x in block), block


@pytest.mark.slow
def test_a_failed_quality_gate_is_one_block_naming_the_bar(served: tuple[Path, dict]) -> None:
    folder, env = served
    reward = {
        "data": {
            "synthetic": {"n_examples": 60},
            "eval_fraction": 0.2,
            "max_seq_len": 64,
            "max_prompt_len": 32,
        },
        "lora": {"r": 4, "alpha": 8},
        "batch": {"micro_batch_size": 8, "grad_accum_steps": 1},
        "max_steps": 2,
        "checkpoint_every": 0,
        "min_accuracy": 1.0,  # a tiny model after 2 steps cannot rank every pair right
    }
    rc, out = _cli(folder, env, _tiny(folder / "ws", "gate", reward=reward))
    assert rc == 1
    _block(
        out,
        "posttrain: stage reward failed its quality gate",
        "< reward.min_accuracy 1.0",
        "fix:  its artifact is kept",
        log=False,
    )


# Stand-in stages (no torch): sft writes PT_FAKE_STEPS training records PT_FAKE_STEP_S apart
# into its metrics.jsonl, as a training stage does; ingest just completes.
FAKE_STAGE = """
import json, os, time
from posttrain.stages.common import stage_main


def run(ctx):
    steps = int(os.environ.get("PT_FAKE_STEPS", "0")) if ctx.stage.name == "sft" else 0
    with open(ctx.stage.out_dir / "metrics.jsonl", "a") as f:
        for step in range(1, steps + 1):
            time.sleep(float(os.environ.get("PT_FAKE_STEP_S", "0.5")))
            record = {"kind": "train", "step": step, "total_steps": steps, "loss": 3.0 - step / 100,
                      "tokens_per_s": 1234.0}
            f.write(json.dumps(record) + "\\n")
            f.flush()
    return {"headline": {"steps": steps}}


if __name__ == "__main__":
    stage_main(run, kind="standin")
"""


def _fake_env(folder: Path, shared: tuple[Path, dict], **extra: str) -> dict:
    """Stand-in stages in `folder`; the Prefect home (its migrations paid once) is the module's."""
    mods = folder / "mods"
    mods.mkdir(exist_ok=True)
    (mods / "pt_fake_stage.py").write_text(FAKE_STAGE)
    stages = ",".join(f"{s}=pt_fake_stage" for s in ("ingest", "sft"))
    home = shared[0]
    return run_env(home / "home", home / "locks", mods, PT_STAGE_MODULES=stages, **extra)


def _fake_recipe(folder: Path, name: str) -> Path:
    """ingest -> sft only: each stage launch costs seconds even for a stand-in, and sft is the
    one these tests watch."""
    recipe = folder / f"{name}.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "run": {"name": name, "workspace": str(folder / "ws")},
                "infra": {"device": "cpu", "precision": "fp32"},
                "ingest": {"source": "from_config"},
                "sft": {"data": {"synthetic": {"n_examples": 20}}},
                "evaluate": None,
                "export": None,
            }
        )
    )
    return recipe


@pytest.mark.slow
def test_progress_through_a_pipe_is_plain_and_rate_limited(
    tmp_path: Path, shared: tuple[Path, dict], prefect_server: Any
) -> None:
    # 40 steps over ~12 s, a line at most every 4 s: about 4 lines, not 40. On the session's
    # server: an embedded one's start is ~10 s of CPU, and the interrupted run below has one.
    env = _fake_env(
        tmp_path, shared, PT_FAKE_STEPS="40", PT_FAKE_STEP_S="0.3", POSTTRAIN_PROGRESS_EVERY_S="4"
    )
    env = _on_server(env, prefect_server)
    run = Run(_fake_recipe(tmp_path, "progress"), env)
    try:
        assert run.proc.wait(timeout=300) == 0, run.text()[-4000:]
    finally:
        run.stop()
    run._reader.join(timeout=5)
    pattern = re.compile(
        r"^sft  step (\d+)/40 · loss [\d.]+ · 1,234 tok/s(?: · ETA (?:[\d.]+ s|\d+m \d\ds|\d+h \d\dm))?$"
    )
    progress = [(t, line) for t, line in run.lines if pattern.match(line)]
    assert 3 <= len(progress) <= 9, run.text()[-4000:]
    steps = [int(pattern.match(line).group(1)) for _, line in progress]  # type: ignore[union-attr]
    assert steps == sorted(steps) and steps[-1] == 40
    assert all("ETA" in line for _, line in progress[1:-1])
    gaps = [b - a for (a, _), (b, _) in zip(progress[:-2], progress[1:-1], strict=True)]
    assert all(g >= 3.0 for g in gaps), gaps  # at most one line per 4 s (polled every 2)
    assert "\r" not in run.text()


@pytest.mark.slow
def test_a_cli_killed_mid_stage_leaves_no_prefect_server_and_no_stage(
    tmp_path: Path, shared: tuple[Path, dict]
) -> None:
    """SIGINT (Ctrl-C) mid-stage: the CLI stops the stage and its server itself, and says so.
    SIGKILL, SIGTERM and SIGHUP of a run whose stage is running (the server's parent-death signal
    and the stage's orphan watch end them after a SIGKILL, within the same bounds as here):
    tests/faults/test_fault_device_slot.py."""
    env = _fake_env(tmp_path, shared, PT_FAKE_STEPS="600", PT_FAKE_STEP_S="1")
    run = Run(_fake_recipe(tmp_path, "kill-sigint"), env)
    procs: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 300
        server, stage = None, None
        while stage is None:
            assert run.proc.poll() is None, run.text()[-4000:]
            assert time.monotonic() < deadline, run.text()[-4000:]
            server = server or run.server()
            for p in run.descendants():
                with contextlib.suppress(psutil.Error):
                    line = " ".join(p.cmdline())
                    if "pt_fake_stage" in line and "/sft/" in line:
                        stage = p
            time.sleep(0.2)
        assert server is not None and server.is_running()
        procs = run.descendants()
        t0 = time.monotonic()
        run.proc.send_signal(signal.SIGINT)
        run.proc.wait(timeout=30)
        gone = wait_gone([server], 10)
        print(f"\nSIGINT: embedded server gone {time.monotonic() - t0:.1f} s after it")
        wait_gone([stage], 20)
        assert run.proc.returncode == 130
        run._reader.join(timeout=5)
        assert run.text().rstrip().endswith("interrupted; the running stage was stopped")
        assert gone < 10
        # The embedded server's URL (its start note) is dead once the run ends, and Prefect's
        # advice on running a server, and its exit hook's stop note, are not the run's: none of
        # them reaches the terminal.
        assert "temporary server" not in run.text()
        assert "prefect.io/docs" not in run.text()
    finally:
        run.stop()
        kill_all(procs)
