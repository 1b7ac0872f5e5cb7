"""The objects the Kubernetes launcher submits for one stage, as plain dicts (batch/v1 Job and
core/v1 Service): pure functions of the launch request and the recipe, so tests validate them
against the Kubernetes OpenAPI schema without a cluster.

One stage = one Indexed Job (`completions = parallelism = nnodes`, one pod per node, the pod's
completion index is its node rank) and one headless Service whose name is the pods' subdomain,
so pod k is reachable at `<job>-k.<service>`; pod 0 hosts the c10d rendezvous. Every pod runs
the same command (`flows.stage.launch.stage_command`), its rank expanded by Kubernetes from
`$(POSTTRAIN_NODE_RANK)`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flows.stage.launch import NODE_RANK_ENV, planned_stage_command
from flows.stage.launchers.base import LaunchRequest
from posttrain.sections.kubernetes import KubernetesConfig

LABEL_PREFIX = "posttrain.io/"
STAGE_LABEL = LABEL_PREFIX + "stage"
LAUNCH_LABEL = LABEL_PREFIX + "launch"
# `LaunchRequest.labels` keys become `posttrain.io/<key>`; the flow run's id goes under this key,
# which `cancel_flow_run_jobs` selects on.
FLOW_RUN_KEY = "flow-run"
FLOW_RUN_LABEL = LABEL_PREFIX + FLOW_RUN_KEY
# Set by the Job controller on each pod of an Indexed Job: the pod's index = its node rank.
COMPLETION_INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
CONTAINER = "stage"
WORKSPACE_VOLUME = "workspace"
# Object names stay short enough that pod k's hostname `<job>-<k>` is a DNS label (63).
_NAME_MAX = 48


@dataclass(frozen=True)
class JobPlan:
    """What one launch submits: the Job and (`service`, once the Job's uid is known) its Service."""

    name: str  # of the Job and of the Service
    namespace: str
    labels: dict[str, str]
    command: list[str]
    job: dict[str, Any]
    gpus: int
    nnodes: int

    def service(self, job_uid: str | None, port: int) -> dict[str, Any]:
        """The headless Service of the pods, owned by the Job (so deleting the Job removes it)."""
        metadata: dict[str, Any] = {
            "name": self.name,
            "namespace": self.namespace,
            "labels": dict(self.labels),
        }
        if job_uid is not None:
            metadata["ownerReferences"] = [
                {"apiVersion": "batch/v1", "kind": "Job", "name": self.name, "uid": job_uid}
            ]
        return {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": metadata,
            "spec": {
                "clusterIP": "None",
                "selector": {LAUNCH_LABEL: self.labels[LAUNCH_LABEL]},
                # Pod 0's name must resolve before it is Ready (a training pod never reports
                # readiness): the other nodes dial the rendezvous while it starts.
                "publishNotReadyAddresses": True,
                "ports": [{"name": "rdzv", "port": port, "targetPort": port, "protocol": "TCP"}],
            },
        }


def sanitize_label(text: str) -> str:
    """`text` as a label name or value: letters, digits, '-', '_', '.', alphanumeric at both
    ends, at most 63 characters ("" when nothing is left)."""
    cleaned = re.sub(r"[^A-Za-z0-9_.-]+", "-", text)[:63]
    return cleaned.strip("-_.")


def job_name(stage: str, fingerprint: str, launch_id: str) -> str:
    """An RFC 1123 / 1035 name (lowercase, starts with a letter, at most 48 characters): the
    stage's name, its fingerprint's first 8 and the launch id's first 8 characters."""
    base = re.sub(r"[^a-z0-9-]+", "-", stage.lower()).strip("-") or "stage"
    if not base[0].isalpha():
        base = "s-" + base
    tail = f"-{fingerprint[:8].lower()}-{launch_id[:8].lower()}"
    return base[: _NAME_MAX - len(tail)].rstrip("-") + tail


def rdzv_endpoint(name: str, config: KubernetesConfig) -> str:
    """Pod 0's fully qualified name and the rendezvous port. Fully qualified: the kubelet writes
    exactly this name into pod 0's /etc/hosts, so torchrun on pod 0 knows it hosts the store
    without asking DNS (which may not have the record yet), and other pods resolve it."""
    host = f"{name}-0.{name}.{config.namespace}.svc.{config.cluster_domain}"
    return f"{host}:{config.rdzv_port}"


def _escape(text: str) -> str:
    # Kubernetes expands `$(VAR)` in a container's command and env values; `$$` is a literal `$`.
    return text.replace("$(", "$$(")


def _some(**fields: Any) -> dict[str, Any]:
    # A manifest leaves out what the recipe does not set (None, empty), in the order given.
    return {k: v for k, v in fields.items() if v}


def plan_job(
    request: LaunchRequest, config: KubernetesConfig, device: str, workspace: Path | None = None
) -> JobPlan:
    """The Job (and, through `JobPlan.service`, the Service) that runs `request`'s stage.

    `device`: infra.device (`cuda` gives each pod one GPU per process unless
    `config.gpus_per_node` says otherwise). `workspace`: the run's absolute workspace folder
    (default: found from the stage's folder); the shared volume is mounted there in every pod,
    so the spec path and every path inside the spec mean the same file everywhere.
    """
    workspace = checked_workspace(request, config, workspace)
    stage = request.stage
    name = job_name(stage.name, stage.fingerprint, request.launch_id)
    nnodes = max(1, stage.nnodes)
    gpus = gpus_per_node(request, config, device)
    labels = job_labels(request, config)
    command = pod_command(request, config, name, nnodes)
    volumes, mounts = workspace_volumes(config, workspace)
    container = {
        "name": CONTAINER,
        "image": config.image,
        "command": command,
        "env": container_env(request, config),
        "volumeMounts": mounts,
        **_some(
            imagePullPolicy=config.image_pull_policy,
            resources=container_resources(config, gpus),
            # Exposed when several nodes dial pod 0's rendezvous.
            ports=[{"name": "rdzv", "containerPort": config.rdzv_port}] if nnodes > 1 else None,
        ),
    }
    job = job_manifest(request, config, name, labels, pod_spec(config, name, container, volumes))
    return JobPlan(name, config.namespace, labels, command, job, gpus, nnodes)


def checked_workspace(
    request: LaunchRequest, config: KubernetesConfig, workspace: Path | None
) -> Path:
    """The run's workspace (`workspace`, else found from the stage's folder), after checking
    that the recipe says what to run and mount, and that the pods will see the spec."""
    if not config.image:
        raise ValueError("infra.kubernetes.image is required to launch on Kubernetes")
    if not (config.workspace_claim or config.workspace_host_path):
        raise ValueError("infra.kubernetes.workspace_claim or workspace_host_path is required")
    if workspace is None:  # the stage's folder is <workspace>/artifacts/<kind>/<fp> (stage_dir)
        out_dir = request.stage.out_dir
        if not out_dir.is_absolute() or out_dir.parent.parent.name != "artifacts":
            raise ValueError(
                f"{out_dir} is not an absolute <workspace>/artifacts/<stage>/<fp> folder"
            )
        workspace = out_dir.parents[2]
    if not workspace.is_absolute():
        raise ValueError(f"the workspace {workspace} must be an absolute path")
    if not Path(request.spec_path).is_relative_to(workspace):
        raise ValueError(
            f"the stage spec {request.spec_path} is outside the workspace {workspace}, "
            "which is all the pods see"
        )
    return workspace


def gpus_per_node(request: LaunchRequest, config: KubernetesConfig, device: str) -> int:
    """GPUs each pod requests: the recipe's number, else one per process on CUDA, else 0;
    refused when a pod would run more processes than it has GPUs."""
    stage = request.stage
    gpus = config.gpus_per_node
    if gpus is None:
        gpus = stage.nprocs if device == "cuda" else 0
    if gpus and stage.nprocs > gpus:
        raise ValueError(
            f"stage {stage.name} runs {stage.nprocs} processes per node but each pod gets "
            f"{gpus} GPU(s) (infra.kubernetes.gpus_per_node): one process needs one GPU"
        )
    return gpus


def job_labels(request: LaunchRequest, config: KubernetesConfig) -> dict[str, str]:
    """The recipe's labels, then posttrain's (stage, launch), then the request's."""
    labels = dict(config.labels)
    labels["app.kubernetes.io/managed-by"] = "posttrain"
    labels[STAGE_LABEL] = sanitize_label(request.stage.name)
    labels[LAUNCH_LABEL] = sanitize_label(request.launch_id)
    for key, value in request.labels.items():
        labels[LABEL_PREFIX + sanitize_label(key)] = sanitize_label(value)
    return labels


def pod_command(
    request: LaunchRequest, config: KubernetesConfig, name: str, nnodes: int
) -> list[str]:
    """The stage's command line, the same in every pod: Kubernetes expands the node rank from
    the pod's environment, every other argument is literal text."""
    stage = request.stage
    rank_arg = f"$({NODE_RANK_ENV})"
    endpoint = rdzv_endpoint(name, config)
    command = planned_stage_command(
        stage, str(request.spec_path), rank_arg, endpoint, python=config.python, nnodes=nnodes
    )
    return [a if a == rank_arg else _escape(a) for a in command]


def container_env(request: LaunchRequest, config: KubernetesConfig) -> list[dict[str, Any]]:
    """The node rank from the pod's completion index, then the recipe's `env` overridden by the
    launch's (`launch_env`), less this machine's node rank."""
    literal = {**config.env, **request.env}
    literal.pop(NODE_RANK_ENV, None)
    # First: later values may refer to it. The downward API reads the Job controller's index.
    index = {"fieldRef": {"fieldPath": f"metadata.annotations['{COMPLETION_INDEX_ANNOTATION}']"}}
    rank = {"name": NODE_RANK_ENV, "valueFrom": index}
    return [rank, *({"name": k, "value": _escape(v)} for k, v in literal.items())]


def container_resources(config: KubernetesConfig, gpus: int) -> dict[str, dict[str, str]]:
    """The container's `resources`: CPU, memory and GPUs, only the entries set ({} for none)."""
    requests = _some(cpu=config.cpu_request, memory=config.memory_request)
    limits = _some(cpu=config.cpu_limit, memory=config.memory_limit)
    if gpus:
        limits[config.gpu_resource] = str(gpus)  # extended resources: requests = limits
    return _some(requests=requests, limits=limits)


def workspace_volumes(
    config: KubernetesConfig, workspace: Path
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, mounts): the shared workspace (a claim, else a host folder) at the same path as
    here, and a memory-backed /dev/shm when the recipe sizes one."""
    mounts = [{"name": WORKSPACE_VOLUME, "mountPath": str(workspace)}]
    if config.workspace_claim:
        source: dict[str, Any] = {"persistentVolumeClaim": {"claimName": config.workspace_claim}}
    else:
        source = {"hostPath": {"path": config.workspace_host_path, "type": "Directory"}}
    volumes = [{"name": WORKSPACE_VOLUME, **source}]
    if config.shm_size:
        volumes.append(
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": config.shm_size}}
        )
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    return volumes, mounts


def pod_spec(
    config: KubernetesConfig, name: str, container: dict[str, Any], volumes: list[dict[str, Any]]
) -> dict[str, Any]:
    """The pod template's spec: never restarted, in the Service's subdomain, with the recipe's
    scheduling and registry settings."""
    return {
        "restartPolicy": "Never",
        # With the Service of the same name: pod k is `<job>-k.<job>` (Indexed Jobs set each
        # pod's hostname to `<job>-<index>`).
        "subdomain": name,
        "terminationGracePeriodSeconds": config.termination_grace_s,
        "containers": [container],
        "volumes": volumes,
        **_some(
            serviceAccountName=config.service_account,
            imagePullSecrets=[{"name": s} for s in config.image_pull_secrets],
            nodeSelector=dict(config.node_selector),
            tolerations=[t.model_dump(exclude_none=True) for t in config.tolerations],
        ),
    }


def job_manifest(
    request: LaunchRequest,
    config: KubernetesConfig,
    name: str,
    labels: dict[str, str],
    pod: dict[str, Any],
) -> dict[str, Any]:
    """The Indexed Job: one pod per node, no retries, the recipe's deadline and clean-up."""
    nnodes = max(1, request.stage.nnodes)
    extra = config.deadline_extra_s
    spec: dict[str, Any] = {
        "completionMode": "Indexed",
        "completions": nnodes,
        "parallelism": nnodes,
        # A failed node fails the stage; the flow's re-run resumes from the newest complete
        # checkpoint. A pod restarted alone could not rejoin its peers' process group.
        "backoffLimit": 0,
        "template": {"metadata": {"labels": dict(labels)}, "spec": pod},
    }
    if extra is not None:
        spec["activeDeadlineSeconds"] = math.ceil(request.stage.timeout_s + extra)
    if config.ttl_seconds_after_finished is not None:
        spec["ttlSecondsAfterFinished"] = config.ttl_seconds_after_finished
    metadata = {"name": name, "namespace": config.namespace, "labels": dict(labels)}
    metadata["annotations"] = {LABEL_PREFIX + "spec": str(request.spec_path)}
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": metadata, "spec": spec}
