"""RL stages sampling from a real `transformers serve` (rollout.engine: server) on the tiny
model the other RL tests share: GRPO single-turn and PPO on episodes train through it, a
killed server fails the stage by name and leaves nothing running, a killed stage or flow takes
its server down, and one update behind (max_staleness 1) trains and logs its correction."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import torch
import yaml
from prefect_server import seed_home
from safetensors.torch import load_file

from posttrain.telemetry.records import read_metrics
from tests.stage_helpers import ROOT, planned_dir, planned_launch, run_inprocess
from tests.test_agent_rl import EPISODES, episode_recipe
from tests.test_rl_stages import GRPO, PPO, parents, recipe_with  # noqa: F401 (the fixture)

pytestmark = pytest.mark.slow

# A small paged cache: the default sizes it from free memory, which on CPU made each new
# policy version's first batch take 15-25 s to allocate.
SERVE = (
    "transformers serve --host {host} --port {port} --continuous-batching "
    "--cb-num-blocks 64 --cb-block-size 16 --format quiet"
)
SERVER = {"command": SERVE, "env": {"OMP_NUM_THREADS": "1"}, "request_timeout_s": 60.0}


def served(section: dict, **rollout: object) -> dict:
    section = copy.deepcopy(section)
    section["rollout"] |= {"engine": "server", "server": copy.deepcopy(SERVER), **rollout}
    return section | {"max_steps": 4, "eval_prompts": 8}


def server_group(out: Path) -> int:
    """The process group of the stage's last server (its log says which)."""
    log = (out / "logs" / "rollout-server.log").read_text().splitlines()
    return int([x for x in log if x.startswith("== process group ")][-1].split()[-1])


def left_running(pgid: int) -> list[psutil.Process]:
    alive = []
    for p in psutil.process_iter(["status"]):
        try:
            if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                alive.append(p)
        except (OSError, psutil.Error):
            continue
    return alive


def no_server_left(out: Path, within_s: float = 30.0, stopped: bool | None = True) -> None:
    """Nothing of the stage's server runs (within `within_s`); `stopped` (the stage ended on
    its own feet): its record is gone too; False: a killed stage left the record, which the
    next attempt reads (`stop_leftover`); None: either."""
    pgid = server_group(out)
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline and left_running(pgid):
        time.sleep(0.2)
    assert not left_running(pgid), [p.cmdline() for p in left_running(pgid)]
    if stopped is not None:
        assert (out / "logs" / "rollout-server.json").exists() != stopped


def test_grpo_samples_from_a_started_server(parents, capfd) -> None:  # noqa: F811
    recipe = recipe_with(parents, "grpo", served(GRPO), "served-grpo")
    out = run_inprocess("grpo", recipe)
    train = read_metrics(out / "metrics.jsonl", "train")
    assert len(train) == 4
    for step, row in enumerate(train):
        assert row["policy_version"] == step and row["staleness"] == 0
        assert row["sync_s"] > 0 and row["exact_frac"] == 0  # transformers serve: text back
        assert 0 <= row.get("retokenized_mismatch_frac", 0) <= 1
        assert row["prompt_mismatch_frac"] == 0  # the prompt text reads back as the ids sent
        assert row["response_len"] > 0 and math_finite(row["loss"])
        assert "sampler_probe_mean" not in row  # no log-probs to check (below)
    said = (
        "rollout.engine server (transformers): the sampler is not checked: the transformers "
        "server returns no log-probs of the tokens it samples"
    )
    assert capfd.readouterr().out.count(said) == 1  # stage_main logs to stdout
    manifest = json.loads((out / "manifest.json").read_text())
    s = manifest["summary"]
    assert s["eval_final"]["prompts"] == 8 and s["eval_sft"]["prompts"] == 8
    # The server's batching follows request timing: the run does not claim the same bits.
    verdict = manifest["numerics"]["reproducibility"]
    assert verdict["bit_exact"] is False and "serving engine" in verdict["why"]
    sft = load_file(str(parents["sft"] / "adapter" / "adapter_model.safetensors"))
    grpo = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    assert any(not torch.equal(sft[k], grpo[k]) for k in sft)  # it trained
    assert not (out / "serving").exists() and "serving/" not in json.dumps(
        json.loads((out / "manifest.json").read_text())["files"]
    )
    log = (out / "logs" / "rollout-server.log").read_text()
    assert "serving/policy-v3" in log and "serving/reference" in log  # the versions it served
    no_server_left(out)


def math_finite(x: float) -> bool:
    return x == x and abs(x) != float("inf")


def test_ppo_plays_episodes_through_the_server(parents) -> None:  # noqa: F811
    section = served(EPISODES)
    section["max_steps"] = 3
    recipe = episode_recipe(parents, "ppo", section, "served-ppo-episodes")
    out = run_inprocess("ppo", recipe)
    train = read_metrics(out / "metrics.jsonl", "train")
    assert [r["policy_version"] for r in train] == [0, 1, 2]
    for row in train:
        assert 1 <= row["turns_mean"] <= 3 and "reward_fn_environment" in row
        assert row["exact_frac"] == 0 and "value_loss" in row
    samples = [json.loads(x) for x in (out / "eval_samples.jsonl").read_text().splitlines()]
    assert samples and all(s["episode"][0]["role"] == "assistant" for s in samples)
    no_server_left(out)


def test_one_update_behind_trains_and_logs_its_correction(parents) -> None:  # noqa: F811
    section = served(GRPO, max_staleness=1, importance_weight_cap=1.05)
    section["optim"] = {"lr": 2e-2}  # steps large enough to move the weights between versions
    recipe = recipe_with(parents, "grpo", section, "served-grpo-stale")
    out = run_inprocess("grpo", recipe)
    train = read_metrics(out / "metrics.jsonl", "train")
    assert [r["staleness"] for r in train] == [0, 1, 1, 1]
    assert [r["policy_version"] for r in train] == [0, 0, 1, 2]  # sampled one update behind
    assert "is_weight" not in train[0]  # the first rollout is the trainer's own
    lagged = train[1:]
    assert all("is_weight" in r and "is_clip_frac" in r for r in lagged)
    assert any(abs(r["is_weight"] - 1) > 1e-6 for r in lagged)  # the weights moved
    assert any(r["is_clip_frac"] > 0 for r in lagged)  # some ratios above the 1.05 cap
    assert all(r["generation_overlapped_s"] > 0 for r in train[:-1])
    assert train[-1]["generation_overlapped_s"] == 0  # nothing left to sample ahead
    no_server_left(out)


@contextlib.contextmanager
def _stage(recipe: Path, kind: str = "grpo") -> Iterator[subprocess.Popen[str]]:
    """The recipe's stage of `kind` as a process of its own, this test its supervisor."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    with planned_launch(kind, recipe) as spec:
        assert spec is not None
        yield subprocess.Popen(
            [sys.executable, "-m", f"posttrain.stages.{kind}", "--spec", str(spec)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )


def _server_up(out: Path, timeout: float = 240.0) -> psutil.Process:
    """The real server process (the keeper's child) once the stage samples from it."""
    deadline = time.monotonic() + timeout
    record = out / "logs" / "rollout-server.json"
    while time.monotonic() < deadline:
        if record.exists() and _sampling(out):
            with contextlib.suppress(psutil.Error, ValueError, IndexError):
                return psutil.Process(json.loads(record.read_text())["pid"]).children()[0]
        time.sleep(0.2)
    raise AssertionError("the stage did not sample from its server")


def _sampling(out: Path) -> bool:
    """Whether the server has taken a generation request (the first are the SFT policy's
    evaluation): the stage is in its sampling. Waiting for a trained step instead, as these
    tests did, took 15-30 s more on a loaded machine, which no check reads."""
    log = out / "logs" / "rollout-server.log"
    return log.exists() and "[Request received]" in log.read_text("utf-8", "replace")


def test_a_killed_server_fails_the_stage_by_name(parents) -> None:  # noqa: F811
    section = served(GRPO)
    section["max_steps"] = 40
    recipe = recipe_with(parents, "grpo", section, "served-grpo-killed-server")
    out = planned_dir("grpo", recipe)
    with _stage(recipe) as proc:
        try:
            server = _server_up(out)
            server.send_signal(signal.SIGKILL)
            _, err = proc.communicate(timeout=120)  # bounded: no wait longer than the timeouts
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0
    lines = [x for x in err.splitlines() if x.startswith("POSTTRAIN_ERROR")]
    assert len(lines) == 1 and "Traceback" not in err, err[-2000:]
    assert "ServerFailed: rollout server http://127.0.0.1:" in lines[0]
    assert "it last said:" in lines[0] and "killed by SIGKILL" in lines[0], lines[0]
    no_server_left(out)


def test_a_killed_stage_takes_its_server_down(parents) -> None:  # noqa: F811
    section = served(GRPO)
    # An artifact of its own: with the killed-server test's, `_server_up` would read that
    # attempt's server log and record and could catch the keeper before its handlers.
    section["max_steps"] = 37
    recipe = recipe_with(parents, "grpo", section, "served-grpo-killed-stage")
    out = planned_dir("grpo", recipe)
    with _stage(recipe) as proc:
        server = _server_up(out)
        proc.send_signal(signal.SIGKILL)  # no `finally` runs: the parent-death signal must do it
        proc.wait(timeout=30)
    server.wait(timeout=30)
    no_server_left(out, stopped=False)


def test_a_killed_flow_takes_the_server_down(parents) -> None:  # noqa: F811
    """SIGKILL of `posttrain run` while GRPO samples from its server: the stage sees its
    supervisor gone (`infra.orphan: stop`) and ends, and its server with it."""
    section = served(GRPO)
    section["max_steps"] = 39  # an artifact of its own
    recipe = recipe_with(parents, "grpo", section, "served-flow")
    out = planned_dir("grpo", recipe)
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_HOME": str(seed_home(parents["folder"] / "prefect-home")),
    }
    flow = subprocess.Popen(
        [sys.executable, "-m", "flows.cli", "run", str(recipe)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        server = _server_up(out, timeout=420)
        flow.send_signal(signal.SIGKILL)
        flow.wait(timeout=30)
        server.wait(timeout=60)
        no_server_left(out, within_s=60, stopped=False)
    finally:
        for p in psutil.process_iter():  # the flow's own session, should anything be left
            try:
                if os.getsid(p.pid) == flow.pid:
                    p.kill()
            except (OSError, psutil.Error):
                continue


def test_a_timed_out_stage_takes_its_server_down(parents, monkeypatch) -> None:  # noqa: F811
    """The flow's supervisor (`stage_task`, here without a flow) kills a stage that runs past
    its timeout, and the server with it: it carries the stage's launch tag."""
    from flows.stage.failures import StageTimeout
    from flows.stage.launchers.local import LocalLaunch
    from flows.stage.task import stage_task
    from posttrain.config.loader import load_recipe
    from posttrain.plan.planner import plan, spec_for
    from posttrain.store.artifacts import ref_from_manifest

    section = served(GRPO)
    section["max_steps"] = 38  # an artifact of its own
    path = recipe_with(parents, "grpo", section, "served-timeout")
    data = yaml.safe_load(path.read_text())
    data["infra"]["timeouts"] = {"grpo": 5}
    path.write_text(yaml.safe_dump(data))
    recipe = load_recipe(path)
    stage = next(s for s in plan(recipe).stages if s.name == "grpo")
    refs = {name: ref_from_manifest(parents[name]) for name in stage.parents}
    # The timeout's clock starts once the server is up, as a queued launch's starts once it runs
    # (`Launch.started`): the kill lands while it serves, however long the stage took to start
    # it (20-35 s, by load; a fixed 30 s from the launch sometimes stopped it still starting).
    log = stage.out_dir / "logs" / "rollout-server.log"
    monkeypatch.setattr(LocalLaunch, "started", lambda self: _serving(log))
    with pytest.raises(StageTimeout, match="timed out after 5 s"):
        stage_task.fn(stage, spec_for(stage, recipe, refs), kill_grace_s=5.0)
    assert _serving(log), log.read_text()[-2000:]  # it was serving when stopped
    no_server_left(stage.out_dir, stopped=None)


def _serving(log: Path) -> bool:
    return log.exists() and "Application startup complete" in log.read_text("utf-8", "replace")
