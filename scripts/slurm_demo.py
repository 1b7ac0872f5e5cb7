"""The Slurm example of docs/multi-node.md, on the local test cluster (tests/slurm_cluster.py: slurmctld,
munged and two slurmd in network namespaces; needs root and Debian's slurm-wlm and munge).

    sudo .venv/bin/python scripts/slurm_demo.py [folder]

A 2-node x 1-process SFT of 120 steps through `posttrain run` (infra.launcher slurm); node n2 is
set down once step 20's checkpoint exists; after `state=resume` the same command runs again and
resumes. Both runs' output is written to <folder>/run1.txt and run2.txt (default
/tmp/slurmdemo); the cluster is stopped at the end.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

from slurm_cluster import LocalSlurm  # noqa: E402
from stage_helpers import slurm_sft_recipe  # noqa: E402

from posttrain.config.loader import load_recipe  # noqa: E402
from posttrain.plan.planner import plan  # noqa: E402


def main(folder: Path) -> int:
    run = folder / "run"
    recipe = slurm_sft_recipe(run, "demo", steps=120, checkpoint_every=10)
    sft = {s.name: s for s in plan(load_recipe(recipe)).stages}["sft"]
    cmd = [sys.executable, "-m", "flows.cli", "run", str(recipe)]
    with LocalSlurm(folder / "cluster") as cluster:
        env = {**os.environ, **cluster.env, "HF_HUB_OFFLINE": "1"}
        with open(run / "run1.txt", "w") as out:
            first = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
            while not (sft.out_dir / "checkpoints" / "step_0000020").exists():
                if first.poll() is not None:
                    break
                time.sleep(0.5)
            cluster.client("scontrol", "update", "nodename=n2", "state=down", "reason=demo")
            print(f"run 1 exited {first.wait()} (node n2 set down at step 20)")
        cluster.client("scontrol", "update", "nodename=n2", "state=resume")
        cluster.wait_idle(60)
        with open(run / "run2.txt", "w") as out:
            rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
            print(f"run 2 exited {rc.returncode}")
    print(f"output: {run / 'run1.txt'}, {run / 'run2.txt'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/slurmdemo")))
