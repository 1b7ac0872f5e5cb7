"""The Job and Service the Kubernetes launcher submits, checked against the Kubernetes 1.37
OpenAPI schema (the API version the pinned client targets) for several recipes, and the
`infra.kubernetes` section's own checks. No cluster: the schema and the object's meaning."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest
from kubernetes_validate import ValidationError
from kubernetes_validate import utils as kv_utils

from flows.stage.launch import stage_command
from flows.stage.launchers.base import LaunchRequest
from flows.stage.launchers.k8s_manifests import (
    COMPLETION_INDEX_ANNOTATION,
    FLOW_RUN_LABEL,
    LAUNCH_LABEL,
    STAGE_LABEL,
    job_name,
    plan_job,
    rdzv_endpoint,
)
from posttrain.config.loader import RecipeError, validate_recipe
from posttrain.runtime.spec import PlannedStage
from posttrain.sections.infra import InfraConfig
from posttrain.sections.kubernetes import KubernetesConfig, Toleration
from tests.k8s_schema import K8S_VERSION, validate_object

WORKSPACE = Path("/mnt/posttrain/workspace")
FP = "3f9a1c0d2b7e4a659e0d1c2b3a495867"
LAUNCH = "5e7b9d21c4a84f0e9b3d6a7c2e1f0a9b"
FLOW_RUN = "0b6f3c2e-8d41-4f7a-9c55-2a1e7d9b4c10"


def request(
    name: str = "sft", nnodes: int = 1, nprocs: int = 1, timeout_s: float = 3600
) -> LaunchRequest:
    out = WORKSPACE / "artifacts" / name / FP
    stage = PlannedStage(
        name, f"posttrain.stages.{name}", FP, out, {}, nprocs, timeout_s, nnodes=nnodes
    )
    return LaunchRequest(
        stage=stage,
        spec_path=out / "logs" / "spec.json",
        launch_id=LAUNCH,
        env={"POSTTRAIN_LAUNCH": LAUNCH, "HF_HUB_OFFLINE": "1"},
        log_dir=out / "logs",
        labels={"flow-run": FLOW_RUN},
    )


RECIPES: dict[str, tuple[dict[str, Any], dict[str, Any], int, int]] = {
    # name: (infra, infra.kubernetes, nnodes, nprocs)
    "1-node-cpu-hostpath": (
        {"device": "cpu"},
        {"workspace_host_path": "/srv/posttrain", "shm_size": None},
        1,
        1,
    ),
    "1-node-8-gpus-pvc": ({"device": "cuda", "devices_per_node": 8}, {}, 1, 8),
    "4-nodes-gpu-pvc-tolerations": (
        {"device": "cuda", "devices_per_node": 8, "nnodes": 4, "rdzv_endpoint": "unused:1"},
        {
            "node_selector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
            "tolerations": [
                {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
                {
                    "key": "node.kubernetes.io/unreachable",
                    "operator": "Exists",
                    "effect": "NoExecute",
                    "tolerationSeconds": 60,
                },
            ],
            "cpu_request": "32",
            "memory_request": "512Gi",
            "memory_limit": "900Gi",
            "labels": {"kueue.x-k8s.io/queue-name": "gpu-queue", "team": "post-training"},
            "env": {"NCCL_SOCKET_IFNAME": "eth0", "HF_HOME": "/mnt/posttrain/hf"},
            "image_pull_secrets": ["regcred"],
            "service_account": "posttrain-stage",
            "image_pull_policy": "Always",
        },
        4,
        8,
    ),
    "2-nodes-cpu-no-deadline": (
        {"device": "cpu", "nnodes": 2, "rdzv_endpoint": "unused:1"},
        {"deadline_extra_s": None, "ttl_seconds_after_finished": None, "cpu_limit": "500m"},
        2,
        2,
    ),
}


def plan_for(recipe: str):
    infra_data, k8s_data, nnodes, nprocs = RECIPES[recipe]
    k8s_data = {
        "namespace": "training",
        "image": "registry.example.com/posttrain:0.1.0",
        **({} if "workspace_host_path" in k8s_data else {"workspace_claim": "posttrain-ws"}),
        **k8s_data,
    }
    infra = InfraConfig(**infra_data, kubernetes=k8s_data)
    req = request(nnodes=nnodes, nprocs=nprocs)
    return plan_job(req, infra.kubernetes, infra.device, WORKSPACE), req, infra


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_manifests_validate_against_the_pinned_schema(recipe: str) -> None:
    plan, _, _ = plan_for(recipe)
    validate_object(plan.job)
    validate_object(plan.service("9d3e5b1a-7c2f-4e8d-a6b0-1f4c3e2d5a70", 29400))
    validate_object(plan.service(None, 29400))


def test_the_schema_version_is_the_one_the_client_targets() -> None:
    # The client is generated from the release-1.37 OpenAPI document; the 1.37 schema set ships
    # inside kubernetes-validate (read from the installed package, never downloaded).
    import kubernetes.client

    header = Path(kubernetes.client.__file__).read_text()[:1000]
    assert f"The version of the OpenAPI document: release-{K8S_VERSION}" in header
    assert f"{K8S_VERSION}.0" in kv_utils.all_versions()


@pytest.mark.parametrize(
    "break_it",
    [
        # A misspelt field (strict schema: unknown fields are errors).
        lambda job: job["spec"]["template"]["spec"]["containers"][0].update(resource={}),
        # A count as text.
        lambda job: job["spec"].update(completions="4"),
        # A container without its required name.
        lambda job: job["spec"]["template"]["spec"]["containers"][0].pop("name"),
    ],
    ids=["unknown-field", "string-count", "missing-name"],
)
def test_a_broken_manifest_is_rejected(break_it) -> None:
    plan, _, _ = plan_for("4-nodes-gpu-pvc-tolerations")
    job = copy.deepcopy(plan.job)
    break_it(job)
    with pytest.raises(ValidationError):
        validate_object(job)


def test_the_job_is_an_indexed_job_with_one_pod_per_node() -> None:
    plan, req, infra = plan_for("4-nodes-gpu-pvc-tolerations")
    spec = plan.job["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == 4
    assert spec["backoffLimit"] == 0
    assert spec["activeDeadlineSeconds"] == 3600 + 3600
    assert spec["ttlSecondsAfterFinished"] == 86400
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    assert pod["subdomain"] == plan.name == plan.job["metadata"]["name"]
    (container,) = pod["containers"]
    assert container["resources"] == {
        "requests": {"cpu": "32", "memory": "512Gi"},
        "limits": {"memory": "900Gi", "nvidia.com/gpu": "8"},
    }
    assert pod["tolerations"][1] == {
        "key": "node.kubernetes.io/unreachable",
        "operator": "Exists",
        "effect": "NoExecute",
        "tolerationSeconds": 60,
    }
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    assert pod["serviceAccountName"] == "posttrain-stage"
    # The workspace at its own path; /dev/shm in memory.
    assert container["volumeMounts"][0] == {"name": "workspace", "mountPath": str(WORKSPACE)}
    assert pod["volumes"][0] == {
        "name": "workspace",
        "persistentVolumeClaim": {"claimName": "posttrain-ws"},
    }
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]


def test_every_pod_runs_the_same_stage_command_with_its_index_as_node_rank() -> None:
    plan, req, infra = plan_for("4-nodes-gpu-pvc-tolerations")
    container = plan.job["spec"]["template"]["spec"]["containers"][0]
    endpoint = f"{plan.name}-0.{plan.name}.training.svc.cluster.local:29400"
    assert rdzv_endpoint(plan.name, infra.kubernetes) == endpoint
    assert container["command"] == stage_command(
        "posttrain.stages.sft",
        str(req.spec_path),
        8,
        python="python",
        nnodes=4,
        node_rank="$(POSTTRAIN_NODE_RANK)",
        rdzv_endpoint=endpoint,
        rdzv_id=FP,
    )
    env = container["env"]
    # The rank first (later values may refer to it), from the Job controller's index.
    assert env[0] == {
        "name": "POSTTRAIN_NODE_RANK",
        "valueFrom": {
            "fieldRef": {"fieldPath": f"metadata.annotations['{COMPLETION_INDEX_ANNOTATION}']"}
        },
    }
    values = {e["name"]: e.get("value") for e in env[1:]}
    assert values == {
        "NCCL_SOCKET_IFNAME": "eth0",
        "HF_HOME": "/mnt/posttrain/hf",
        "POSTTRAIN_LAUNCH": LAUNCH,
        "HF_HUB_OFFLINE": "1",
    }


def test_labels_select_the_pods_and_name_the_flow_run() -> None:
    plan, _, _ = plan_for("4-nodes-gpu-pvc-tolerations")
    labels = plan.job["spec"]["template"]["metadata"]["labels"]
    assert labels[STAGE_LABEL] == "sft"
    assert labels[LAUNCH_LABEL] == LAUNCH
    assert labels[FLOW_RUN_LABEL] == FLOW_RUN
    assert labels["kueue.x-k8s.io/queue-name"] == "gpu-queue"
    assert plan.job["metadata"]["labels"] == labels
    service = plan.service("uid-1", 29400)
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"].items() <= labels.items()
    assert service["metadata"]["ownerReferences"] == [
        {"apiVersion": "batch/v1", "kind": "Job", "name": plan.name, "uid": "uid-1"}
    ]


def test_one_node_cpu_stage_has_no_gpus_and_a_host_path() -> None:
    plan, _, _ = plan_for("1-node-cpu-hostpath")
    pod = plan.job["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert "resources" not in container
    assert container["command"] == [
        "python",
        "-m",
        "posttrain.stages.sft",
        "--spec",
        str(WORKSPACE / "artifacts" / "sft" / FP / "logs" / "spec.json"),
    ]
    assert pod["volumes"] == [
        {"name": "workspace", "hostPath": {"path": "/srv/posttrain", "type": "Directory"}}
    ]
    assert plan.gpus == 0


def test_gpus_default_to_one_per_process_on_cuda() -> None:
    plan, _, _ = plan_for("1-node-8-gpus-pvc")
    limits = plan.job["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits == {"nvidia.com/gpu": "8"}


def test_more_processes_than_gpus_is_refused() -> None:
    infra = InfraConfig(
        device="cuda",
        kubernetes={"image": "img:1", "workspace_claim": "ws", "gpus_per_node": 2},
    )
    with pytest.raises(ValueError, match="4 processes per node but each pod gets 2 GPU"):
        plan_job(request(nprocs=4), infra.kubernetes, infra.device, WORKSPACE)


def test_kubernetes_expands_only_the_node_rank() -> None:
    infra = InfraConfig(
        kubernetes={"image": "img:1", "workspace_claim": "ws", "env": {"A": "x$(HOME)y"}}
    )
    req = request(nnodes=2, nprocs=1)
    req.env["B"] = "$(PATH)"
    req.env["POSTTRAIN_NODE_RANK"] = "0"  # this machine's: the pod gets its own from the index
    plan = plan_job(req, infra.kubernetes, infra.device, WORKSPACE)
    env = {
        e["name"]: e.get("value")
        for e in plan.job["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert env["A"] == "x$$(HOME)y" and env["B"] == "$$(PATH)"
    assert env["POSTTRAIN_NODE_RANK"] is None  # from the downward API, not a value
    assert "$(POSTTRAIN_NODE_RANK)" in plan.command


@pytest.mark.parametrize(
    ("stage", "expected"),
    [
        ("sft", "sft-3f9a1c0d-5e7b9d21"),
        ("dpo_round2", "dpo-round2-3f9a1c0d-5e7b9d21"),
        ("2nd", "s-2nd-3f9a1c0d-5e7b9d21"),
        (
            "Reward_Model_With_A_Really_Long_Name_Indeed",
            "reward-model-with-a-really-lon-3f9a1c0d-5e7b9d21",
        ),
    ],
)
def test_job_names_are_dns_labels_with_room_for_the_pod_index(stage: str, expected: str) -> None:
    name = job_name(stage, FP, LAUNCH)
    assert name == expected
    assert len(name) <= 48 and re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name)


# -- the recipe section ---------------------------------------------------------------------


def _errors(infra: dict[str, Any]) -> list[str]:
    data = {"ingest": {"source": "from_config"}, "sft": {"data": {"synthetic": {}}}, "infra": infra}
    with pytest.raises(RecipeError) as exc:
        validate_recipe(data)
    return exc.value.errors


def test_section_errors_name_the_field() -> None:
    assert _errors({"kubernetes": {"memory_limit": "64GB"}})[0].startswith(
        "infra.kubernetes.memory_limit:"
    )
    assert _errors({"kubernetes": {"tolerations": [{"key": "a", "operater": "Exists"}]}})[
        0
    ].startswith("infra.kubernetes.tolerations.0.operater:")
    assert (
        "operator Exists takes no value"
        in _errors(
            {"kubernetes": {"tolerations": [{"key": "a", "operator": "Exists", "value": "x"}]}}
        )[0]
    )
    assert "label key 'bad key'" in _errors({"kubernetes": {"labels": {"bad key": "x"}}})[0]
    assert (
        "not both"
        in _errors({"kubernetes": {"workspace_claim": "ws", "workspace_host_path": "/srv/ws"}})[0]
    )
    assert _errors({"kubernetes": {"namespace": "Training"}})[0].startswith(
        "infra.kubernetes.namespace:"
    )


def test_launcher_kubernetes_needs_an_image_and_a_workspace_volume() -> None:
    remote = {"launcher": "kubernetes", "device": "cpu", "devices_per_node": 1}
    assert "infra.kubernetes.image is required" in _errors(remote)[0]
    assert (
        "infra.kubernetes.workspace_claim"
        in _errors({**remote, "kubernetes": {"image": "img:1"}})[0]
    )
    ok = {**remote, "kubernetes": {"image": "img:1", "workspace_claim": "ws"}}
    data = {"ingest": {"source": "from_config"}, "sft": {"data": {"synthetic": {}}}, "infra": ok}
    assert validate_recipe(data).infra.kubernetes.image == "img:1"


def test_the_workspace_is_found_from_the_stage_folder_and_holds_the_spec() -> None:
    infra = InfraConfig(kubernetes={"image": "img:1", "workspace_claim": "ws"})
    plan = plan_job(request(), infra.kubernetes, "cpu")
    mount = plan.job["spec"]["template"]["spec"]["containers"][0]["volumeMounts"][0]
    assert mount["mountPath"] == str(WORKSPACE)
    outside = request()
    outside.spec_path = Path("/tmp/spec.json")
    with pytest.raises(ValueError, match="outside the workspace"):
        plan_job(outside, infra.kubernetes, "cpu")


def test_check_usable_names_the_missing_fields() -> None:
    with pytest.raises(ValueError, match=r"infra\.kubernetes\.image is required"):
        KubernetesConfig().check_usable()
    with pytest.raises(ValueError, match=r"infra\.kubernetes\.workspace_claim"):
        KubernetesConfig(image="img:1").check_usable()
    KubernetesConfig(image="img:1", workspace_claim="ws").check_usable()


def test_toleration_keys_are_the_schema_s() -> None:
    # The recipe's toleration is core/v1 Toleration, spelled as Kubernetes spells it.
    definitions = kv_utils.schema_contents(
        f"kubernetes-json-schema/v{K8S_VERSION}.0-local-strict/_definitions.json", K8S_VERSION
    )["$defs"]
    schema = definitions["io.k8s.api.core.v1.Toleration"]["properties"]
    assert set(Toleration.model_fields) == set(schema)
    assert json.dumps(sorted(schema))  # non-empty


def test_pod_0_knows_it_hosts_the_rendezvous_before_dns_has_its_name(monkeypatch) -> None:
    """torchrun decides which node hosts the c10d store by matching the endpoint's host to its
    own machine (`_matches_machine_hostname`). On pod 0 the kubelet's /etc/hosts holds
    `<ip> <job>-0.<svc>.<ns>.svc.<domain> <job>-0`, and the cluster DNS may not have the
    record yet when pod 0 starts: emulate exactly that and ask the installed torch."""
    import socket

    from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname

    plan, _, infra = plan_for("4-nodes-gpu-pvc-tolerations")
    fqdn = f"{plan.name}-0.{plan.name}.training.svc.cluster.local"
    hosts = {fqdn: fqdn, f"{plan.name}-0": fqdn}  # name -> canonical name (first on the line)

    def getaddrinfo(host, port, *args, **kwargs):  # files first; DNS knows nothing yet
        if host not in hosts:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, hosts[host], ("10.244.2.9", 0))]

    monkeypatch.setattr(socket, "gethostname", lambda: f"{plan.name}-0")
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    endpoint_host = rdzv_endpoint(plan.name, infra.kubernetes).rpartition(":")[0]
    assert endpoint_host == fqdn
    assert _matches_machine_hostname(endpoint_host)
    # The short name would leave pod 0 a client of a store nobody hosts until DNS answers.
    assert not _matches_machine_hostname(f"{plan.name}-0.{plan.name}")
