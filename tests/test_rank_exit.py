"""Reading torchrun's failure summary and describing the rank that died (fast, no processes)."""

from __future__ import annotations

from flows.stage.rank_exit import RankExit, describe_beat, describe_exit, root_causes

# torchrun 2.13's summary after `kill -9` of local rank 1 (copied from a real stage log).
SUMMARY = """\
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
======================================================
posttrain.stages.sft FAILED
------------------------------------------------------
Failures:
[1]:
  time      : 2026-12-01_07:40:48
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 4113)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 4113
------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-01_07:40:47
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 4114)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 4114
======================================================
"""


def test_root_cause_is_the_first_failed_rank_not_the_ones_stopped_after_it() -> None:
    assert root_causes(SUMMARY.splitlines()) == [RankExit(1, -9, 4114, "localhost")]


def test_no_summary_and_last_summary_wins() -> None:
    assert root_causes(["Traceback", "RuntimeError: boom"]) == []
    other = SUMMARY.replace("rank      : 1 (local_rank: 1)", "rank      : 3 (local_rank: 1)")
    other = other.replace("-9 (pid: 4114)  (SIGKILL)", "1 (pid: 99)")
    assert root_causes([*SUMMARY.splitlines(), *other.splitlines()]) == [
        RankExit(3, 1, 99, "localhost")
    ]


def test_describe_exit_names_rank_pid_signal_and_last_beat() -> None:
    beats = {1: {"rank": 1, "pid": 4114, "step": 7, "phase": "train", "time": 1000.0}}
    line = describe_exit(RankExit(1, -9, 4114, "localhost"), beats, now=1002.2)
    assert line == (
        "rank 1 (pid 4114) was killed by SIGKILL; its last heartbeat: step 7, phase train, 2 s before"
    )
    assert describe_exit(RankExit(0, 1, None, "node7"), beats, now=0) == (
        "rank 0 on node7 exited with code 1; its last heartbeat: none (it died before its "
        "first beat)"
    )
    assert describe_beat({"step": None, "phase": "setup", "time": 5.0}, now=9.0) == (
        "before its first step, phase setup, 4 s before"
    )
