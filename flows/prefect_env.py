"""Prefect settings for posttrain, applied to the environment BEFORE `prefect` is imported.

Prefect reads its settings from the environment once, when it is first imported, so these
defaults only take effect if `apply_prefect_defaults()` runs first (the CLI and the test
configuration call it at the top). `setdefault` keeps anything the user exported.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

PREFECT_DEFAULTS: dict[str, str] = {
    # Embedded mode starts a server in-process; on a fresh home its database migrations take
    # ~20-25 s here, and Prefect's default 20 s startup timeout fails the first run.
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    # Machines running training jobs are often offline; don't try to phone home.
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    # A request that fails because the server is away (a restart, an upgrade, a network blip) is
    # retried with back-off 2, 4, 8, ... s. Prefect's 5 retries give up after ~62 s, and a task
    # whose Completed state cannot be recorded fails a run whose stage trained fine. 7 retries
    # ride out ~4 min (2 + 4 + ... + 128 s, +-20% jitter); the price is up to ~2 min between the
    # server's return and the call that notices. A first connection is not retried: a wrong
    # PREFECT_API_URL still fails at once.
    "PREFECT_CLIENT_MAX_RETRIES": "7",
}


def apply_prefect_defaults(environ: MutableMapping[str, str] | None = None) -> None:
    """Set embedded-mode defaults without overriding values the user already set."""
    env = os.environ if environ is None else environ
    missing = {k: v for k, v in PREFECT_DEFAULTS.items() if k not in env}
    if missing and env is os.environ and "prefect" in sys.modules:
        # Too late to matter for settings already read; say so rather than fail silently.
        print(
            f"posttrain: warning: prefect was imported before {', '.join(missing)} was set",
            file=sys.stderr,
        )
    env.update(missing)


def prefect_target(environ: MutableMapping[str, str] | None = None) -> str:
    """Where flow runs go: the server at PREFECT_API_URL, or an embedded (SQLite) server."""
    env = os.environ if environ is None else environ
    url = env.get("PREFECT_API_URL")
    return f"Prefect server at {url}" if url else "embedded Prefect (local SQLite)"
