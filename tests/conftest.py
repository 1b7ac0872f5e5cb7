"""Test session setup: offline hub, Prefect defaults, and one Prefect test server on request."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

# The project is used from its checkout (not necessarily pip-installed): make `flows` and
# `posttrain` importable wherever pytest is started from.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Before anything imports huggingface_hub: a stray hub id otherwise costs ~47 s of retries.
os.environ["HF_HUB_OFFLINE"] = "1"

# Device locks (posttrain.runtime.device_lock) are host-wide by default: a test session gets its own
# directory, so parallel sessions (or a real run on this machine) never wait for each other.
if "POSTTRAIN_DEVICE_LOCK_DIR" not in os.environ:
    import tempfile

    os.environ["POSTTRAIN_DEVICE_LOCK_DIR"] = tempfile.mkdtemp(prefix="posttrain-device-locks-")

# A shell without job control starts background commands (`nohup ... &`, some CI runners) with
# SIGINT and SIGQUIT ignored, and an ignored signal stays ignored across exec: neither pytest nor
# the CLIs it starts would turn Ctrl-C into KeyboardInterrupt, and the interrupt tests would wait
# out their stage timeouts. Python's own handler here makes children start with the default.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# Before anything loads OpenMP (torch does, and every stage process inherits this environment):
# waiting threads sleep instead of spinning. The suite runs on 2 cores with other processes
# beside each one (two pytest sessions, stage children, a Prefect server), and a 2-thread torch
# op whose partner thread is descheduled spins away the core that thread needs: under a load of
# ~25 here, 2,000 forwards of a tiny MLP took 310 s spinning, 1.3-3.6 s passive, 5-10 s on one
# thread. How threads wait changes no result (the thread count, which can, stays the recipe's).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# Before anything multiplies: importing posttrain pins MKL's reproducible mode (posttrain.numerics).
import posttrain  # noqa: E402, F401

# Before anything imports prefect, which reads its settings once at import.
from flows.prefect_env import apply_prefect_defaults  # noqa: E402

apply_prefect_defaults()

from collections.abc import Iterator  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def prefect_harness(
    prefect_server: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[None]:
    """In-process flows of the session talk to the session's `prefect_server`: one server per
    test worker, not a second one (prefect's `prefect_test_harness` started its own, ~20 s and
    ~9 CPU-s more in each worker). Tests that read Prefect back filter by their own flow run.
    Results default into the session's temp folder, never ~/.prefect/storage, so cached results
    cannot leak between sessions."""
    import prefect.context
    import prefect.settings as ps
    from prefect.settings import temporary_settings

    updates: dict = {
        ps.PREFECT_API_URL: prefect_server.api_url,
        ps.PREFECT_RESULTS_LOCAL_STORAGE_PATH: tmp_path_factory.mktemp("results"),
    }
    heartbeat = getattr(ps, "PREFECT_FLOWS_HEARTBEAT_FREQUENCY", None)
    if heartbeat is not None:
        # The heartbeat thread's join costs ~1 s at the end of every flow run.
        updates[heartbeat] = None
    # Also as the process-global settings (as prefect_test_harness does): a plain thread
    # (test_flow runs a flow in one) starts without this context's variables, and would
    # otherwise start an embedded server of its own.
    with (
        temporary_settings(updates=updates),
        prefect.context._temporary_global_settings_context(prefect.context.get_settings_context()),
    ):
        try:
            yield
        finally:
            _drain_prefect_workers()


def _drain_prefect_workers() -> None:
    """Send the logs and events still queued in this process before the server stops: a
    worker left with them retries against a stopped server at exit."""
    import inspect

    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker
    from prefect.utilities.asyncutils import run_coro_as_sync

    async def drain() -> None:
        try:
            pending = APILogWorker.instance().drain()
            if inspect.isawaitable(pending):
                await pending
        except RuntimeError:
            pass  # no log worker was started
        pending = EventsWorker.drain_all()
        if inspect.isawaitable(pending):
            await pending

    run_coro_as_sync(drain())


@pytest.fixture(scope="session")
def shared_parents(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where parent artifacts several stage-test modules build alike are built once per session
    (tests/stage_helpers.run_shared)."""
    return tmp_path_factory.mktemp("shared-parents")


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """A real `prefect server start` (127.0.0.1, free port, own PREFECT_HOME), healthy before
    the first test uses it and stopped by PID after the last one."""
    from prefect_server import start_server

    # Its own migrations: a seeded copy pays off for homes started many times, but costs this
    # one-off server a `database upgrade` process first (healthy in 37 s and 20 CPU-s, against
    # 23 s and 15 CPU-s migrating in the server).
    server = start_server(tmp_path_factory.mktemp("prefect-home"), seed=False)
    try:
        yield server
    finally:
        server.stop()


# `slurm_cluster`: a real 2-node Slurm cluster for the session (tests/slurm_cluster.py).
from slurm_cluster import slurm_cluster  # noqa: E402, F401


# optionalhook: an environment without pytest-xdist does not know this hook.
@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """pytest-xdist's work units (scripts/dev.sh runs two workers): a file's tests run in one
    worker, in order, so its module fixtures (a pipeline run several tests read) are built once;
    the Slurm files are one unit, so one worker starts the session's 2-node cluster. (Its own
    `--dist loadgroup` marks do not reach the scheduler under pytest 9.)"""
    from xdist.scheduler import LoadScopeScheduling

    class ByFile(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "slurm" if Path(path).name.startswith("test_slurm") else path

    return ByFile(config, log)
