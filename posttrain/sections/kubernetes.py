"""`infra.kubernetes`: where and how a stage's pods run when `infra.launcher` is `kubernetes`.

`flows.stage.launchers.kubernetes` turns a stage into an Indexed Job (one pod per node) and a
headless Service (the rendezvous at pod 0); this section holds what the cluster needs to know: the
image,
the GPUs and the shared workspace volume of every pod, where they may be scheduled, and how long
the Job may live. Everything is checked when the recipe is loaded, with Kubernetes' own syntax
rules (names, label keys, resource quantities), so a typo fails before a Job is submitted.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from posttrain.sections.fields import _Section

# apimachinery's syntax rules (k8s.io/apimachinery/pkg/util/validation).
_DNS_LABEL = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"
# (no look-ahead: pydantic's `pattern` runs on Rust's regex; lengths are checked beside it)
_DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
_LABEL_NAME = re.compile(r"^(?=.{1,63}$)[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_LABEL_VALUE = re.compile(r"^((?=.{1,63}$)[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")
# A resource quantity ("500m", "4", "64Gi", "1.5e3"): resource.ParseQuantity's grammar.
_QUANTITY = re.compile(
    r"^[+]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][-+]?[0-9]+|[numkMGTPE]|[KMGTPE]i)?$"
)
_ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")


def check_label_key(key: str) -> None:
    """Raise ValueError unless `key` is a label (or annotation) key: `[prefix/]name`."""
    prefix, _, name = key.rpartition("/")
    if prefix and not (len(prefix) <= 253 and re.match(_DNS_SUBDOMAIN, prefix)):
        raise ValueError(f"label key {key!r}: prefix {prefix!r} is not a DNS subdomain")
    if not _LABEL_NAME.match(name):
        raise ValueError(
            f"label key {key!r}: name must be 1-63 letters, digits, '-', '_' or '.', "
            "starting and ending with a letter or digit"
        )


def check_label_value(key: str, value: str) -> None:
    if not _LABEL_VALUE.match(value):
        raise ValueError(
            f"label {key!r}: value {value!r} must be at most 63 letters, digits, '-', '_' or "
            "'.', starting and ending with a letter or digit"
        )


class Toleration(_Section):
    """One toleration of the pods (core/v1 Toleration; the keys keep Kubernetes' spelling so a
    cluster's documented toleration can be pasted in)."""

    key: str | None = Field(
        None, description="Taint key it tolerates; empty with operator Exists = every taint."
    )
    operator: Literal["Exists", "Equal"] = Field(
        "Equal", description="`Equal`: the taint's value must equal `value`; `Exists`: any value."
    )
    value: str | None = Field(None, description="Taint value (operator Equal).")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        None, description="Taint effect it tolerates; empty = all effects."
    )
    tolerationSeconds: int | None = Field(  # Kubernetes spells it so
        None,
        ge=0,
        description="With effect NoExecute: seconds the pod stays after the taint appears.",
    )

    @model_validator(mode="after")
    def _consistent(self) -> Toleration:
        if self.operator == "Exists" and self.value:
            raise ValueError("operator Exists takes no value")
        if not self.key and self.operator != "Exists":
            raise ValueError("a toleration without a key needs operator Exists")
        return self


class KubernetesConfig(_Section):
    """The pods of a stage run by the Kubernetes launcher (extra: `pip install
    posttrain[kubernetes]`). Each node of the stage is one pod of an Indexed Job; all pods run the
    same command and meet at the c10d rendezvous on pod 0 through a headless Service."""

    namespace: str = Field(
        "default", description="Namespace of the Jobs and Services.", pattern=_DNS_LABEL
    )
    image: str | None = Field(
        None,
        description="Container image with posttrain installed (same version as the flow's). "
        "Required when `infra.launcher` is `kubernetes`.",
        min_length=1,
    )
    image_pull_policy: Literal["IfNotPresent", "Always", "Never"] | None = Field(
        None, description="null = the cluster's default (Always for `:latest`, else IfNotPresent)."
    )
    image_pull_secrets: list[str] = Field(
        default_factory=list, description="Secrets (in `namespace`) to pull a private image with."
    )
    service_account: str | None = Field(
        None, description="Service account of the pods; null = the namespace's default."
    )
    python: str = Field(
        "python", description="Python interpreter inside the image that runs the stage."
    )
    gpus_per_node: int | None = Field(
        None,
        ge=0,
        description="GPUs each pod requests (`gpu_resource`). null = the stage's processes per "
        "node when `infra.device` is `cuda`, else 0.",
    )
    gpu_resource: str = Field(
        "nvidia.com/gpu", description="Extended resource name of a GPU on this cluster."
    )
    cpu_request: str | None = Field(
        None,
        description="CPU each pod requests (a Kubernetes quantity: `8`, `500m`).",
    )
    cpu_limit: str | None = Field(None, description="CPU limit of each pod.")
    memory_request: str | None = Field(None, description="Memory each pod requests (`64Gi`).")
    memory_limit: str | None = Field(
        None,
        description="Memory limit of each pod: above it the pod is OOM-killed.",
    )
    shm_size: str | None = Field(
        "8Gi",
        description="Size limit of a memory-backed /dev/shm for each pod (NCCL and DataLoader "
        "workers need more than the container runtime's 64 MiB; it counts against the pod's "
        "memory). null = the runtime's default.",
    )
    workspace_claim: str | None = Field(
        None,
        description="PersistentVolumeClaim (ReadWriteMany, in `namespace`) holding the workspace, "
        "mounted in every pod at the workspace's own absolute path (`run.workspace`), so every "
        "path of the stage spec means the same file in every pod and on the launching machine.",
        pattern=_DNS_SUBDOMAIN,
        max_length=253,
    )
    workspace_host_path: str | None = Field(
        None,
        description="Instead of a claim: a folder on every node (a shared filesystem mounted "
        "there), mounted at the workspace's absolute path.",
    )
    node_selector: dict[str, str] = Field(
        default_factory=dict, description="Node labels the pods must land on."
    )
    tolerations: list[Toleration] = Field(
        default_factory=list, description="Taints the pods tolerate (GPU nodes are often tainted)."
    )
    labels: dict[str, str] = Field(
        default_factory=dict,
        description="Extra labels on the Job, its pods and its Service (team, cost centre).",
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Extra environment of every pod (NCCL_SOCKET_IFNAME, HF_HOME ...); the "
        "stage's own variables win on a clash.",
    )
    rdzv_port: int = Field(
        29400, ge=1, le=65535, description="Port of the c10d rendezvous on pod 0."
    )
    cluster_domain: str = Field(
        "cluster.local",
        description="The cluster's DNS domain (kubelet --cluster-domain): the rendezvous host is "
        "pod 0's full name, `<job>-0.<service>.<namespace>.svc.<cluster_domain>`.",
        pattern=_DNS_SUBDOMAIN,
        max_length=253,
    )
    context: str | None = Field(
        None,
        description="kubeconfig context to submit with. null = the in-cluster service account "
        "when the flow itself runs in a pod, else the kubeconfig's current context.",
    )
    poll_s: float = Field(
        5.0, gt=0, description="Seconds between looks at the Job and its pods (two API reads)."
    )
    ttl_seconds_after_finished: int | None = Field(
        86400,
        ge=0,
        description="Seconds a finished Job (and its pods, for `kubectl logs`) is kept before "
        "Kubernetes deletes it; null = kept until deleted.",
    )
    deadline_extra_s: float | None = Field(
        3600,
        ge=0,
        description="The Job's activeDeadlineSeconds is the stage timeout plus this: the backstop "
        "that ends the pods when the supervising process is gone (the supervisor enforces the "
        "exact timeout from when all pods run; the Job's deadline also counts time queued). "
        "null = no deadline on the Job.",
    )
    termination_grace_s: int = Field(
        30,
        ge=0,
        description="Seconds between SIGTERM and SIGKILL when a pod is ended (eviction, cancel).",
    )

    @field_validator("node_selector", "labels")
    @classmethod
    def _labels(cls, value: dict[str, str]) -> dict[str, str]:
        for key, v in value.items():
            check_label_key(key)
            check_label_value(key, v)
        return value

    @field_validator("cpu_request", "cpu_limit", "memory_request", "memory_limit", "shm_size")
    @classmethod
    def _quantity(cls, value: str | None) -> str | None:
        if value is not None and not _QUANTITY.match(value):
            raise ValueError(
                f"{value!r} is not a Kubernetes quantity (e.g. 8, 500m, 64Gi, 1.5e3; "
                "binary suffixes end in i: Ki, Mi, Gi)"
            )
        return value

    @field_validator("env")
    @classmethod
    def _env_names(cls, value: dict[str, str]) -> dict[str, str]:
        for key in value:
            if not _ENV_NAME.match(key):
                raise ValueError(f"{key!r} is not an environment variable name")
        return value

    @field_validator("image_pull_secrets", "service_account")
    @classmethod
    def _names(cls, value: list[str] | str | None) -> list[str] | str | None:
        for name in [value] if isinstance(value, str) else value or []:
            if not (len(name) <= 253 and re.match(_DNS_SUBDOMAIN, name)):
                raise ValueError(f"{name!r} is not a Kubernetes object name")
        return value

    @field_validator("workspace_host_path")
    @classmethod
    def _absolute(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith("/"):
            raise ValueError(f"{value!r} is not an absolute path")
        return value

    @model_validator(mode="after")
    def _one_workspace(self) -> KubernetesConfig:
        if self.workspace_claim and self.workspace_host_path:
            raise ValueError("give workspace_claim or workspace_host_path, not both")
        return self

    def check_usable(self) -> None:
        """Raise ValueError (naming the field) unless a stage can be launched with this: the
        launcher is `kubernetes`. Called by InfraConfig's validator."""
        if not self.image:
            raise ValueError(
                "infra.kubernetes.image is required with infra.launcher kubernetes "
                "(an image with posttrain installed)"
            )
        if not (self.workspace_claim or self.workspace_host_path):
            raise ValueError(
                "infra.kubernetes.workspace_claim (or workspace_host_path) is required with "
                "infra.launcher kubernetes: every pod reads and writes the shared workspace"
            )
