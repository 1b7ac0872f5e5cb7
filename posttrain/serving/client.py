"""HTTP to the rollout server, with every wait bounded and every failure one line.

A request that is refused, times out (`rollout.server.request_timeout_s`) or answers with an
error fails the stage with `ServerFailed`: the URL, what went wrong, and the last thing the
server said (the last line of its log when the stage started it, else its last answer). Trainer
and server hanging on each other is the failure RL users report most after OOM; here no wait is
longer than the timeout.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from posttrain.errors import StageVerdict

# One INFO line per request would bury the stage's log.
logging.getLogger("httpx").setLevel(logging.WARNING)


class ServerFailed(StageVerdict):
    """The rollout server died, stopped answering, or answered with an error."""


class ServerClient:
    """POSTs to one server, `concurrency` at a time. `last_said()` (the server's log, when the
    stage runs it) names what the server last said in an error; without it, its last answer.
    `what` names the server in errors (a judge's client is not the rollout server's);
    `headers` go with every request (a judge's API key)."""

    def __init__(
        self,
        url: str,
        timeout_s: float,
        concurrency: int,
        last_said: Callable[[], str | None] | None = None,
        what: str = "rollout server",
        headers: dict[str, str] | None = None,
    ) -> None:
        self.url, self.timeout_s, self.concurrency = url.rstrip("/"), timeout_s, concurrency
        self.what = what
        self._last_said = last_said
        self._last_answer = ""
        self._lock = threading.Lock()
        self._http = httpx.Client(
            timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 10.0)),
            limits=httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency),
            headers=headers,
        )
        self._pool = ThreadPoolExecutor(concurrency, thread_name_prefix="rollout-server")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._http.close()

    def last_said(self) -> str:
        said = self._last_said() if self._last_said is not None else None
        return said or self._last_answer or "nothing"

    def failed(self, what: str) -> ServerFailed:
        return ServerFailed(
            f"{self.what} {self.url} {what}; it last said: {self.last_said()[-300:]}"
        )

    def _note(self, text: str) -> None:
        with self._lock:
            self._last_answer = " ".join(text.split())[:300]

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """One POST's JSON answer (an SSE stream's last event for a streaming endpoint)."""
        try:
            r = self._http.post(self.url + path, json=body)
        except httpx.TimeoutException:
            raise self.failed(f"did not answer {path} within {self.timeout_s:g} s") from None
        except httpx.HTTPError as e:
            raise self.failed(f"cannot be reached ({path}: {type(e).__name__}: {e})") from None
        self._note(r.text)
        if r.status_code >= 400:
            raise self.failed(f"answered {path} with HTTP {r.status_code}")
        if r.headers.get("content-type", "").startswith("text/event-stream"):
            return self._last_event(path, r.text)
        try:
            return r.json() if r.content else {}
        except json.JSONDecodeError:
            raise self.failed(f"answered {path} with something that is not JSON") from None

    def _last_event(self, path: str, text: str) -> dict[str, Any]:
        """The last `data:` event of a finished SSE answer; an event that reports an error
        (`transformers serve`'s `/load_model`) fails."""
        events = [json.loads(x[5:]) for x in text.splitlines() if x.startswith("data:")]
        for e in events:
            if isinstance(e, dict) and (e.get("status") == "error" or "error" in e):
                raise self.failed(f"answered {path} with an error event: {json.dumps(e)[:300]}")
        return events[-1] if events else {}

    def post_many(self, path: str, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Every body POSTed, up to `concurrency` at once; the answers in order. The first
        failure fails the call (the others are left to finish or time out)."""
        return list(self._pool.map(lambda b: self.post(path, b), bodies))

    def healthy(self, path: str) -> bool:
        try:
            r = self._http.get(self.url + path, timeout=5.0)
        except httpx.HTTPError:
            return False
        self._note(r.text)
        return r.status_code == 200

    def wait_healthy(
        self,
        path: str,
        timeout_s: float,
        alive: Callable[[], str | None],
        beat: Callable[[], None],
        field: str = "rollout.server.startup_timeout_s",
    ) -> float:
        """Poll `path` until it answers 200 -> seconds waited. `alive()` returns why the server
        can no longer come up (its process ended) or None; `beat` keeps the stage's heartbeat
        going through a long start (loading a large model); `field` names the timeout."""
        t0 = time.monotonic()
        for wait in _backoff():
            if self.healthy(path):
                return time.monotonic() - t0
            if (why := alive()) is not None:
                raise self.failed(f"did not come up: {why}")
            if time.monotonic() - t0 > timeout_s:
                raise self.failed(f"was not healthy at {path} within {timeout_s:g} s ({field})")
            beat()
            time.sleep(wait)
        raise AssertionError("unreachable")


def _backoff() -> Iterator[float]:
    wait = 0.1
    while True:
        yield wait
        wait = min(2.0, wait * 1.5)
