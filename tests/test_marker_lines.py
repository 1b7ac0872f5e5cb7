"""Marker lines (POSTTRAIN_ERROR, POSTTRAIN_ARTIFACT) stay whole when ranks share one pipe.

Under torchrun every rank writes to the launcher's stderr; two ranks failing with the same verdict
at the same moment once glued their lines into one ("...reused.POSTTRAIN_ERROR stage sft ..."),
and a reader counting verdicts saw one. Real processes, one shared pipe, racing."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.stage_helpers import ROOT

WRITER = """
import sys
from posttrain.stages.common import emit_line
msg = "POSTTRAIN_ERROR stage sft failed: DiskFull: " + sys.argv[1] * 600
for _ in range(2000):
    emit_line(msg, sys.stderr)
"""


def test_ranks_racing_on_one_pipe_keep_their_lines_whole() -> None:
    # Both writers inherit the one stderr pipe of the shell, as ranks inherit torchrun's.
    cmd = f"{sys.executable} -c '{WRITER}' a & {sys.executable} -c '{WRITER}' b & wait"
    # Unbuffered, as the flow and the tests start stages: each write is a syscall of its own.
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    out = subprocess.run(["bash", "-c", cmd], cwd=ROOT, env=env, capture_output=True, text=True)
    out = out.stderr
    lines = out.splitlines()
    assert len(lines) == 4000, out[-500:]
    assert all(x.startswith("POSTTRAIN_ERROR stage sft failed: DiskFull: ") for x in lines)
    assert all(x.endswith("a" * 600) or x.endswith("b" * 600) for x in lines)
