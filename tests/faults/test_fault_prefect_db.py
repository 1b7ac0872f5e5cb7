"""A damaged embedded Prefect database is set aside with one line, and the run goes on."""

from __future__ import annotations

import io
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from flows.embedded_db import damage, set_aside_if_damaged
from tests.stage_helpers import ROOT, TINY, write_recipe


def _database(path: Path, rows: int = 2000) -> None:
    con = sqlite3.connect(path)
    con.execute("PRAGMA journal_mode=WAL")
    con.execute("CREATE TABLE flow_run (id INTEGER PRIMARY KEY, name TEXT)")
    con.executemany(
        "INSERT INTO flow_run (name) VALUES (?)", [(f"run-{i}" * 8,) for i in range(rows)]
    )
    con.commit()
    con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    con.close()


def _scribble(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(b"\x00not a b-tree page\xff" * 200)


def test_intact_missing_and_damaged_databases(tmp_path: Path) -> None:
    db = tmp_path / "prefect.db"
    assert damage(db) is None  # missing: the server creates it
    _database(db)
    assert damage(db) is None
    _scribble(db, 4096 * 3)  # a table page: the header still opens
    assert damage(db) is not None
    _scribble(db, 0)  # the header itself
    assert "not a database" in (damage(db) or "")


def test_damaged_database_is_moved_aside_with_its_wal_and_one_line(tmp_path: Path) -> None:
    db = tmp_path / "prefect.db"
    _database(db)
    (tmp_path / "prefect.db-wal").write_bytes(b"")
    err = io.StringIO()
    assert set_aside_if_damaged(err, db) is None and err.getvalue() == ""  # intact: untouched
    _scribble(db, 0)
    aside = set_aside_if_damaged(err, db)
    assert aside is not None and aside.is_file() and not db.exists()
    assert (tmp_path / f"{aside.name}-wal").exists() and not (tmp_path / "prefect.db-wal").exists()
    (line,) = err.getvalue().splitlines()
    assert line.startswith(f"posttrain: the embedded Prefect database {db} is damaged (")
    assert "moved it to prefect.db.damaged-" in line


def test_a_prefect_home_that_does_not_exist_yet_is_created(tmp_path: Path) -> None:
    """SQLite creates the database file but not its folder: a fresh nested PREFECT_HOME failed
    the embedded server's start ("unable to open database file") after a 2-minute timeout."""
    db = tmp_path / "not" / "yet" / "prefect.db"
    assert set_aside_if_damaged(io.StringIO(), db) is None
    assert db.parent.is_dir() and not db.exists()


@pytest.mark.slow
def test_run_on_a_damaged_embedded_database_starts_and_completes(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / "prefect.db").write_bytes(b"SQLite format 3\x00" + os.urandom(64 << 10))
    recipe = write_recipe(tmp_path, TINY)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "PYTEST"))}
    env.update(PREFECT_HOME=str(home), HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        # One stage is a whole run to the server: its flow and task runs, their states, its end.
        [sys.executable, "-m", "flows.cli", "run", str(recipe), "--until", "ingest",
         "ingest.from_config.pretrain_steps=2"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "is damaged (" in proc.stderr and "Traceback" not in proc.stderr
    assert list(home.glob("prefect.db.damaged-*"))
