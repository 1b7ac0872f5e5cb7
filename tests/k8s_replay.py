"""A stand-in Kubernetes API server for the launcher's tests: it answers the real `kubernetes`
client's requests from recorded responses and records what the client sent.

The responses are files under tests/data/k8s/ shaped exactly like the API server's (Job, Pod
list, Service, Status objects; tests/test_k8s_launcher.py validates each one against the
Kubernetes 1.37 OpenAPI schema) and pod logs as the kubelet streams them (`timestamps=true`:
an RFC 3339 stamp, a space, the line), sent chunked as a follow stream is.

A route is a method and a path; its replies are served in order, the last one repeated, so a
test scripts a Job's life as the sequence of states the launcher reads.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

DATA = Path(__file__).parent / "data" / "k8s"

# The names every recorded response uses: stage `sft`, this fingerprint and launch id.
STAGE = "sft"
FINGERPRINT = "3f9a1c0d2b7e4a65"
LAUNCH_ID = "5e7b9d21c4a84f0e9b3d6a7c2e1f0a9b"
FLOW_RUN_ID = "0b6f3c2e-8d41-4f7a-9c55-2a1e7d9b4c10"
JOB = "sft-3f9a1c0d-5e7b9d21"
NAMESPACE = "training"
WORKSPACE = "/mnt/posttrain/workspace"
POD0 = f"{JOB}-0-x7k2p"
POD1 = f"{JOB}-1-q9m4t"


def load(name: str) -> Any:
    """A recorded object (`name`.json)."""
    return json.loads((DATA / f"{name}.json").read_text())


@dataclass
class Reply:
    status: int = 200
    body: Any = None  # a dict (JSON) or text
    # Text sent as separate chunks, `pause_s` apart (a log follow stream).
    chunks: list[str] | None = None
    pause_s: float = 0.0


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    body: Any


@dataclass
class ReplayServer:
    routes: dict[tuple[str, str], list[Reply]] = field(default_factory=dict)
    requests: list[Request] = field(default_factory=list)

    def add(self, method: str, path: str, *replies: Reply) -> None:
        self.routes[(method, path)] = list(replies)

    def sent(self, method: str, path: str) -> list[Request]:
        return [r for r in self.requests if r.method == method and r.path == path]

    def _reply(self, method: str, path: str) -> Reply:
        replies = self.routes.get((method, path))
        if not replies:
            return Reply(404, status_object(404, "NotFound", f"no route {method} {path}"))
        return replies.pop(0) if len(replies) > 1 else replies[0]

    def __enter__(self) -> str:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def _serve(self) -> None:
                url = urlsplit(self.path)
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                body = json.loads(raw) if raw else None
                server.requests.append(Request(self.command, url.path, parse_qs(url.query), body))
                reply = server._reply(self.command, url.path)
                if reply.chunks is not None:
                    self.send_response(reply.status)
                    self.send_header("Content-Type", "text/plain")
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    for chunk in reply.chunks:
                        data = chunk.encode()
                        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                        self.wfile.flush()
                        time.sleep(reply.pause_s)
                    self.wfile.write(b"0\r\n\r\n")
                    return
                data = (
                    json.dumps(reply.body).encode()
                    if not isinstance(reply.body, str)
                    else reply.body.encode()
                )
                self.send_response(reply.status)
                self.send_header(
                    "Content-Type",
                    "text/plain" if isinstance(reply.body, str) else "application/json",
                )
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_DELETE = do_PATCH = do_PUT = _serve

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, args=(0.05,), daemon=True)
        self._thread.start()
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def __exit__(self, *exc: object) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


def status_object(code: int, reason: str, message: str) -> dict[str, Any]:
    """A `Status` as the API server sends with an error."""
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def api_client(host: str) -> Any:
    """The real client, talking to the replay server."""
    from kubernetes import client

    configuration = client.Configuration(host=host)
    return client.ApiClient(configuration)


JOBS = f"/apis/batch/v1/namespaces/{NAMESPACE}/jobs"
SERVICES = f"/api/v1/namespaces/{NAMESPACE}/services"
PODS = f"/api/v1/namespaces/{NAMESPACE}/pods"
