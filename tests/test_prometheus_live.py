"""A real Prometheus (Debian's package) scraping a real run: `posttrain run` of a tiny recipe
(ingest -> LoRA SFT -> GRPO with a verifier) with `tracking.prometheus` on. Its ingest is built
in this process first and reused by the run (SFT and GRPO are what is watched), and its flow
runs on the session's Prefect server (the embedded server's start is not what this file tests).

- While SFT trains, Prometheus's own query API returns its series, equal to the metrics.jsonl
  record of the step it shows and no more than one scrape interval behind the file.
- A GRPO rank stopped on purpose (SIGSTOP) makes Prometheus fire the shipped hang alert
  (docs/monitoring/alerts.yml), read from its /api/v1/alerts; the rank then goes on (SIGCONT)
  and the run completes.
- Every query of the shipped Grafana dashboard returns a series during the run, except those
  of sources this machine does not have (GPU, InfiniBand: no NVIDIA driver, no IB ports), whose
  absence the run itself states (`posttrain_health_source_present` 0), never a zero.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import yaml

from posttrain.telemetry.records import read_metrics
from tests.faults.fault_runs import Run, kill_all, run_env
from tests.monitoring_queries import panel_queries
from tests.stage_helpers import ROOT, TINY, run_inprocess

pytestmark = pytest.mark.slow

ALERTS = ROOT / "docs" / "monitoring" / "alerts.yml"
SCRAPE_S = 1.0
HANG_S = 40.0
# Series a CPU machine without InfiniBand cannot have: the GPU's (NVML), the ports', and the
# CUDA allocator's memory.
ABSENT_HERE = re.compile(
    r"posttrain_(gpu_\w+|ib_\w+|memory_(allocated|reserved|peak_allocated|peak_reserved"
    r"|reserved_minus_allocated)_bytes)"
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int]]:
    """(its URL, the port it scrapes posttrain on): 1 s scrapes and rule evaluations."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail("Debian's prometheus is not installed: run `bash scripts/dev.sh test`")
    folder = tmp_path_factory.mktemp("prometheus")
    target, port = _free_port(), _free_port()
    config = {
        "global": {"scrape_interval": f"{SCRAPE_S:g}s", "evaluation_interval": f"{SCRAPE_S:g}s"},
        "rule_files": [str(ALERTS)],
        "scrape_configs": [
            {"job_name": "posttrain", "static_configs": [{"targets": [f"127.0.0.1:{target}"]}]}
        ],
    }
    (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={folder / 'prometheus.yml'}",
            f"--storage.tsdb.path={folder / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=open(folder / "prometheus.log", "w"),  # noqa: SIM115 (closed with the process)
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/-/ready", timeout=2).status_code == 200:
                    break
            assert proc.poll() is None, (folder / "prometheus.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "prometheus did not become ready"
            time.sleep(0.2)
        yield url, target
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def query(url: str, expr: str) -> list[dict]:
    answer = httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=10).json()
    assert answer["status"] == "success", (expr, answer)
    return answer["data"]["result"]


def one(url: str, expr: str) -> float | None:
    result = query(url, expr)
    assert len(result) <= 1, (expr, result)
    return float(result[0]["value"][1]) if result else None


def _recipe(folder: Path, port: int) -> Path:
    data = yaml.safe_load(yaml.safe_dump(TINY))
    data["run"] = {"name": "prom-live", "seed": 0, "workspace": str(folder / "ws")}
    data["infra"]["hang_timeout_s"] = HANG_S
    data["ingest"]["from_config"]["pretrain_steps"] = 5
    data["sft"]["max_steps"] = 60
    data["tracking"] = {
        "tensorboard": False,
        "prometheus": {"port": port, "host": "127.0.0.1", "linger_s": 3},
    }
    data["grpo"] = {
        "data": {"synthetic": {"n_examples": 80, "seed": 3}, "eval_fraction": 0.1},
        "rollout": {"prompts_per_step": 4, "samples_per_prompt": 4, "max_new_tokens": 8},
        "rewards": [{"fn": "posttrain.rewards.match:exact_match"}],
        "batch": {"micro_batch_size": 16, "grad_accum_steps": 1},
        "max_steps": 40,  # ~50 ms a step: still training a second after it starts (below)
        "checkpoint_every": 0,
        "eval_prompts": 8,
    }
    data["evaluate"] = None
    data["export"] = None
    path = folder / "prom-live.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _wait(what: str, check, timeout: float, run: Run):  # noqa: ANN001, ANN202
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (got := check()) is not None:
            return got
        assert run.proc.poll() is None, f"run ended before {what}:\n{run.text()[-4000:]}"
        time.sleep(0.3)
    raise AssertionError(f"no {what} within {timeout:g} s:\n{run.text()[-4000:]}")


def _stage_dir(ws: Path, stage: str) -> Path:
    found = list((ws / "artifacts" / stage).glob("*/metrics.jsonl"))
    assert len(found) == 1, found
    return found[0].parent


def check_sft_matches_its_file(url: str, run: Run, ws: Path) -> None:
    """Prometheus's view of SFT while it trains: the step it shows, its loss equal to that
    step's record, and no record older than one scrape interval missing from it."""
    sel = '{stage="sft"}'
    _wait(
        "an SFT step in Prometheus", lambda: one(url, f"posttrain_stage_step{sel} >= 3"), 300, run
    )
    # One evaluation: the step, its loss and the scrape's own timestamp come from one scrape.
    got = query(url, '{__name__=~"posttrain_stage_step|posttrain_loss",stage="sft"}')
    values = {r["metric"]["__name__"]: float(r["value"][1]) for r in got}
    scraped_at = one(url, f"timestamp(posttrain_stage_step{sel})")
    assert scraped_at is not None
    records = read_metrics(_stage_dir(ws, "sft") / "metrics.jsonl", "train")
    step = int(values["posttrain_stage_step"])
    shown = next(r for r in records if r["step"] == step)
    assert values["posttrain_loss"] == pytest.approx(shown["loss"], rel=1e-12)
    assert one(url, 'posttrain_stage_status{stage="sft",status="running"}') == 1
    # Every record written a scrape interval before the scrape is in it: the scrape read the
    # file itself (a small allowance for the scrape's own duration).
    older = [r["step"] for r in records if r["time"] < scraped_at - SCRAPE_S - 0.25]
    assert max(older, default=0) <= step, (older, step, scraped_at)


def _grpo_rank(run: Run) -> psutil.Process:
    for p in run.descendants():
        with contextlib.suppress(psutil.Error):
            if "posttrain.stages.grpo" in " ".join(p.cmdline()):
                return p
    raise AssertionError("no GRPO stage process")


def firing(url: str, name: str) -> list[dict]:
    alerts = httpx.get(f"{url}/api/v1/alerts", timeout=10).json()["data"]["alerts"]
    return [a for a in alerts if a["labels"]["alertname"] == name and a["state"] == "firing"]


def check_every_panel(url: str, run_id: str) -> list[str]:
    """Every dashboard query returns a series, but those of sources absent here; the titles
    of the panels left empty."""
    empty = []
    for title, expr in panel_queries(run=run_id):
        if query(url, expr):
            continue
        named = set(re.findall(r"posttrain_[a-z_]+", expr)) - {"posttrain_stage_status"}
        absent = named and all(ABSENT_HERE.fullmatch(n) for n in named)
        assert absent, f"panel {title!r}: no series for {expr}"
        empty.append(title)
    for source in ("nvml", "infiniband"):
        present = query(url, f'posttrain_health_source_present{{source="{source}"}}')
        assert present and all(float(r["value"][1]) == 0 for r in present), (source, present)
    return empty


def test_prometheus_scrapes_a_run_and_fires_the_hang_alert(
    prometheus: tuple[str, int], prefect_server: Any, tmp_path: Path
) -> None:
    url, port = prometheus
    env = run_env(tmp_path / "home", tmp_path / "locks", POSTTRAIN_HEALTH_INTERVAL_S="1")
    env |= {k: v for k, v in prefect_server.env.items() if k.startswith("PREFECT_")}
    recipe = _recipe(tmp_path, port)
    run_inprocess("ingest", recipe)  # a few seconds here, against a stage launch in the run
    run = Run(recipe, env)
    procs: list[psutil.Process] = []
    try:
        check_sft_matches_its_file(url, run, tmp_path / "ws")
        _wait("a GRPO step", lambda: one(url, 'posttrain_stage_step{stage="grpo"} >= 1'), 600, run)
        # A rank's first health sample, taken as it starts, has no storage-read rate (a rate
        # needs two); stopped before its second, a second later, that panel would be empty.
        read_rate = 'posttrain_data_read_bytes_per_second{stage="grpo"}'
        _wait("a GRPO storage-read rate", lambda: one(url, read_rate), 60, run)
        rank = _grpo_rank(run)
        procs = run.descendants()
        rank.send_signal(signal.SIGSTOP)  # stalled: no beat, no step, no health sample
        t0 = time.monotonic()
        try:
            hung = _wait(
                "the hang alert",
                lambda: firing(url, "PosttrainStageHung") or None,
                HANG_S * 0.5 + 15,
                run,
            )
            fired_after = time.monotonic() - t0
            labels = hung[0]["labels"]
            assert (labels["stage"], labels["rank"]) == ("grpo", "0"), labels
            run_id = labels["run"]
            empty = check_every_panel(url, run_id)
        finally:
            rank.send_signal(signal.SIGCONT)
        print(
            f"\nhang alert fired {fired_after:.1f} s after SIGSTOP (hang timeout {HANG_S:g} s); "
            f"panels without series here: {empty}"
        )
        assert HANG_S * 0.5 <= fired_after < HANG_S, fired_after  # before the flow kills it
        rc, out = run.finish(timeout=600)
        assert rc == 0, out[-4000:]
        assert f"Prometheus endpoint: http://127.0.0.1:{port}/metrics" in out
        # The last scrapes (linger_s) saw how it ended; the alert resolved once it beat again.
        ran = 'last_over_time(posttrain_stage_status{stage="grpo",status="ran"}[2m])'
        assert one(url, ran) == 1
        assert not firing(url, "PosttrainStageHung")
        assert "health:" in out and "grpo: data-wait" in out
    finally:
        run.stop()
        kill_all(procs)
