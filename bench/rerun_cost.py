"""What a re-run of an unchanged recipe costs: `posttrain run` when every stage's artifact is
already complete in the workspace (nothing to train; each stage is reused from the artifact store).

Builds the workspace first when it is not complete (one real run of the recipe: minutes),
then runs `posttrain run` --runs times as a child process and stamps each line of its output as
it arrives. The phases, from the child's start:

  validated     the CLI printed `posttrain: running ...` (interpreter, CLI imports, recipe load)
  server up     Prefect logged `Beginning flow run` (embedded server healthy, flow run created)
  stages done   the last stage task logged its final state (`Finished in state ...`)
  flow done     the flow run logged its final state (run record, report, artifacts written)
  summary       the CLI printed the stage table
  server stop   Prefect began stopping the embedded server (its exit hook)
  exit          the process ended (the embedded server stopped, Prefect's exit hooks ran)

plus the CPU seconds of the child and everything it waited for (the embedded server included),
which stay comparable on a busy machine where wall times do not. It also checks that no stage
process was launched (the `=== ... launch` lines of every stage's logs/stage.log) and, with
--importtime, lists the CLI process's costliest top-level imports (torch, transformers and peft
must not be among them).

    python bench/rerun_cost.py [--workspace DIR] [--runs 3] [--warmup 1] [--recipe recipes/quickstart.yaml]
                                 [--importtime] [--set key.path=value ...]

The embedded Prefect database is whatever PREFECT_HOME says (default ~/.prefect); give the bench
its own (`PREFECT_HOME=/tmp/x python bench/rerun_cost.py`) to keep other runs' history out.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("validated", "server up", "stages done", "flow done", "summary", "server stop", "exit")
MARKERS = (
    ("validated", re.compile(r"^posttrain: running ")),
    ("server up", re.compile(r"Beginning flow run")),
    ("stage", re.compile(r"Task run '[^']+' - Finished in state")),
    ("flow done", re.compile(r"Flow run '[^']+' - Finished in state")),
    ("summary", re.compile(r"^stage\s+status\b")),
    ("server stop", re.compile(r"Stopping temporary server")),
)


# Recipe overrides (key.path=value) for every run: --set.
OVERRIDES: list[str] = []


def cli(recipe: Path, workspace: Path, *flags: str) -> list[str]:
    cmd = [sys.executable, *flags, "-m", "flows.cli", "run", str(recipe)]
    return [*cmd, f"run.workspace={workspace}", *OVERRIDES]


def env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}


def incomplete_stages(recipe: Path, workspace: Path) -> list[str]:
    """Stages of the recipe whose artifact is not complete (`posttrain plan`, no Prefect)."""
    from flows.cli_checks import plan_rows
    from flows.cli_common import load_or_report
    from posttrain.plan.planner import plan

    loaded = load_or_report(str(recipe), [f"run.workspace={workspace}", *OVERRIDES], sys.stderr)
    if loaded is None:
        raise SystemExit(2)
    return [row[0] for row in plan_rows(plan(loaded).stages) if row[-1] != "complete"]


def launches(workspace: Path) -> int:
    """Stage process launches ever made in the workspace (one `=== ` line each)."""
    logs = workspace.glob("artifacts/*/*/logs/stage.log")
    return sum(p.read_text(errors="replace").count("=== ") for p in logs)


def timed_run(cmd: list[str]) -> tuple[dict[str, float], float, list[str], int]:
    """(seconds from start to each phase, CPU seconds, output lines, exit code) of one run."""
    marks: dict[str, float] = {}
    lines: list[str] = []
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )

    def read(stream) -> None:  # noqa: ANN001
        for line in stream:
            now = time.monotonic() - t0
            lines.append(line.rstrip("\n"))
            for name, pattern in MARKERS:
                if pattern.search(line):
                    key = "stages done" if name == "stage" else name
                    if name == "stage" or key not in marks:
                        marks[key] = now

    readers = [threading.Thread(target=read, args=(s,)) for s in (proc.stdout, proc.stderr)]
    for r in readers:
        r.start()
    code = proc.wait()
    marks["exit"] = time.monotonic() - t0
    for r in readers:
        r.join()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return marks, cpu, lines, code


def import_costs(recipe: Path, workspace: Path, top: int = 12) -> list[tuple[float, str]]:
    """The CLI process's top-level imports by cumulative seconds (-X importtime), costliest first."""
    _, _, lines, code = timed_run(cli(recipe, workspace, "-X", "importtime"))
    if code != 0:
        raise SystemExit("\n".join(lines[-30:]))
    costs = []
    for line in lines:
        m = re.match(r"import time:\s+\d+ \|\s+(\d+) \| (\S.*)$", line)  # top level: one space
        if m and not m.group(2).startswith(" "):
            costs.append((int(m.group(1)) / 1e6, m.group(2)))
    return sorted(costs, reverse=True)[:top]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workspace", type=Path, help="a workspace to reuse (default: a temp one)")
    ap.add_argument("--recipe", type=Path, default=ROOT / "recipes" / "quickstart.yaml")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1, help="untimed runs first (default 1)")
    ap.add_argument("--importtime", action="store_true", help="also list the CLI's import costs")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override")
    args = ap.parse_args()
    OVERRIDES.extend(args.set)
    sys.path.insert(0, str(ROOT))
    workspace = (args.workspace or Path(tempfile.mkdtemp(prefix="rerun-cost-"))).resolve()
    recipe = args.recipe.resolve()

    if missing := incomplete_stages(recipe, workspace):
        print(f"building the workspace {workspace} (stages {', '.join(missing)}) ...")
        t = time.monotonic()
        subprocess.run(cli(recipe, workspace), cwd=ROOT, env=env(), check=True)
        print(f"built in {time.monotonic() - t:.0f} s")
        if missing := incomplete_stages(recipe, workspace):
            raise SystemExit(f"still incomplete after a run: {missing}")

    n_launches = launches(workspace)
    for _ in range(args.warmup):  # a workspace built by older code has no image cache yet
        if timed_run(cli(recipe, workspace))[3] != 0:
            raise SystemExit("the warm-up run failed")
    rows = []
    for i in range(args.runs):
        marks, cpu, lines, code = timed_run(cli(recipe, workspace))
        if code != 0:
            raise SystemExit(f"run {i + 1} exited {code}:\n" + "\n".join(lines[-30:]))
        statuses = [ln.split()[1] for ln in lines if re.match(r"^\w+\s+(ran|reused|failed)\b", ln)]
        if launches(workspace) != n_launches or any(s != "reused" for s in statuses):
            raise SystemExit(f"run {i + 1} did not reuse every stage: {statuses}")
        rows.append((marks, cpu))
        print(
            f"run {i + 1}: wall {marks['exit']:.2f} s, cpu {cpu:.2f} s, "
            f"{len(statuses)} stages reused, no stage process launched"
        )

    print(f"\nre-run of {recipe.name} in {workspace}, {args.runs} runs (seconds from start)")
    print(f"{'phase':14s} {'median':>7s} {'min':>7s} {'max':>7s}   {'step (median)':>13s}")
    previous = 0.0
    for phase in PHASES:
        values = [m[phase] for m, _ in rows if phase in m]
        if not values:
            print(f"{phase:14s} {'-':>7s}")
            continue
        med = statistics.median(values)
        print(
            f"{phase:14s} {med:7.2f} {min(values):7.2f} {max(values):7.2f}   {med - previous:13.2f}"
        )
        previous = med
    cpus = [c for _, c in rows]
    print(f"{'cpu (all)':14s} {statistics.median(cpus):7.2f} {min(cpus):7.2f} {max(cpus):7.2f}")

    if args.importtime:
        print("\nCLI process, top-level imports (cumulative s):")
        for seconds, name in import_costs(recipe, workspace):
            print(f"  {seconds:6.2f}  {name}")


if __name__ == "__main__":
    main()
