"""The judge servers of a stage: each judge's `url` opened, or its `command` started (and
stopped however the stage ends) around the stage's use of its rewards.

A judge `command` runs like `rollout.server.command` (`posttrain.serving.process`: rank 0
starts it under a keeper, in a session of its own, with a parent-death signal; a record in
`logs/judge-<label>.json` lets a restarted stage stop what an earlier attempt left), waits for
its health path, and tells every rank the URL (or the reason it could not start, so every rank
fails with the same line). Its output goes to `logs/judge-<label>.log`. Judgements are cached in
`logs/judge-cache-<label>.rank<r>.jsonl`, which a resumed stage reads back (`logs/` is not part
of the artifact's files).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from posttrain.distributed import agree
from posttrain.rewards.combine import RewardFunction
from posttrain.rewards.judge import JudgeReward
from posttrain.serving.client import ServerClient, ServerFailed
from posttrain.serving.process import ServerProcess, fill_command, stop_leftover

log = logging.getLogger("posttrain.rewards")

HOST = "127.0.0.1"


@contextlib.contextmanager
def judge_servers(
    funcs: Sequence[RewardFunction], out_dir: Path, beat: Callable[[], None] = lambda: None
) -> Iterator[None]:
    """Every judge of `funcs` ready to call for the duration of the block (see the module
    docstring); the functions that are not judges are left as they are."""
    with contextlib.ExitStack() as stack:
        for f in funcs:
            if isinstance(f.fn, JudgeReward):
                stack.enter_context(_serving(f.fn, f.where or f.label, out_dir, beat))
        yield


@contextlib.contextmanager
def _serving(
    judge: JudgeReward, where: str, out_dir: Path, beat: Callable[[], None]
) -> Iterator[None]:
    logs = out_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    cache = logs / f"judge-cache-{judge.label}.rank{agree.rank()}.jsonl"
    proc: ServerProcess | None = None
    url = judge.cfg.url
    if judge.cfg.command is not None:
        url, proc = _start_command(judge, where, logs, beat)
    assert url is not None
    judge.open(url, cache, proc.last_said if proc is not None else None)
    try:
        yield
    finally:
        judge.close()
        if proc is not None:
            proc.stop()


def _start_command(
    judge: JudgeReward, where: str, logs: Path, beat: Callable[[], None]
) -> tuple[str, ServerProcess | None]:
    """Rank 0 starts the judge's command; every rank gets its URL (the server listens on this
    node's loopback: ranks on other nodes cannot reach it)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", agree.world()))
    if agree.world() > local:
        raise ServerFailed(
            f"{where}.command: a judge the stage starts serves this node only; on several "
            "nodes give `url` (a server every node reaches)"
        )
    url = error = None
    proc: ServerProcess | None = None
    if agree.rank() == 0:
        try:
            url, proc = _start(judge, where, logs, beat)
        except ServerFailed as e:
            error = str(e)
        except (ValueError, OSError) as e:  # a command that cannot run
            error = f"{where}.command: " + str(e).replace("rollout.server.command: ", "")
    url, error = agree.from_rank0((url, error))
    if error is not None:
        raise ServerFailed(error)
    assert url is not None
    return url, proc


def _start(
    judge: JudgeReward, where: str, logs: Path, beat: Callable[[], None]
) -> tuple[str, ServerProcess]:
    from posttrain.distributed.runtime import free_port

    name = f"judge-{judge.label}"
    if said := stop_leftover(logs / f"{name}.json"):
        log.warning("%s", said.replace("rollout server", f"judge server ({where})"))
    assert judge.cfg.command is not None
    port = free_port(HOST)
    argv = fill_command(judge.cfg.command, HOST, port, judge.cfg.model)
    log.info("starting the judge server (%s): %s", where, " ".join(argv))
    proc = ServerProcess.start(argv, {}, logs / f"{name}.log", logs / f"{name}.json")
    url = f"http://{HOST}:{port}"
    client = ServerClient(url, 10.0, 1, proc.last_said, "judge server")
    try:
        cfg = judge.cfg
        field = f"{where}.startup_timeout_s"
        waited = client.wait_healthy(
            cfg.health_path, cfg.startup_timeout_s, proc.exit_reason, beat, field
        )
    except BaseException:
        proc.stop()
        raise
    finally:
        client.close()
    log.info("judge server %s (%s) healthy after %.1f s", url, where, waited)
    return url, proc
