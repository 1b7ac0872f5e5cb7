"""The embedded Prefect's SQLite database: checked before the server starts, set aside if damaged.

A damaged `$PREFECT_HOME/prefect.db` (a full or dying disk mid-write, a copy taken while it was
written) makes the embedded server fail to start, with thousands of lines of tracebacks, on every
later run. Nothing in it is needed to train (the workspace's manifests are the lineage of
record), so a database SQLite itself calls damaged is moved aside with one line saying so; one
merely locked or unreadable is left alone and the server's own error stands.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import TextIO

# Above this size only the cheap check runs (the header, the schema and Prefect's migration
# table): quick_check reads every page, which for a months-old multi-GB history costs seconds.
FULL_CHECK_MAX_BYTES = 256 << 20
SIDE_FILES = ("-wal", "-shm", "-journal")


def embedded_database() -> Path | None:
    """The SQLite file the embedded server will use; None for a server or another database."""
    from prefect.settings import get_current_settings

    settings = get_current_settings()
    if settings.api.url:
        return None
    url = settings.server.database.connection_url
    text = url.get_secret_value() if url is not None else ""
    prefix = "sqlite+aiosqlite:///"
    if not text.startswith(prefix) or ":memory:" in text:
        return None
    return Path(text[len(prefix) :].split("?")[0]).expanduser()


def damage(db: Path) -> str | None:
    """Why SQLite calls `db` damaged, or None (intact, missing, or not ours to judge)."""
    if not db.is_file():
        return None
    try:
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
    except sqlite3.Error:
        return None
    try:
        con.execute("SELECT count(*) FROM sqlite_master").fetchone()
        if db.stat().st_size <= FULL_CHECK_MAX_BYTES:
            rows = con.execute("PRAGMA quick_check").fetchall()
            problems = [r[0] for r in rows if r and r[0] != "ok"]
            if problems:
                return f"{problems[0]}" + (f" (+{len(problems) - 1} more)" if problems[1:] else "")
        return None
    except sqlite3.DatabaseError as exc:
        text = str(exc)
        # Locked or busy: another process writes it now; that is no damage.
        return None if "locked" in text or "busy" in text else text
    finally:
        con.close()


def set_aside_if_damaged(err: TextIO, db: Path | None = None) -> Path | None:
    """Move a damaged embedded database (and its WAL/SHM files) to `<name>.damaged-<UTC time>`
    and say so in one line; returns where it went, or None when nothing was wrong. Creates the
    database's folder when missing."""
    db = embedded_database() if db is None else db
    if db is not None:
        # SQLite creates the file but not its folder: a PREFECT_HOME that does not exist yet
        # (a fresh `PREFECT_HOME=/data/x/prefect`) otherwise fails the embedded server's start
        # with "unable to open database file", after a 2-minute timeout.
        db.parent.mkdir(parents=True, exist_ok=True)
    if db is None or (why := damage(db)) is None:
        return None
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    aside = db.with_name(f"{db.name}.damaged-{stamp}")
    db.rename(aside)
    for suffix in SIDE_FILES:
        side = db.with_name(db.name + suffix)
        if side.exists():
            side.rename(aside.with_name(aside.name + suffix))
    kept = "artifacts, checkpoints and run folders are in the workspace and are reused."
    moved = f"moved it to {aside.name} and starting with a fresh one"
    head = f"posttrain: the embedded Prefect database {db} is damaged ({why})"
    print(f"{head}; {moved}. Only Prefect's run history is lost: {kept}", file=err, flush=True)
    return aside
