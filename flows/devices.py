"""One Prefect global concurrency limit per device set, so two runs never train on the same
devices at once.

The limit is named after the machine and the devices the stages use (`cpu`, or the CUDA devices
visible to this process) and holds one slot. A run holds it from its first stage to its last, so
runs queue whole: holding it per stage would let a long stage of a later run (a retraining
triggered by this run's new base, say) starve this run's evaluate and export. The slot is a
lease the flow process renews; if that process is killed outright, the server frees the slot
when the lease runs out (5 minutes).
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator

from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
from prefect.concurrency.sync import concurrency
from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

from flows.stage_task import artifact_key, run_logger
from posttrain.config.schema import Recipe

PREFIX = "posttrain-devices"


def device_set_name(recipe: Recipe) -> str:
    """`posttrain-devices-<host>-cpu` or `posttrain-devices-<host>-cuda-<visible devices>`."""
    if recipe.infra.device == "cuda":
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


@contextlib.contextmanager
def hold_devices(name: str) -> Iterator[None]:
    """Wait for and hold a slot of the device limit. strict=True: a missing limit is an error,
    never a silent pass without any limit. A lease renewal that fails (the server away for
    minutes) only logs a warning: with strict, Prefect would otherwise cancel the run, killing a
    training stage that needs no server, to protect a slot that may or may not be reclaimed."""
    log = run_logger()
    with contextlib.suppress(Exception):  # the message is a courtesy; acquiring decides
        with get_client(sync_client=True) as client:
            limit = client.read_global_concurrency_limit_by_name(name)
        if limit.active_slots >= limit.limit:
            log.info("waiting for the devices: %s is held by another run", name)
    with concurrency(name, occupy=1, strict=True, raise_on_lease_renewal_failure=False):
        log.info("holding %s", name)
        yield
