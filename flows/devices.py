"""One run at a time per device set, so two runs never train on the same devices at once.

Two layers, taken in this order and held from a run's first stage to its last (runs queue
whole: holding per stage would let a long stage of a later run, a retraining triggered by this
run's new base say, starve this run's evaluate and export):

1. A host-wide `flock` (`posttrain.runtime.device_lock`): the kernel frees it when the holder
   dies, so a dead run never keeps the devices. A waiting run logs who holds it.
2. A one-slot Prefect global concurrency limit named after the machine and its devices: what the
   UI shows, and what an operator sets to 0 to pause runs. A run killed outright leaves its
   lease occupied (forever on the embedded server); once a run holds the flock no live run here
   holds the slot, so an occupied slot is a dead run's and is repossessed at once.
A run that would train nothing takes neither (`flows.stage.launch.REUSE_ONLY`); should a stage
need to run after all, the launch raises `DevicesNeeded` and the run starts again holding them.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
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

from flows.report.tables import format_duration
from flows.stage.launch import HELD_DEVICE_LOCK, node_rank
from flows.stage.output import artifact_key, run_logger
from posttrain.runtime.device_lock import DeviceLock
from posttrain.runtime.spec import PlannedStage
from posttrain.store.locking import LockTimeout
from posttrain.store.status import status
from posttrain.telemetry.records import read_metrics

PREFIX = "posttrain-devices"
SLOT_POLL_S = 2.0


class DevicesBusy(Exception):
    """The devices stayed held by another run for the whole `infra.wait_devices_s`."""


def reusable_without_devices(stages: list[PlannedStage]) -> bool:
    """Whether every stage's artifact looks complete (sizes, no hashing: a stat per file), so
    the run may skip the device wait. Node 0 only: other nodes join its launches."""
    return node_rank() == 0 and all(
        status(s.out_dir, s.fingerprint, hashes=False).complete for s in stages
    )


def device_set_name(device: str) -> str:
    """`posttrain-devices-<host>-cpu` or `posttrain-devices-<host>-cuda-<visible devices>`."""
    devices = "cpu"
    if device == "cuda":
        devices = "cuda-" + os.environ.get("CUDA_VISIBLE_DEVICES", "all").replace(",", "-")
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


def holder_progress(holder: dict[str, Any] | None) -> str:
    """`: stage sft, step 40/160, ETA 2m 10s` from the stage the holder launched last (its
    record names it) and that stage's newest training records; "" when there is none yet."""
    out_dir = (holder or {}).get("out_dir")
    if not out_dir:
        return ""
    text = f": stage {holder.get('stage')}"  # type: ignore[union-attr]
    try:
        train = read_metrics(Path(out_dir) / "metrics.jsonl", "train")
    except (OSError, ValueError):
        train = []
    if not train:
        return text + " (starting)"
    last = train[-1]
    text += f", step {last['step']:g}/{last['total_steps']:g}"
    first = train[max(0, len(train) - 50)]  # the recent rate, not the whole stage's
    if last["step"] > first["step"] and last["time"] > first["time"]:
        rate = (last["time"] - first["time"]) / (last["step"] - first["step"])
        text += f", ETA {format_duration(round((last['total_steps'] - last['step']) * rate))}"
    return text


def repossess_stale_slot(name: str, previous: dict[str, Any] | None) -> bool:
    """Free the slots of `name` a dead run left occupied (only while holding the flock, which
    proves no live run here holds one); whether there was any. By resetting the active slots:
    Prefect's API does not list the dead lease. On a server it still expires later and
    decrements a slot this run holds; the floor is 0 and the flock still excludes others."""
    with get_client(sync_client=True) as client:
        limit = client.read_global_concurrency_limit_by_name(name)
        if limit.active_slots <= 0:
            return False
        client.update_global_concurrency_limit(name, GlobalConcurrencyLimitUpdate(active_slots=0))
    gone = "was still occupied by a run that is gone (it died without releasing it)"
    holder = describe_device_holder(previous)
    run_logger().warning("repossessed the devices: %s %s; last holder: %s", name, gone, holder)
    return True


def take_slot(
    stack: contextlib.ExitStack, name: str, run_id: str | None, deadline: float | None = None
) -> None:
    """Enter a slot of the limit `name` on `stack`, polling while none is free, until the
    monotonic `deadline` (DevicesBusy after it). One attempt at a time, from this thread:
    Prefect's own wait retries in a background loop that outlives a SIGTERM raised here, and the
    process's exit then waited for it (80 s observed)."""
    holder = ConcurrencyLeaseHolder(type="flow_run", id=run_id) if run_id else None
    told = False
    while True:
        try:
            once = {"max_retries": 0, "raise_on_lease_renewal_failure": False}
            stack.enter_context(concurrency(name, occupy=1, strict=True, holder=holder, **once))
            return
        except ConcurrencySlotAcquisitionError as exc:
            cause = exc.__cause__
            if not (isinstance(cause, httpx.HTTPStatusError) and cause.response.status_code == 423):
                raise
        full = "has no free slot on the Prefect server (its limit is full or set to 0)"
        if deadline is not None and time.monotonic() > deadline:
            raise DevicesBusy(f"{name} {full}; infra.wait_devices_s ran out")
        if not told:
            run_logger().info("waiting for the devices: %s %s", name, full)
            told = True
        time.sleep(SLOT_POLL_S)


def _flow_run() -> tuple[str | None, str | None]:
    ctx = FlowRunContext.get()
    if ctx is None or ctx.flow_run is None:
        return None, None
    return str(ctx.flow_run.id), ctx.flow_run.name


@contextlib.contextmanager
def hold_devices(name: str, wait_s: float | None = None) -> Iterator[None]:
    """Wait for and hold the device set: its host flock, then a slot of its Prefect limit
    (strict: a missing limit is an error), for at most `wait_s` seconds in all (None: as long as
    it takes), then DevicesBusy naming the holder. A failed lease renewal only warns: Prefect
    would otherwise cancel the run, killing a stage that needs no server, to protect a slot."""
    log = run_logger()
    run_id, run_name = _flow_run()
    lock = DeviceLock(name)
    deadline = None if wait_s is None else time.monotonic() + wait_s

    def waiting(holder: dict[str, Any] | None) -> None:
        who = describe_device_holder(holder) + holder_progress(holder)
        bound = "" if wait_s is None else f" (waiting at most {format_duration(round(wait_s))})"
        log.info(
            "waiting for the devices: %s is held by another run: %s%s; lock %s",
            name,
            who,
            bound,
            lock.path,
        )

    # Polls, so SIGINT/SIGTERM/SIGHUP end the wait at once.
    owner = {"what": "posttrain run", "flow_run_id": run_id, "flow_run_name": run_name}
    try:
        lock.acquire(owner, on_wait=waiting, timeout_s=wait_s)
    except LockTimeout:
        holder = lock.holder()  # read once: the record may change between two reads
        who = describe_device_holder(holder) + holder_progress(holder)
        waited = format_duration(round(wait_s or 0))
        raise DevicesBusy(f"{name} stayed held for {waited} by another run: {who}") from None
    token = HELD_DEVICE_LOCK.set(lock)
    try:
        repossess_stale_slot(name, lock.previous)
        with contextlib.ExitStack() as stack:
            take_slot(stack, name, run_id, deadline)
            log.info("holding %s", name)
            yield
    finally:
        HELD_DEVICE_LOCK.reset(token)
        lock.release()
