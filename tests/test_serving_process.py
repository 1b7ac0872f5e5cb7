"""The rollout server's process, its HTTP client and its weight folders (posttrain.serving):
real processes, a real HTTP server of the test's own, a real tiny model and adapter."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import psutil
import pytest
import torch
from fixtures_tiny import TinyAssets, load_base, tiny_assets
from peft import PeftModel
from safetensors.torch import load_file

from posttrain.serving.client import ServerClient, ServerFailed
from posttrain.serving.process import ServerProcess, fill_command, last_line, stop_leftover
from posttrain.serving.weights import adapter_version, merge_into, servable_base


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyAssets:
    return tiny_assets(tmp_path_factory)


def test_fill_command_fills_placeholders_and_finds_the_program_beside_python() -> None:
    argv = fill_command("python -c 'print(1)' --port {port} --host {host} {model}", "h", 7, "/m")
    assert Path(argv[0]).name.startswith("python") and Path(argv[0]).is_absolute()
    assert argv[1:] == ["-c", "print(1)", "--port", "7", "--host", "h", "/m"]
    assert fill_command(["python", "{port}"], "h", 9, "m")[1:] == ["9"]
    with pytest.raises(ValueError, match="'no-such-server' is not on PATH nor beside"):
        fill_command("no-such-server --port {port}", "h", 1, "m")


def test_last_line_skips_colours_and_progress_bars(tmp_path: Path) -> None:
    log = tmp_path / "s.log"
    assert last_line(log) is None
    log.write_text("starting\n\x1b[32mINFO\x1b[0m: loading 10%\rloading 100%\n\n")
    assert last_line(log) == "loading 100%"


# A parent that starts a child in its own process group, both sleeping: what a server with an
# engine process (vLLM, SGLang) looks like. It prints the child's PID.
TREE = (
    "import subprocess, sys, time; "
    "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
    "print(c.pid, flush=True); time.sleep(120)"
)


def _child_of(log: Path) -> int:
    """The PID the tree printed into its log (after the lines the stage writes there)."""
    for _ in range(200):
        lines = log.read_text().splitlines() if log.exists() else []
        printed = [x for x in lines if x.strip().isdigit()]
        if printed:
            return int(printed[0])
        time.sleep(0.05)
    raise AssertionError("the tree did not start")


@pytest.fixture(autouse=True)
def _no_tree_left() -> Iterator[None]:
    """A failed test must not leave its sleeping tree behind."""
    yield
    for p in psutil.process_iter(["cmdline"]):
        if "time.sleep(120)" in " ".join(p.info["cmdline"] or []):
            with contextlib.suppress(psutil.Error):
                p.kill()


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_stop_ends_the_whole_process_tree_and_its_record(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    record = logs / "rollout-server.json"
    proc = ServerProcess.start([sys.executable, "-c", TREE], {}, logs / "s.log", record)
    child = _child_of(logs / "s.log")
    assert json.loads(record.read_text())["pid"] == proc.proc.pid
    assert os.getpgid(child) == proc.proc.pid  # its own group, led by the server
    assert proc.exit_reason() is None
    proc.stop(grace_s=5)
    assert _gone(proc.proc.pid) and _gone(child) and not record.exists()
    assert proc.exit_reason() == "its process exited with code 0"  # stopped cleanly


def test_a_server_that_dies_says_how(tmp_path: Path) -> None:
    """The keeper exits the way its server did: a code, or the signal that killed it."""
    for code, why in (
        ("import sys; sys.exit(3)", "its process exited with code 3"),
        ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", "killed by SIGKILL"),
    ):
        proc = ServerProcess.start(
            [sys.executable, "-c", code], {}, tmp_path / "s.log", tmp_path / "r.json"
        )
        proc.proc.wait(timeout=30)
        assert why in (proc.exit_reason() or "")
        proc.stop()


def test_the_server_dies_with_the_process_that_started_it(tmp_path: Path) -> None:
    """SIGKILL of the stage (no `finally` runs): the parent-death signal reaches the keeper,
    which ends the server and the server's own children."""
    script = (
        "import sys, time; from pathlib import Path; "
        "from posttrain.serving.process import ServerProcess; "
        f"p = ServerProcess.start([sys.executable, '-c', {TREE!r}], {{}}, "
        f"Path({str(tmp_path / 's.log')!r}), Path({str(tmp_path / 'r.json')!r})); "
        "print(p.proc.pid, flush=True); time.sleep(120)"
    )
    stage = psutil.Popen([sys.executable, "-c", script], stdout=-1, text=True)
    server = int(stage.stdout.readline())
    child = _child_of(tmp_path / "s.log")
    stage.send_signal(signal.SIGKILL)
    stage.wait()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and not (_gone(server) and _gone(child)):
        time.sleep(0.1)
    assert _gone(server) and _gone(child)  # the keeper took its whole group down


def _kept_sleeper(
    tmp_path: Path, attempt: int, spin: bool
) -> tuple[ServerProcess, psutil.Process, psutil.Process]:
    """A sleeping "server" under its keeper: (the ServerProcess, the keeper, the server), as
    soon as the keeper has forked it. `spin`: poll without sleeping (to catch the keeper's
    first milliseconds after the fork)."""
    proc = ServerProcess.start(
        [sys.executable, "-c", "import time; time.sleep(120)"],
        {},
        tmp_path / f"s{attempt}.log",
        tmp_path / f"r{attempt}.json",
    )
    keeper = psutil.Process(proc.proc.pid)
    deadline = time.monotonic() + 30
    while not keeper.children() and time.monotonic() < deadline:
        if not spin:
            time.sleep(0.01)
    return proc, keeper, keeper.children()[0]


def test_a_keeper_signalled_as_its_server_starts_still_ends_it(tmp_path: Path) -> None:
    """SIGTERM the moment the keeper's server process exists (the stage dying just after it
    started its server): the keeper's handlers are in place before the fork, so the server
    ends with it instead of living on, orphaned."""
    for attempt in range(5):
        proc, keeper, server = _kept_sleeper(tmp_path, attempt, spin=True)
        keeper.send_signal(signal.SIGTERM)
        server.wait(timeout=20)  # raises if the server outlives its keeper
        proc.proc.wait(timeout=20)


# Signals SIGTERM, SIGHUP and SIGINT to the PID in argv[1] for 0.3 s, as fast as it can.
STORM = (
    "import os, signal, sys, time\n"
    "end = time.monotonic() + 0.3\n"
    "while time.monotonic() < end:\n"
    "    try:\n"
    "        for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):\n"
    "            os.kill(int(sys.argv[1]), s)\n"
    "    except ProcessLookupError:\n"
    "        break\n"
)


# Slow: ten keepers with their servers started and stormed with signals (~5-10 s).
@pytest.mark.slow
def test_a_burst_of_signals_still_ends_the_keeper_and_its_server(tmp_path: Path) -> None:
    """Several signals at once (the parent-death SIGTERM with a SIGHUP or SIGINT): each
    handler runs inside the one before it. A handler that took a lock (threading.Event.set)
    deadlocked on the lock the interrupted one held, and the server ran on; found hung in a
    stage test with two nested `stopping.set()` frames."""
    for attempt in range(10):
        proc, keeper, server = _kept_sleeper(tmp_path, attempt, spin=False)
        time.sleep(0.2)  # the keeper is in child.wait()
        subprocess.run([sys.executable, "-c", STORM, str(keeper.pid)], check=True, timeout=30)
        server.wait(timeout=20)  # raises if the keeper hung with its server running
        proc.proc.wait(timeout=20)


def test_a_next_attempt_stops_what_an_earlier_one_left(tmp_path: Path) -> None:
    record = tmp_path / "rollout-server.json"
    assert stop_leftover(record) is None
    proc = ServerProcess.start([sys.executable, "-c", TREE], {}, tmp_path / "s.log", record)
    child = _child_of(tmp_path / "s.log")
    said = stop_leftover(record)
    assert said == (
        f"stopped the rollout server an earlier attempt left running (pid {proc.proc.pid})"
    )
    proc.proc.wait(timeout=5)
    assert _gone(child) and not record.exists()
    # A record whose PID now belongs to another process (another start time) is left alone.
    record.write_text(json.dumps({"pid": os.getpid(), "start": 1.0}))
    assert stop_leftover(record) is None and not record.exists()


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass

    def _send(self, code: int, body: str, kind: str = "application/json") -> None:
        data = body.encode()
        self.send_response(code)
        self.send_header("content-type", kind)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802
        self._send(200 if self.path == "/health" else 404, '{"status": "ok"}')

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("content-length", 0)))
        if self.path == "/fail":
            self._send(500, '{"error": "CUDA out of memory"}')
        elif self.path == "/slow":
            time.sleep(3)
            self._send(200, "{}")
        elif self.path == "/sse-error":
            events = 'data: {"status": "loading"}\n\ndata: {"status": "error", "message": "x"}\n\n'
            self._send(200, events, "text/event-stream")
        elif self.path == "/sse":
            self._send(200, 'data: {"status": "loading"}\n\ndata: {"status": "ready"}\n\n',
                       "text/event-stream")  # fmt: skip
        else:
            self._send(200, '{"ok": 1}')


@pytest.fixture
def http() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_every_failure_is_one_line_naming_the_server_and_what_it_said(http: str) -> None:
    client = ServerClient(http, timeout_s=1.0, concurrency=2)
    assert client.post("/ok", {}) == {"ok": 1}
    assert client.post_many("/ok", [{}, {}, {}]) == [{"ok": 1}] * 3
    assert client.post("/sse", {}) == {"status": "ready"}
    with pytest.raises(ServerFailed) as e:
        client.post("/fail", {})
    assert str(e.value) == (
        f"rollout server {http} answered /fail with HTTP 500; it last said: "
        '{"error": "CUDA out of memory"}'
    )
    with pytest.raises(ServerFailed, match=r"did not answer /slow within 1 s"):
        client.post("/slow", {})
    with pytest.raises(ServerFailed, match="with an error event"):
        client.post("/sse-error", {})
    client.close()
    logged = ServerClient(http, 1.0, 1, last_said=lambda: "Killed (its process exited)")
    with pytest.raises(ServerFailed, match=r"it last said: Killed \(its process exited\)"):
        logged.post("/fail", {})
    logged.close()


def test_a_server_that_is_not_there_fails_fast(tmp_path: Path) -> None:
    from posttrain.distributed.runtime import free_port

    url = f"http://127.0.0.1:{free_port()}"
    client = ServerClient(url, timeout_s=30.0, concurrency=1)
    t = time.monotonic()
    with pytest.raises(ServerFailed, match=f"rollout server {url} cannot be reached"):
        client.post("/v1/completions", {})
    assert time.monotonic() - t < 5
    with pytest.raises(ServerFailed, match="did not come up: its process exited with code 1"):
        client.wait_healthy("/health", 30, lambda: "its process exited with code 1", lambda: None)
    with pytest.raises(ServerFailed, match="not healthy at /health within 0.3 s"):
        client.wait_healthy("/health", 0.3, lambda: None, lambda: None)
    client.close()


def test_version_folders_hold_the_adapter_and_the_base(tiny: TinyAssets, tmp_path: Path) -> None:
    base = servable_base(tmp_path / "base", tiny.base_dir, tiny.base_dir)
    assert (base / "config.json").is_symlink() and (base / "model.safetensors").is_symlink()
    assert (base / "tokenizer.json").exists()
    folder = adapter_version(tmp_path / "policy-v1", tiny.adapter_trained, base)
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(base.resolve())
    assert (folder / "model.safetensors").resolve() == (tiny.base_dir / "model.safetensors")
    alone = adapter_version(tmp_path / "policy-v2", tiny.adapter_trained, None)
    assert sorted(p.name for p in alone.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]


def test_merged_weights_equal_peft_merging_the_adapter(tiny: TinyAssets, tmp_path: Path) -> None:
    base = servable_base(tmp_path / "base", tiny.base_dir, tiny.base_dir)
    folder = merge_into(tmp_path / "policy-v1", base, tiny.adapter_trained)
    want = PeftModel.from_pretrained(load_base(tiny), str(tiny.adapter_trained)).merge_and_unload()
    got = load_file(str(folder / "model.safetensors"))
    state = want.state_dict()
    assert set(got) <= set(state)
    changed = 0
    for k, v in got.items():
        torch.testing.assert_close(v, state[k], atol=1e-6, rtol=1e-5)
        changed += not torch.equal(v, load_file(str(base / "model.safetensors"))[k])
    assert changed > 0 and (folder / "config.json").is_symlink()
