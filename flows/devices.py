"""One run at a time per device set, so two runs never train on the same devices at once.

Two layers, taken in this order and held from a run's first stage to its last (runs queue
whole: holding per stage would let a long stage of a later run, a retraining triggered by this
run's new base say, starve this run's evaluate and export):

1. A host-wide `flock` (`posttrain.runtime.device_lock`): the kernel frees it when the holder dies,
   by SIGKILL, a hang-up or a crash, so a dead run never keeps the devices. A waiting run logs who
   holds it (pid, flow run, since when).
2. A one-slot Prefect global concurrency limit named after the machine and the devices (`cpu`,
   or the CUDA devices visible to this process): what the UI shows, and what an operator can
   set to 0 to pause runs. Its slot is a lease the flow process renews; a run killed outright
   leaves it occupied, for the lease's 5 minutes on a server and forever on the embedded server
   (whose leases live in the memory of the server process that died with the run). Once a run
   holds the flock, no live run on this machine holds the slot, so an occupied slot is a dead
   run's: it is repossessed at once, with one log line naming that run.
 A run that would train nothing takes neither: when every stage's artifact is already complete, it
reuses them at once however busy the devices are (`flows.stage.launch.REUSE_ONLY`). Should a stage
need to run after all (its files changed after the run looked) or the promotion gate need a
head-to-head,
the launch raises `DevicesNeeded` instead, and the run starts again holding the devices.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import (
    GlobalConcurrencyLimitCreate,
    GlobalConcurrencyLimitUpdate,
)
from prefect.client.schemas.objects import ConcurrencyLeaseHolder
from prefect.concurrency._asyncio import ConcurrencySlotAcquisitionError
from prefect.concurrency.sync import concurrency
from prefect.context import FlowRunContext
from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

from flows.stage.launch import HELD_DEVICE_LOCK, node_rank
from flows.stage.output import artifact_key, run_logger
from posttrain.runtime.device_lock import DeviceLock
from posttrain.runtime.spec import PlannedStage
from posttrain.store.status import status

PREFIX = "posttrain-devices"
SLOT_POLL_S = 2.0


def reusable_without_devices(stages: list[PlannedStage]) -> bool:
    """Whether every stage's artifact looks complete (manifest, fingerprint, file sizes: no
    hashing, so it answers in a stat per file), so the run may skip the device wait. Node 0
    only: another node's agent joins node 0's launches without looking."""
    return node_rank() == 0 and all(
        status(s.out_dir, s.fingerprint, hashes=False).complete for s in stages
    )


def device_set_name(device: str) -> str:
    """`posttrain-devices-<host>-cpu` or `posttrain-devices-<host>-cuda-<visible devices>`, for
    a run on `device` (the plan's resolved infra.device)."""
    if device == "cuda":
        devices = "cuda-" + os.environ.get("CUDA_VISIBLE_DEVICES", "all").replace(",", "-")
    else:
        devices = "cpu"
    return artifact_key(f"{PREFIX}-{socket.gethostname()}-{devices}")


def ensure_device_limit(name: str) -> None:
    """Create the one-slot limit if it does not exist (a limit an operator set is kept)."""
    with get_client(sync_client=True) as client:
        try:
            client.read_global_concurrency_limit_by_name(name)
            return
        except ObjectNotFound:
            pass
        with contextlib.suppress(ObjectAlreadyExists):  # another run created it meanwhile
            client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))


def describe_device_holder(holder: dict[str, Any] | None) -> str:
    """`pid 123 (posttrain run, flow run happy-fox, since ...)` from a device lock record."""
    if not holder:
        return "another run"
    parts = [str(holder.get("what") or "a run")]
    if run := holder.get("flow_run_name") or holder.get("flow_run_id"):
        parts.append(f"flow run {run}")
    parts.append(f"since {holder.get('since')}")
    return f"pid {holder.get('pid')} ({', '.join(parts)})"


def repossess_stale_slot(name: str, previous: dict[str, Any] | None) -> bool:
    """Free the slots of `name` that a dead run left occupied; called only while holding the
    device flock, which proves that no live run on this machine holds one. Returns whether
    there was anything to free.

    By resetting the limit's active slots: the dead run's lease is not listed by Prefect's API
    (and on the embedded server it died with the server). On a server the old lease still
    expires later and decrements a slot this run now holds; the floor is 0, and the flock keeps
    excluding other runs meanwhile, so only the UI's count is briefly low."""
    with get_client(sync_client=True) as client:
        limit = client.read_global_concurrency_limit_by_name(name)
        if limit.active_slots <= 0:
            return False
        client.update_global_concurrency_limit(name, GlobalConcurrencyLimitUpdate(active_slots=0))
    run_logger().warning(
        "repossessed the devices: %s was still occupied by a run that is gone (it died "
        "without releasing it); last holder: %s",
        name,
        describe_device_holder(previous),
    )
    return True


def take_slot(stack: contextlib.ExitStack, name: str, run_id: str | None) -> None:
    """Enter a slot of the limit `name` on `stack`, polling while it has none free (an operator
    set it to 0, or a run on another machine with this host name holds it).

    One attempt at a time (max_retries=0), from this thread: Prefect's own wait retries in a
    background loop that outlives a SIGTERM raised in the waiting thread, and the process's
    exit then waited for it (80 s observed)."""
    holder = ConcurrencyLeaseHolder(type="flow_run", id=run_id) if run_id else None
    told = False
    while True:
        try:
            stack.enter_context(
                concurrency(
                    name,
                    occupy=1,
                    strict=True,
                    holder=holder,
                    max_retries=0,
                    raise_on_lease_renewal_failure=False,
                )
            )
            return
        except ConcurrencySlotAcquisitionError as exc:
            cause = exc.__cause__
            if not (isinstance(cause, httpx.HTTPStatusError) and cause.response.status_code == 423):
                raise
        if not told:
            run_logger().info(
                "waiting for the devices: %s has no free slot on the Prefect server (its limit "
                "is full or set to 0)",
                name,
            )
            told = True
        time.sleep(SLOT_POLL_S)


def _flow_run() -> tuple[str | None, str | None]:
    ctx = FlowRunContext.get()
    if ctx is None or ctx.flow_run is None:
        return None, None
    return str(ctx.flow_run.id), ctx.flow_run.name


@contextlib.contextmanager
def hold_devices(name: str) -> Iterator[None]:
    """Wait for and hold the device set: its host flock, then a slot of its Prefect limit.
    strict=True: a missing limit is an error, never a silent pass without any limit. A lease
    renewal that fails (the server away for minutes) only logs a warning: with strict, Prefect
    would otherwise cancel the run, killing a training stage that needs no server, to protect a
    slot that may or may not be reclaimed."""
    log = run_logger()
    run_id, run_name = _flow_run()
    lock = DeviceLock(name)

    def waiting(holder: dict[str, Any] | None) -> None:
        log.info(
            "waiting for the devices: %s is held by another run: %s; lock %s",
            name,
            describe_device_holder(holder),
            lock.path,
        )

    # Polls, so SIGINT/SIGTERM/SIGHUP end the wait at once.
    lock.acquire(
        {"what": "posttrain run", "flow_run_id": run_id, "flow_run_name": run_name},
        on_wait=waiting,
    )
    token = HELD_DEVICE_LOCK.set(str(lock.path))
    try:
        repossess_stale_slot(name, lock.previous)
        with contextlib.ExitStack() as stack:
            take_slot(stack, name, run_id)
            log.info("holding %s", name)
            yield
    finally:
        HELD_DEVICE_LOCK.reset(token)
        lock.release()
