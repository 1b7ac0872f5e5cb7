"""The Kubernetes launcher's submit, watch and cancel logic against recorded API responses.

The real `kubernetes` client talks HTTP to `tests/k8s_replay.py`, which answers from
tests/data/k8s/ (objects shaped like a 1.37 API server's, each validated against the schema
here) and records every request, so each test checks both what the launcher sent and what it
made of the answers. No cluster runs here: docs/multi-node.md ("Kubernetes") gives the check by
hand on a real one.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any

import pytest

from flows.stage.launchers.base import LaunchError, LaunchRequest
from flows.stage.launchers.k8s_manifests import plan_job
from flows.stage.launchers.kubernetes import KubernetesLauncher, cancel_flow_run_jobs
from posttrain.config.loader import resolve
from posttrain.config.schema import Recipe
from posttrain.plan.planner import spec_for
from posttrain.runtime.spec import PlannedStage
from posttrain.sections.infra import InfraConfig
from tests.k8s_replay import (
    DATA,
    FINGERPRINT,
    FLOW_RUN_ID,
    JOB,
    JOBS,
    LAUNCH_ID,
    NAMESPACE,
    POD0,
    POD1,
    PODS,
    SERVICES,
    STAGE,
    WORKSPACE,
    ReplayServer,
    Reply,
    api_client,
    load,
    status_object,
)
from tests.k8s_schema import validate_object

LOG = logging.getLogger("test-k8s")


def test_recorded_responses_match_schema() -> None:
    files = sorted(DATA.glob("*.json"))
    assert len(files) >= 15
    for path in files:
        validate_object(json.loads(path.read_text()))


@pytest.fixture
def server() -> Any:
    replay = ReplayServer()
    with replay as host:
        replay.host = host  # type: ignore[attr-defined]
        yield replay


def make_launcher(server: ReplayServer, tmp_path: Path) -> tuple[KubernetesLauncher, LaunchRequest]:
    infra = InfraConfig(
        device="cuda",
        devices_per_node=1,
        nnodes=2,
        rdzv_endpoint="unused:1",
        kubernetes={
            "namespace": NAMESPACE,
            "image": "registry.example.com/posttrain:0.1.0",
            "workspace_claim": "posttrain-workspace",
            "poll_s": 0.02,
            "termination_grace_s": 0,
        },
    )
    out = Path(WORKSPACE) / "artifacts" / STAGE / "x"
    stage = PlannedStage(
        STAGE,
        "posttrain.stages.sft",
        FINGERPRINT + "9e0d1c2b3a495867",
        out,
        {},
        1,
        3600.0,
        nnodes=2,
    )
    request = LaunchRequest(
        stage,
        out / "logs" / "spec.json",
        LAUNCH_ID,
        {"POSTTRAIN_LAUNCH": LAUNCH_ID},
        tmp_path / "logs",
        {"flow-run": FLOW_RUN_ID},
    )
    client = api_client(server.host)  # type: ignore[attr-defined]
    return KubernetesLauncher(infra.kubernetes, infra.device, client=client), request


def submitted(server: ReplayServer) -> None:
    server.add("POST", JOBS, Reply(201, load("job-created")))
    server.add("POST", SERVICES, Reply(201, load("service-created")))


def set_state(server: ReplayServer, job: str, pods: str) -> None:
    """The Job and its pods as the API now reports them."""
    server.add("GET", f"{JOBS}/{JOB}", Reply(200, load(job)))
    pod_list = load(pods)
    server.add("GET", PODS, Reply(200, pod_list))
    for item in pod_list["items"]:
        pod = {"kind": "Pod", "apiVersion": "v1", **item}
        server.add("GET", f"{PODS}/{item['metadata']['name']}", Reply(200, pod))


def log_stream(name: str, split_at: int = 30) -> Reply:
    """A pod's log as a follow stream: in two chunks, cut inside a line."""
    text = (DATA / name).read_text()
    return Reply(200, chunks=[text[:split_at], text[split_at:]], pause_s=0.01)


def wait_for(predicate: Any, timeout_s: float = 10.0) -> Any:
    import time

    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if value := predicate():
            return value
        time.sleep(0.01)
    raise AssertionError("timed out waiting")


def test_start_submits_the_job_then_its_service_owned_by_it(server, tmp_path) -> None:
    launcher, request = make_launcher(server, tmp_path)
    submitted(server)
    launch = launcher.start(request, LOG)
    plan = plan_job(request, launcher.config, "cuda", Path(WORKSPACE))
    (job_post,) = server.sent("POST", JOBS)
    assert job_post.body == plan.job
    assert job_post.query["fieldValidation"] == ["Strict"]
    (service_post,) = server.sent("POST", SERVICES)
    uid = load("job-created")["metadata"]["uid"]
    assert service_post.body == plan.service(uid, 29400)
    assert [r.path for r in server.requests] == [JOBS, SERVICES]  # the Job first
    assert launch.description == f"Kubernetes Job {NAMESPACE}/{JOB} (2 pod(s))"
    assert launch.record == {"job": JOB, "namespace": NAMESPACE, "launch": LAUNCH_ID, "nnodes": "2"}
    saved = json.loads((tmp_path / "logs" / f"k8s-{JOB}.json").read_text())
    assert saved["items"][0] == plan.job


def test_pending_then_running_then_succeeded_with_both_logs(server, tmp_path) -> None:
    launcher, request = make_launcher(server, tmp_path)
    submitted(server)
    set_state(server, "job-created", "pods-pending")
    launch = launcher.start(request, LOG)

    assert not launch.started()
    reason = launch.waiting_reason()
    assert reason is not None and reason.startswith("Kubernetes: 0 of 2 pods running")
    assert f"pod {POD0} Unschedulable: 0/3 nodes are available" in reason
    assert "2 Insufficient nvidia.com/gpu" in reason
    assert f"pod {POD1} ImagePullBackOff: Back-off pulling image" in reason
    assert launch.poll() is None

    server.add("GET", f"{PODS}/{POD0}/log", log_stream("sft-node0.log"))
    server.add("GET", f"{PODS}/{POD1}/log", log_stream("sft-node1.log", split_at=5))
    set_state(server, "job-running", "pods-running")
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(launch.output()), daemon=True)
    reader.start()
    assert wait_for(launch.started)
    assert launch.waiting_reason() is None
    # Both logs read, and read again as the streams end while the pods still run (a dropped
    # connection): the reopened streams repeat nothing.
    wait_for(lambda: len(server.sent("GET", f"{PODS}/{POD0}/log")) >= 2)
    wait_for(lambda: len(server.sent("GET", f"{PODS}/{POD1}/log")) >= 2)
    assert launch.poll() is None

    set_state(server, "job-complete", "pods-succeeded")
    assert wait_for(lambda: launch.poll() == 0 or None) is True
    reader.join(timeout=10)
    assert not reader.is_alive()
    assert [line for line in lines if line.startswith("[node 0] ")] == [
        "[node 0] stage sft: rank 0 of 2 (node 0), world 2, nccl",
        "[node 0] step 1/40 loss 2.3141",
        "[node 0] step 1/40 tokens/s 4102",
        "[node 0] stage sft: artifact sealed (manifest written)",
    ]
    assert [line for line in lines if line.startswith("[node 1] ")] == [
        "[node 1] stage sft: rank 1 of 2 (node 1), world 2, nccl",
        "[node 1] stage sft: rank 1 done",
    ]
    assert len(lines) == 6
    follow = server.sent("GET", f"{PODS}/{POD0}/log")
    assert follow[0].query["follow"] == ["true"] and follow[0].query["timestamps"] == ["true"]
    assert "sinceSeconds" in follow[1].query  # reopened from where it was
    assert launch.engine_reason() is None
    # The supervisor stops every launch at the end: a finished Job is left to its TTL.
    launch.stop(3, LOG)
    assert server.sent("DELETE", f"{JOBS}/{JOB}") == []
    assert launch.poll() == 0


def test_an_oom_killed_pod_fails_the_stage_and_is_named(server, tmp_path) -> None:
    launcher, request = make_launcher(server, tmp_path)
    submitted(server)
    set_state(server, "job-failing", "pods-oom-terminating")
    launch = launcher.start(request, LOG)
    # The Job is failing but node 1 still runs: not ended yet.
    assert launch.poll() is None
    set_state(server, "job-failed", "pods-oom")
    assert wait_for(lambda: launch.poll()) == 137
    assert launch.engine_reason() == f"Kubernetes: pod {POD0} OOMKilled (exit 137)"


def test_an_evicted_pod_is_named_with_the_kubelet_s_words(server, tmp_path) -> None:
    launcher, request = make_launcher(server, tmp_path)
    submitted(server)
    set_state(server, "job-failed", "pods-evicted")
    launch = launcher.start(request, LOG)
    assert launch.poll() == 137
    reason = launch.engine_reason()
    assert reason is not None
    assert reason.startswith(
        f"Kubernetes: pod {POD0} Evicted: The node was low on resource: memory"
    )
    assert POD1 not in reason  # ended because of node 0, by its own exit


def test_the_job_deadline_is_the_engine_s_reason(server, tmp_path) -> None:
    launcher, request = make_launcher(server, tmp_path)
    submitted(server)
    job = load("job-failed")
    for condition in job["status"]["conditions"]:
        condition["reason"] = "DeadlineExceeded"
        condition["message"] = "Job was active longer than specified deadline"
    validate_object(job)
    set_state(server, "job-failed", "pods-none")
    server.add("GET", f"{JOBS}/{JOB}", Reply(200, job))
    launch = launcher.start(request, LOG)
    assert launch.poll() == 1  # no pod left to tell an exit code
    assert launch.engine_reason() == (
        f"Kubernetes: Job {JOB} DeadlineExceeded: Job was active longer than specified deadline"
    )


def test_stop_deletes_the_job_in_the_foreground_and_waits_for_its_pods(server, tmp_path) -> None:
    launcher, request = make_launcher(server, tmp_path)
    submitted(server)
    set_state(server, "job-running", "pods-running")
    launch = launcher.start(request, LOG)
    assert launch.started()
    server.add("DELETE", f"{JOBS}/{JOB}", Reply(200, load("job-deleting")))
    server.add("DELETE", f"{SERVICES}/{JOB}", Reply(200, load("service-created")))
    # Pods still listed twice after the delete, then gone.
    running = load("pods-running")
    server.add("GET", PODS, Reply(200, running), Reply(200, running), Reply(200, load("pods-none")))
    launch.stop(3, LOG)
    (delete,) = server.sent("DELETE", f"{JOBS}/{JOB}")
    assert delete.query["propagationPolicy"] == ["Foreground"]
    assert delete.query["gracePeriodSeconds"] == ["3"]
    assert len(server.sent("DELETE", f"{SERVICES}/{JOB}")) == 1
    assert len(server.sent("GET", PODS)) >= 3  # it waited for the pods to go
    assert list(launch.output()) == []  # nothing left to follow

    # Twice: it has ended (the Job is gone), nothing more is sent.
    server.add("GET", f"{JOBS}/{JOB}", Reply(404, load("status-job-notfound")))
    launch.stop(3, LOG)
    assert len(server.sent("DELETE", f"{JOBS}/{JOB}")) == 1
    assert launch.poll() != 0 and launch.engine_reason() is None  # ended by us, not the engine


@pytest.mark.parametrize(
    ("fixture", "words"),
    [
        ("status-forbidden", 'cannot create resource "jobs" in API group "batch"'),
        ("status-invalid", 'limits[nvidia.com/gpu]: Invalid value: "0.5": must be an integer'),
    ],
)
def test_a_refused_job_raises_launch_error_with_the_api_s_message(
    server, tmp_path, fixture: str, words: str
) -> None:
    launcher, request = make_launcher(server, tmp_path)
    status = load(fixture)
    server.add("POST", JOBS, Reply(status["code"], status))
    with pytest.raises(LaunchError) as exc:
        launcher.start(request, LOG)
    assert words in str(exc.value)
    assert f"(HTTP {status['code']})" in str(exc.value)
    assert f"Job {NAMESPACE}/{JOB}" in str(exc.value)
    assert server.sent("POST", SERVICES) == []


def test_a_refused_service_deletes_the_job(server, tmp_path) -> None:
    launcher, request = make_launcher(server, tmp_path)
    server.add("POST", JOBS, Reply(201, load("job-created")))
    refusal = load("status-forbidden")
    refusal["message"] = refusal["message"].replace(
        '"jobs" in API group "batch"', '"services" in API group ""'
    )
    refusal["message"] = refusal["message"].replace("jobs.batch is", "services is")
    refusal["details"] = {"kind": "services"}
    validate_object(refusal)
    server.add("POST", SERVICES, Reply(403, refusal))
    server.add("DELETE", f"{JOBS}/{JOB}", Reply(200, load("job-deleting")))
    with pytest.raises(
        LaunchError, match=r"refused Service .*\(the Job was deleted\): services is"
    ):
        launcher.start(request, LOG)
    assert len(server.sent("DELETE", f"{JOBS}/{JOB}")) == 1


def test_cancel_flow_run_jobs_deletes_them_by_label(server, tmp_path) -> None:
    launcher, _ = make_launcher(server, tmp_path)
    server.add("GET", JOBS, Reply(200, load("joblist-flow-run")))
    server.add("DELETE", f"{JOBS}/{JOB}", Reply(200, load("job-deleting")))
    server.add("GET", SERVICES, Reply(200, load("servicelist-flow-run")))
    server.add("DELETE", f"{SERVICES}/{JOB}", Reply(200, load("service-created")))
    client = api_client(server.host)
    # As the flow's cancel hook calls it: with the infra section as JSON.
    infra = {"launcher": "kubernetes", "kubernetes": launcher.config.model_dump(mode="json")}
    assert cancel_flow_run_jobs(FLOW_RUN_ID, infra, client=client) == 1
    (listed,) = server.sent("GET", JOBS)
    assert listed.query["labelSelector"] == [f"posttrain.io/flow-run={FLOW_RUN_ID}"]
    (delete,) = server.sent("DELETE", f"{JOBS}/{JOB}")
    assert delete.query["propagationPolicy"] == ["Foreground"]
    assert len(server.sent("DELETE", f"{SERVICES}/{JOB}")) == 1


def test_dump_stacks_cannot_signal_pods(server, tmp_path) -> None:
    launcher, request = make_launcher(server, tmp_path)
    submitted(server)
    launch = launcher.start(request, LOG)
    assert launch.dump_stacks(None, tmp_path) == []


def test_a_suspended_job_and_a_failing_api_are_waiting_reasons(server, tmp_path) -> None:
    launcher, request = make_launcher(server, tmp_path)
    submitted(server)
    job = load("job-created")
    job["spec"]["suspend"] = True  # as Kueue holds it until the whole gang is admitted
    validate_object(job)
    server.add("GET", f"{JOBS}/{JOB}", Reply(200, job))
    server.add("GET", PODS, Reply(200, load("pods-none")))
    launch = launcher.start(request, LOG)
    reason = launch.waiting_reason()
    assert reason == (
        "Kubernetes: 0 of 2 pods running; 0 of 2 pods created; "
        "the Job is suspended (waiting for admission, e.g. by Kueue)"
    )
    # The API failing is no end of the stage: it is reported and the watch goes on.
    unavailable = status_object(
        503, "ServiceUnavailable", "the server is currently unable to handle the request"
    )
    validate_object(unavailable)
    server.add("GET", f"{JOBS}/{JOB}", Reply(503, unavailable))
    reason = wait_for(
        lambda: "the API" in (launch.waiting_reason() or "") and launch.waiting_reason()
    )
    assert "the server is currently unable to handle the request (HTTP 503)" in reason
    assert launch.poll() is None


def test_find_returns_a_job_a_dead_flow_left_running_and_none_once_it_ended(
    server, tmp_path
) -> None:
    launcher, request = make_launcher(server, tmp_path)
    record = {"job": JOB, "namespace": NAMESPACE, "launch": LAUNCH_ID, "nnodes": "2"}
    set_state(server, "job-running", "pods-running")
    found = launcher.find(record, LOG)
    assert found is not None and found.started() and found.description.endswith("(2 pod(s))")
    set_state(server, "job-complete", "pods-succeeded")
    assert launcher.find(record, LOG) is None
    server.add("GET", f"{JOBS}/{JOB}", Reply(404, load("status-job-notfound")))
    assert launcher.find(record, LOG) is None


def test_from_infra_reads_the_planned_infra_section() -> None:
    infra = InfraConfig(
        launcher="kubernetes",
        device="cuda",
        devices_per_node=4,
        kubernetes={"image": "img:1", "workspace_claim": "ws", "namespace": "training"},
    ).model_dump(mode="json")
    launcher = KubernetesLauncher.from_infra(infra)
    assert launcher.name == "kubernetes"
    assert launcher.device == "cuda" and launcher.config.namespace == "training"


def test_the_supervisor_runs_a_stage_through_the_kubeconfig_and_names_the_oom_kill(
    server, tmp_path, monkeypatch
) -> None:
    """The whole path the flow takes: `supervise_stage` picks the launcher from the planned
    infra, the client reads a kubeconfig (pointing at the replay server), the Job fails with an
    OOM-killed pod, and the stage's failure says so with both pods' logs in stage.log."""
    import uuid

    from kubernetes.config import kube_config

    import flows.stage.supervise as supervise
    from flows.stage.failures import StageFailed
    from posttrain.store.artifacts import stage_dir

    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "replay", "cluster": {"server": server.host}}],
                "users": [{"name": "flow", "user": {"token": "t0ken"}}],
                "contexts": [{"name": "replay", "context": {"cluster": "replay", "user": "flow"}}],
                "current-context": "replay",
            }
        )
    )
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(kubeconfig))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setattr(supervise.uuid, "uuid4", lambda: uuid.UUID(hex=LAUNCH_ID))
    infra = InfraConfig(
        launcher="kubernetes",
        device="cuda",
        devices_per_node=1,
        nnodes=2,
        kubernetes={
            "namespace": NAMESPACE,
            "image": "registry.example.com/posttrain:0.1.0",
            "workspace_claim": "posttrain-workspace",
            "poll_s": 0.02,
        },
    )
    fingerprint = FINGERPRINT + "9e0d1c2b3a495867"
    out = stage_dir(tmp_path / "ws", STAGE, fingerprint)
    (out / "logs").mkdir(parents=True)
    stage = PlannedStage(
        STAGE,
        "posttrain.stages.sft",
        fingerprint,
        out,
        {},
        1,
        600.0,
        nnodes=2,
        launcher="kubernetes",
        infra=infra.model_dump(mode="json"),
    )
    submitted(server)
    set_state(server, "job-failed", "pods-oom")
    server.add("GET", f"{PODS}/{POD0}/log", log_stream("sft-node0.log"))
    server.add("GET", f"{PODS}/{POD1}/log", log_stream("sft-node1.log"))

    recipe = resolve(Recipe.model_validate(
        {"run": {"workspace": str(tmp_path / "ws")}, "infra": infra.model_dump(mode="json"),
         "ingest": {"source": "from_config"}, "sft": {"data": {"synthetic": {}}}}
    ))  # fmt: skip
    with pytest.raises(StageFailed) as exc:
        supervise.supervise_stage(stage, spec_for(stage, recipe, {}), kill_grace_s=1)
    assert f"was ended by Kubernetes: pod {POD0} OOMKilled (exit 137)" in str(exc.value)
    (job_post,) = server.sent("POST", JOBS)
    assert job_post.body["metadata"]["labels"]["posttrain.io/launch"] == LAUNCH_ID
    mount = job_post.body["spec"]["template"]["spec"]["containers"][0]["volumeMounts"][0]
    assert mount["mountPath"] == str(tmp_path / "ws")  # the workspace, at its own path
    log = (out / "logs" / "stage.log").read_text()
    assert "[node 0] stage sft: rank 0 of 2 (node 0), world 2, nccl" in log
    assert "[node 1] stage sft: rank 1 done" in log
    record = json.loads((out / "logs" / "launch.json").read_text())
    assert record["launcher"] == "kubernetes" and record["job"]["job"] == JOB
