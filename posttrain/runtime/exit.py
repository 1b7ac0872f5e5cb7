"""Ending a process without the interpreter's last garbage collection."""

from __future__ import annotations

import atexit
import gc


def exit_without_collecting() -> None:
    """At interpreter exit the cyclic GC walks every object the process made (torch,
    transformers, Prefect's server modules, the run) for memory the OS frees anyway: 1-5 s on a
    loaded 2-core machine while a supervisor or a shell waits for the process to end, ~1 s with
    the heap frozen. Only collection is skipped: exit hooks still run (registered later, they run
    before this one: Prefect's server stop, log and event flushes), the standard streams are
    flushed, and an artifact's files are written and hashed before its manifest. Registered
    once per process however often it is called (tests call the entry points many times)."""
    atexit.unregister(gc.freeze)
    atexit.register(gc.freeze)
