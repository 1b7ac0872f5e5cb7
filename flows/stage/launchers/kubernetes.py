"""The Kubernetes launcher: a stage as an Indexed Job with a headless Service, through the
Kubernetes API (the official `kubernetes` client; extra `pip install posttrain[kubernetes]`).

`start` submits the Job (`k8s_manifests`), then its Service (owned by the Job). The returned
`KubernetesLaunch` reads the Job and its pods every `infra.kubernetes.poll_s` seconds (shared by
every caller), follows each pod's log once its container started, and ends the stage by deleting
the Job in the foreground: SIGTERM, then SIGKILL after the grace period, in every pod.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import queue
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from flows.stage.launchers.base import LaunchError, LaunchRequest, Log, poll_after
from flows.stage.launchers.k8s_manifests import (
    COMPLETION_INDEX_ANNOTATION,
    CONTAINER,
    FLOW_RUN_LABEL,
    LAUNCH_LABEL,
    JobPlan,
    plan_job,
    sanitize_label,
)
from posttrain.sections.kubernetes import KubernetesConfig

try:
    from kubernetes import client as k8s
    from kubernetes.client.exceptions import ApiException
except ImportError:  # the extra is not installed: say so when a launcher is made
    k8s = None  # type: ignore[assignment]
    ApiException = Exception  # type: ignore[assignment,misc]

_log = logging.getLogger("posttrain.kubernetes")
# Pod container reasons that are the program's own ending, not the engine's.
_OWN_ENDINGS = {"Completed", "Error"}


def api_client(config: KubernetesConfig, connections: int = 16) -> Any:
    """An ApiClient for `config.context`: in-cluster credentials in a pod with no context named,
    else the kubeconfig's. `connections`: pool size (a log stream per pod, the status reads)."""
    _need_client()
    import os

    from kubernetes import config as kube_config
    from kubernetes.config.config_exception import ConfigException

    configuration = k8s.Configuration()
    try:
        if config.context is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
            kube_config.load_incluster_config(client_configuration=configuration)
        else:
            kube_config.load_kube_config(context=config.context, client_configuration=configuration)
    except (ConfigException, OSError) as exc:
        raise LaunchError(f"Kubernetes: no usable credentials ({exc})") from None
    configuration.connection_pool_maxsize = max(configuration.connection_pool_maxsize, connections)
    return k8s.ApiClient(configuration)


def _need_client() -> None:
    if k8s is None:
        raise LaunchError(
            "infra.launcher kubernetes needs the Kubernetes client: pip install 'posttrain[kubernetes]'"
        )


def api_message(exc: Exception) -> str:
    """The API server's own words for a refused request (its Status object's message)."""
    status = getattr(exc, "status", None)
    body = getattr(exc, "body", None)
    message = None
    if body:
        with contextlib.suppress(ValueError, TypeError):
            message = json.loads(body).get("message")
    if message is None:
        message = getattr(exc, "reason", None) or str(exc)
    return f"{message} (HTTP {status})" if status else str(message)


class KubernetesLauncher:
    """Runs each stage as an Indexed Job + headless Service in `config.namespace`; `device`,
    `workspace` as for `plan_job`; `client`: an `ApiClient` instead of the kubeconfig's."""

    name = "kubernetes"

    def __init__(
        self,
        config: KubernetesConfig,
        device: str,
        workspace: Path | str | None = None,
        client: Any = None,
    ) -> None:
        _need_client()
        self.config = config
        self.device = device
        self.workspace = Path(workspace) if workspace is not None else None
        self._client = client

    @classmethod
    def from_infra(cls, infra: dict[str, Any]) -> KubernetesLauncher:
        config = KubernetesConfig.model_validate(infra.get("kubernetes") or {})
        return cls(config, str(infra.get("device", "cpu")))

    def _api(self, connections: int = 16) -> Any:
        if self._client is None:
            self._client = api_client(self.config, connections)
        return self._client

    def start(self, request: LaunchRequest, log: Log) -> KubernetesLaunch:
        try:
            plan = plan_job(request, self.config, self.device, self.workspace)
        except ValueError as exc:
            raise LaunchError(str(exc)) from None
        client = self._api(connections=plan.nnodes + 4)
        batch, core = k8s.BatchV1Api(client), k8s.CoreV1Api(client)
        _write_manifests(request.log_dir, plan, self.config)
        ns = plan.namespace
        try:
            # Strict: an unknown field is refused (422), not dropped with a warning.
            job = batch.create_namespaced_job(ns, plan.job, field_validation="Strict")
        except ApiException as exc:
            raise LaunchError(
                f"Kubernetes refused Job {ns}/{plan.name}: {api_message(exc)}"
            ) from None
        # The Service after the Job, to own it by the Job's uid. Pod 0 finds itself in its
        # /etc/hosts whatever DNS says; the others retry the rendezvous until the name resolves.
        try:
            core.create_namespaced_service(
                ns, plan.service(job.metadata.uid, self.config.rdzv_port), field_validation="Strict"
            )
        except ApiException as exc:
            with contextlib.suppress(ApiException):
                batch.delete_namespaced_job(plan.name, ns, propagation_policy="Background")
            raise LaunchError(
                f"Kubernetes refused Service {ns}/{plan.name} (the Job was deleted): "
                f"{api_message(exc)}"
            ) from None
        what = f"Kubernetes Job {ns}/{plan.name} ({plan.nnodes} pod(s), {plan.gpus} GPU(s) each)"
        log.info("stage %s: submitted %s", request.stage.name, what)
        return KubernetesLaunch(
            client, self.config, plan.name, ns, plan.labels[LAUNCH_LABEL], plan.nnodes
        )

    def find(self, record: dict[str, str], log: Log) -> KubernetesLaunch | None:
        """The Job `record` names if it still runs or waits (a flow that died left it)."""
        name, ns, launch = record.get("job", ""), record.get("namespace", ""), record.get("launch")
        if not (name and ns and launch):
            return None
        try:
            client = self._api()
            job = k8s.BatchV1Api(client).read_namespaced_job(name, ns)
        except ApiException as exc:
            if exc.status != 404:
                log.warning("could not read Kubernetes Job %s/%s: %s", ns, name, api_message(exc))
            return None
        except LaunchError as exc:
            log.warning("could not reach Kubernetes for Job %s/%s: %s", ns, name, exc)
            return None
        conditions = (job.status and job.status.conditions) or []
        if any(c.type in ("Complete", "Failed") and c.status == "True" for c in conditions):
            return None
        return KubernetesLaunch(client, self.config, name, ns, launch, int(record.get("nnodes", 1)))


def _write_manifests(log_dir: Path, plan: JobPlan, config: KubernetesConfig) -> None:
    # What was submitted, beside the stage's log: `kubectl apply -f` reproduces it by hand.
    with contextlib.suppress(OSError):
        log_dir.mkdir(parents=True, exist_ok=True)
        path = log_dir / f"k8s-{plan.name}.json"
        items = [plan.job, plan.service(None, config.rdzv_port)]
        path.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": items}, indent=1))


class KubernetesLaunch:
    """One submitted Job. Thread-safe (the supervisor polls while another thread reads
    `output()`); the Job and its pods are read at most once per `poll_s`, never after the end."""

    def __init__(
        self,
        client: Any,
        config: KubernetesConfig,
        name: str,
        namespace: str,
        launch: str,
        nnodes: int,
    ) -> None:
        self.name, self.namespace, self.nnodes = name, namespace, nnodes
        self.description = f"Kubernetes Job {namespace}/{name} ({nnodes} pod(s))"
        self.record = {"job": name, "namespace": namespace, "launch": launch, "nnodes": str(nnodes)}
        self._batch = k8s.BatchV1Api(client)
        self._core = k8s.CoreV1Api(client)
        self._poll_s = config.poll_s
        self._grace_s = config.termination_grace_s
        self._selector = f"{LAUNCH_LABEL}={launch}"
        self._lock = threading.Lock()
        self._read_at = float("-inf")
        self._job: Any = None
        self._job_gone = False
        self._pods: list[Any] = []
        self._started = False
        self._stopped = False
        self._final: int | None = None  # the exit status, once ended
        self._api_error: str | None = None

    def _refresh(self, force: bool = False) -> None:
        with self._lock:
            if not force and (
                self._final is not None or time.monotonic() - self._read_at < self._poll_s
            ):
                return
            self._read_at = time.monotonic()
            try:
                try:
                    self._job = self._batch.read_namespaced_job(self.name, self.namespace)
                except ApiException as exc:
                    if exc.status != 404:
                        raise
                    self._job_gone = True
                pods = self._core.list_namespaced_pod(
                    self.namespace, label_selector=self._selector
                ).items
                self._pods = sorted(pods, key=_index)
                self._api_error = None
            except Exception as exc:  # a flaky API must not end the watch
                message = api_message(exc) if isinstance(exc, ApiException) else repr(exc)
                if message != self._api_error:
                    _log.warning("%s: reading its state failed: %s", self.description, message)
                self._api_error = message

    def _condition(self, *types: str) -> Any | None:
        conditions = (self._job and self._job.status and self._job.status.conditions) or []
        return next((c for c in conditions if c.type in types and c.status == "True"), None)

    def _active_pods(self) -> list[Any]:
        return [p for p in self._pods if (p.status.phase or "Pending") in ("Pending", "Running")]

    def _ended(self) -> bool:
        final = self._condition("Complete", "Failed") or self._job_gone
        return bool(final) and not self._active_pods()

    def started(self) -> bool:
        if not self._started:
            self._refresh()
            running = {_index(p) for p in self._pods if _container_started(p)}
            self._started = len(running) >= self.nnodes or self._ended()
        return self._started

    def waiting_reason(self) -> str | None:
        if self.started():
            return None
        running = sum(_container_started(p) for p in self._pods)
        reasons = [f"{running} of {self.nnodes} pods running"]
        if len(self._pods) < self.nnodes:
            reasons.append(f"{len(self._pods)} of {self.nnodes} pods created")
        if self._job is not None and self._job.spec and self._job.spec.suspend:
            reasons.append("the Job is suspended (waiting for admission, e.g. by Kueue)")
        for pod in self._pods:
            if why := _pending_reason(pod):
                reasons.append(f"pod {pod.metadata.name} {why}")
        if self._api_error:
            reasons.append(f"the API: {self._api_error}")
        return "Kubernetes: " + "; ".join(reasons)

    def poll(self) -> int | None:
        if self._final is not None:
            return self._final
        self._refresh()
        if not self._ended():
            return None
        if self._condition("Complete"):
            self._final = 0
        else:
            failed = _first_failure(self._pods)
            code = _exit_code(failed) if failed is not None else None
            self._final = code if code else 1
        return self._final

    def wait(self, timeout_s: float) -> int | None:
        return poll_after(self, self._read_at + self._poll_s, timeout_s)

    def engine_reason(self) -> str | None:
        self._refresh()
        reasons: list[str] = []
        for pod in self._pods:
            if (why := _engine_ending(pod)) is not None:
                reasons.append(f"pod {pod.metadata.name} {why}")
        deadline = self._condition("Failed")
        if deadline is not None and deadline.reason == "DeadlineExceeded":
            reasons.insert(0, f"Job {self.name} DeadlineExceeded: {deadline.message}")
        if self._job_gone and not self._stopped and not self._condition("Complete", "Failed"):
            reasons.append(f"Job {self.name} was deleted while it ran")
        return "Kubernetes: " + "; ".join(reasons) if reasons else None

    def stop(self, grace_s: float, log: Log) -> None:
        """Delete the Job (foreground: pods first, SIGTERM then SIGKILL) and the Service, then
        wait until no pod is left; pods still there after the grace (an unreachable node) are
        deleted with no grace. An ended Job stays for `ttl_seconds_after_finished`."""
        if self.poll() is not None:
            return
        self._stopped = True
        ns, name = self.namespace, self.name
        grace = max(0, int(grace_s))
        foreground = {"propagation_policy": "Foreground", "grace_period_seconds": grace}
        job = functools.partial(self._batch.delete_namespaced_job, name, ns, **foreground)
        service = functools.partial(self._core.delete_namespaced_service, name, ns)
        for what, delete in (("Job", job), ("Service", service)):
            try:
                delete()
            except ApiException as exc:
                if exc.status != 404:
                    failed = f"deleting the {what} failed: {api_message(exc)}"
                    log.error("%s: %s", self.description, failed)
        forced = False
        patience = grace + self._grace_s + 5.0
        stop_at = time.monotonic() + patience + 60.0
        begun = time.monotonic()
        while True:
            self._refresh(force=True)
            if not self._pods and self._api_error is None:
                return
            if time.monotonic() > stop_at:
                names, took = (
                    ", ".join(p.metadata.name for p in self._pods),
                    time.monotonic() - begun,
                )
                left = f"{len(self._pods)} pod(s) still there {took:.0f} s after deletion: {names}"
                log.error("%s: %s", self.description, left)
                return
            if not forced and time.monotonic() - begun > patience:
                forced = True
                for pod in self._pods:
                    with contextlib.suppress(ApiException):
                        self._core.delete_namespaced_pod(
                            pod.metadata.name, ns, grace_period_seconds=0
                        )
            time.sleep(min(self._poll_s, 1.0))

    def dump_stacks(self, hang: Any, out_dir: Path) -> list[Path]:
        # Signalling a process in a pod needs `exec` rights, which this launcher does not ask
        # for: the hang is reported from the heartbeats alone.
        return []

    def output(self) -> Iterator[str]:
        """Every pod's log, lines prefixed `[node k] `, until every pod ended and was read."""
        lines: queue.Queue[str] = queue.Queue()
        followers: dict[str, threading.Thread] = {}
        while True:
            self._refresh()
            for pod in list(self._pods):
                if (name := pod.metadata.name) not in followers and _container_started(pod):
                    args = (name, _index(pod), lines)
                    followers[name] = threading.Thread(target=self._follow, args=args, daemon=True)
                    followers[name].name = f"k8s-log-{name}"
                    followers[name].start()
            with contextlib.suppress(queue.Empty):
                yield lines.get(timeout=self._poll_s)
                while True:
                    yield lines.get_nowait()
            done = self._ended() or (self._stopped and not self._pods)
            if done and not any(t.is_alive() for t in followers.values()) and lines.empty():
                return

    def _follow(self, pod: str, index: int, lines: queue.Queue[str]) -> None:
        """Follow one pod's log into `lines`; a stream that drops while the container runs is
        reopened from the last line's timestamp, skipping what was read."""
        prefix = f"[node {index}] "
        last: tuple[datetime, int] | None = None  # newest timestamp read, lines read at it
        while True:
            since = None
            if last is not None:
                # A few seconds more than needed: the node's clock may differ from ours.
                since = int((datetime.now(UTC) - last[0]).total_seconds()) + 5
            try:
                since_s = max(1, since) if since is not None else None
                stream = {"follow": True, "timestamps": True, "_preload_content": False}
                response = self._core.read_namespaced_pod_log(
                    pod, self.namespace, container=CONTAINER, since_seconds=since_s, **stream
                )
                seen_at_last = 0
                for raw in _read_lines(response):
                    stamp, text = _split_timestamp(raw)
                    if last is not None and stamp is not None:
                        if stamp < last[0]:
                            continue
                        if stamp == last[0] and seen_at_last < last[1]:
                            seen_at_last += 1
                            continue
                    if stamp is not None:
                        count = last[1] + 1 if last is not None and stamp == last[0] else 1
                        last = (stamp, count)
                        seen_at_last = count
                    lines.put(prefix + text)
            except ApiException as exc:
                if exc.status in (400, 404):  # the pod (or its container) is gone
                    return
                _log.warning("%s: log of pod %s: %s", self.description, pod, api_message(exc))
            except Exception as exc:  # a dropped stream is reopened below
                _log.warning("%s: log of pod %s broke: %r", self.description, pod, exc)
            if self._stopped or not self._still_running(pod):
                return
            time.sleep(self._poll_s)

    def _still_running(self, pod: str) -> bool:
        try:
            status = self._core.read_namespaced_pod(pod, self.namespace).status
        except ApiException as exc:
            return exc.status != 404
        return (status.phase or "Pending") in ("Pending", "Running")


def cancel_flow_run_jobs(
    flow_run_id: str, config: KubernetesConfig | dict[str, Any], client: Any = None
) -> int:
    """Delete every Job (and Service) labelled with the flow run, for the flow's cancellation
    and crash hooks; returns how many Jobs. `config`: `infra.kubernetes`, or infra as JSON."""
    _need_client()
    if isinstance(config, dict):
        config = KubernetesConfig.model_validate(config.get("kubernetes") or {})
    client = client or api_client(config)
    batch, core = k8s.BatchV1Api(client), k8s.CoreV1Api(client)
    selector = f"{FLOW_RUN_LABEL}={sanitize_label(flow_run_id)}"
    ns = config.namespace
    deleted = 0
    try:
        foreground = {
            "propagation_policy": "Foreground",
            "grace_period_seconds": config.termination_grace_s,
        }
        for job in batch.list_namespaced_job(ns, label_selector=selector).items:
            with contextlib.suppress(ApiException):
                batch.delete_namespaced_job(job.metadata.name, ns, **foreground)
                deleted += 1
        for service in core.list_namespaced_service(ns, label_selector=selector).items:
            with contextlib.suppress(ApiException):
                core.delete_namespaced_service(service.metadata.name, ns)
    except ApiException as exc:
        raise LaunchError(
            f"Kubernetes: could not delete the Jobs of flow run {flow_run_id}: {api_message(exc)}"
        ) from None
    return deleted


def _index(pod: Any) -> int:
    annotations = pod.metadata.annotations or {}
    labels = pod.metadata.labels or {}
    value = annotations.get(COMPLETION_INDEX_ANNOTATION, labels.get(COMPLETION_INDEX_ANNOTATION))
    try:
        return int(value)
    except (TypeError, ValueError):
        return -1


def _container(pod: Any) -> Any | None:
    statuses = (pod.status and pod.status.container_statuses) or []
    return next((s for s in statuses if s.name == CONTAINER), None)


def _container_started(pod: Any) -> bool:
    status = _container(pod)
    if status is None or status.state is None:
        return False
    return bool(status.state.running or status.state.terminated)


def _pending_reason(pod: Any) -> str | None:
    for condition in (pod.status and pod.status.conditions) or []:
        if condition.type == "PodScheduled" and condition.status == "False":
            return f"{condition.reason}: {condition.message}"
    status = _container(pod)
    waiting = status and status.state and status.state.waiting
    if waiting:
        return f"{waiting.reason}: {waiting.message}" if waiting.message else waiting.reason
    return None


def _terminated(pod: Any) -> Any | None:
    status = _container(pod)
    return status.state.terminated if status is not None and status.state else None


def _exit_code(pod: Any) -> int | None:
    terminated = _terminated(pod)
    return terminated.exit_code if terminated is not None else None


def _first_failure(pods: list[Any]) -> Any | None:
    # The pod that failed first is the cause; the others were ended because of it.
    failed = [p for p in pods if p.status.phase == "Failed"]

    def finished(pod: Any) -> datetime:
        terminated = _terminated(pod)
        at = terminated.finished_at if terminated is not None else None
        return at or datetime.max.replace(tzinfo=UTC)

    return min(failed, key=finished, default=None)


def _engine_ending(pod: Any) -> str | None:
    if pod.status.reason == "Evicted":
        return f"Evicted: {pod.status.message}"
    for condition in pod.status.conditions or []:
        if condition.type == "DisruptionTarget" and condition.status == "True":
            return f"{condition.reason}: {condition.message}"
    terminated = _terminated(pod)
    if terminated is not None and terminated.reason and terminated.reason not in _OWN_ENDINGS:
        # OOMKilled, ContainerCannotRun, StartError, DeadlineExceeded ...
        detail = f": {terminated.message}" if terminated.message else ""
        return f"{terminated.reason} (exit {terminated.exit_code}){detail}"
    return None


def _read_lines(response: Any) -> Iterator[str]:
    """The lines of a streamed response as they arrive (read1: no waiting for a full buffer)."""
    buffer = b""
    try:
        while chunk := response.read1(65536):
            buffer += chunk
            *complete, buffer = buffer.split(b"\n")
            for line in complete:
                yield line.decode("utf-8", errors="replace").rstrip("\r")
        if buffer:
            yield buffer.decode("utf-8", errors="replace").rstrip("\r")
    finally:
        response.release_conn()


def _split_timestamp(line: str) -> tuple[datetime | None, str]:
    """`2026-12-02T02:10:32.123456789Z text` -> (the time, `text`); the kubelet's RFC 3339
    stamp has up to nine fractional digits, which datetime keeps to six (enough to order)."""
    head, sep, text = line.partition(" ")
    if not sep or not head.endswith("Z") or "T" not in head:
        return None, line
    seconds, _, fraction = head[:-1].partition(".")
    try:
        stamp = datetime.fromisoformat(seconds).replace(tzinfo=UTC)
    except ValueError:
        return None, line
    micros = int((fraction + "000000")[:6]) if fraction.isdigit() else 0
    return stamp.replace(microsecond=micros), text
