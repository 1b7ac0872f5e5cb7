"""Faults of the device slot: whatever kills `posttrain run` while it holds the devices, the next
run gets them within seconds, and nothing the killed run started outlives it.

Real CLI processes on the embedded Prefect (one PREFECT_HOME per module: the migrations are paid
once), real signals. Run A holds the devices (its stage is running), runs B and C wait for them.
C gets the signal (SIGINT for the SIGKILL case, whose path needs no code) and must exit within
EXIT_BOUND_S; then A gets it: B must get the devices within RECOVERY_BOUND_S, and A's embedded
server and stage process must be gone. B, holding the devices with its stage running, is the
next case's A (a run start fewer per case).
"""

from __future__ import annotations

import os
import signal
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.faults.fault_runs import (
    Run,
    run_env,
    stop_runs,
    wait_file,
    wait_gone,
    write_slow_stage,
)

pytestmark = pytest.mark.slow

RECOVERY_BOUND_S = 60.0  # measured: see docs/reliability.md, "Faults"
EXIT_BOUND_S = 30.0
GONE_BOUND_S = 30.0

RECIPE = """
    run: {name: fault-slot, workspace: WS}
    infra: {device: cpu, precision: fp32}
    ingest: {source: from_config}
    sft:
      data: {synthetic: {n_examples: 20}}
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    root = tmp_path_factory.mktemp("fault-slot")
    mods = root / "mods"
    module = write_slow_stage(mods, "ingest")
    recipe = root / "recipe.yaml"
    recipe.write_text(textwrap.dedent(RECIPE).replace("WS", str(root / "ws")))
    env = run_env(root / "prefect-home", root / "locks", mods, PT_STAGE_MODULES=f"ingest={module}")
    state = {"root": root, "recipe": recipe, "env": env, "n": 0, "holder": None}
    yield state
    release(state)


def deliver(run: Run, sig: signal.Signals) -> None:
    """As the fault would: a closed terminal (SIGHUP) or Ctrl-C (SIGINT) signals the terminal's
    whole foreground process group (the CLI and its embedded server; stages run in sessions of
    their own); `kill`, a container stop and the OOM killer signal the process alone."""
    if sig in (signal.SIGHUP, signal.SIGINT):
        os.killpg(run.pid, sig)  # the run leads its own group (fault_runs.Run)
    else:
        run.proc.send_signal(sig)


def start(setup: dict, name: str, **env_extra: str) -> tuple[Run, Path]:
    """A run with a workspace of its own (no artifact lock in common with the others)."""
    setup["n"] += 1
    pids = setup["root"] / f"{name}-{setup['n']}.pid"
    env = {**setup["env"], "PT_PIDS_FILE": str(pids), **env_extra}
    ws = setup["root"] / f"ws-{name}-{setup['n']}"
    log = setup["root"] / f"{name}-{setup['n']}.out"
    return Run(setup["recipe"], env, f"run.workspace={ws}", log=log), pids


def holder(setup: dict) -> tuple[Run, Path]:
    """A run holding the devices with its stage running: the one the previous case left holding
    them, else a new one. The caller owns it (stops it unless it hands it on)."""
    held, setup["holder"] = setup["holder"], None
    if held is None or held[0].proc.poll() is not None:
        if held is not None:
            stop_runs([held[0]])
        held = start(setup, "a")
        held[0].wait_for("holding posttrain-devices-")
    wait_file(held[1], run=held[0])
    return held


def release(setup: dict) -> None:
    """Stop the run a case left holding the devices."""
    held, setup["holder"] = setup["holder"], None
    if held is not None:
        stop_runs([held[0]])


@pytest.mark.parametrize(
    "sig", [signal.SIGKILL, signal.SIGHUP, signal.SIGTERM], ids=lambda s: s.name
)
def test_killed_holder_frees_the_devices_and_leaves_nothing_behind(
    setup: dict, sig: signal.Signals
) -> None:
    runs: list[Run] = []
    try:
        a, a_pids = holder(setup)
        runs.append(a)
        stage = psutil.Process(int(a_pids.read_text()))
        server = a.server()
        assert server is not None, "no embedded server found under the run"
        doomed = [stage, server, *a.descendants()]

        b, b_pids = start(setup, "b")
        c, _ = start(setup, "c")
        runs += [b, c]
        b.wait_for("waiting for the devices")
        assert f"pid {a.pid} " in b.text(), b.text()[-3000:]

        # A run waiting for the devices ends promptly on the same signal.
        c.wait_for("waiting for the devices")
        c_doomed = c.descendants()
        c_sig = signal.SIGINT if sig == signal.SIGKILL else sig
        t0 = time.monotonic()
        deliver(c, c_sig)
        c.proc.wait(timeout=EXIT_BOUND_S)
        c_exit = time.monotonic() - t0
        wait_gone(c_doomed, GONE_BOUND_S)
        print(f"\n{c_sig.name} while waiting for the devices: exited after {c_exit:.1f} s")
        assert c_exit < EXIT_BOUND_S

        t_signal = time.monotonic()
        deliver(a, sig)
        if sig == signal.SIGKILL:
            # Nothing of the CLI is left to stop them: the server's parent-death signal
            # (flows.embedded_server) and the stage's orphan watch (posttrain.runtime.orphan) must.
            # B's recovery is read from its output's timestamps, so waiting here costs nothing.
            server_gone = wait_gone([server], 10)
            stage_gone = wait_gone([stage], 20)
            print(
                f"\nSIGKILL: server gone after {server_gone:.1f} s, stage {stage_gone:.1f} s later"
            )
        t_holding = b.wait_for("holding posttrain-devices-", timeout=RECOVERY_BOUND_S + 60)
        recovery = t_holding - t_signal
        a.proc.wait(timeout=EXIT_BOUND_S)
        a_exit = time.monotonic() - t_signal
        wait_gone(doomed, GONE_BOUND_S)
        gone = time.monotonic() - t_signal
        print(
            f"\n{sig.name}: next run holds the devices {recovery:.1f} s after the signal; "
            f"run exited rc={a.proc.returncode} after {a_exit:.1f} s; its server and stage "
            f"gone within {gone:.1f} s"
        )
        assert recovery < RECOVERY_BOUND_S
        if sig == signal.SIGKILL:
            # The dead run's Prefect slot stayed occupied: repossessed, naming that run.
            assert "repossessed the devices" in b.text() and f"pid {a.pid} " in b.text()
        else:
            assert a.proc.returncode == {signal.SIGHUP: 129, signal.SIGTERM: 143}[sig]
            assert "the running stage was stopped" in a.text()
        runs.remove(b)
        setup["holder"] = (b, b_pids)  # the next case's holder
    finally:
        stop_runs(runs)


def test_killed_holder_on_a_prefect_server_frees_the_devices(
    setup: dict, prefect_server: object
) -> None:
    """The same on a `prefect server start`: the dead run's lease would hold the slot for 5
    minutes; the next run repossesses it at once."""
    release(setup)  # it holds the device lock these runs share
    server = {"PREFECT_API_URL": prefect_server.api_url}  # type: ignore[attr-defined]
    runs: list[Run] = []
    try:
        a, a_pids = start(setup, "server-a", **server)
        runs.append(a)
        a.wait_for("holding posttrain-devices-")
        wait_file(a_pids, run=a)
        stage = psutil.Process(int(a_pids.read_text()))
        b, _ = start(setup, "server-b", **server)
        runs.append(b)
        b.wait_for("waiting for the devices")
        t_kill = time.monotonic()
        a.proc.kill()
        recovery = b.wait_for("holding posttrain-devices-", timeout=RECOVERY_BOUND_S + 60) - t_kill
        print(f"\nSIGKILL on a Prefect server: next run holds the devices after {recovery:.1f} s")
        assert recovery < RECOVERY_BOUND_S
        assert "repossessed the devices" in b.text()
        wait_gone([stage], GONE_BOUND_S)  # the orphaned stage stopped itself
    finally:
        stop_runs(runs)
