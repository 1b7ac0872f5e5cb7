"""One update behind (`rollout.max_staleness: 1`): the next rollout is sampled while this one
trains, and the update corrects for the lag.

The timeline of step t (version v = the updates applied so far; the server holds v):
1. the rollout of step t is taken: generated in the background during step t - 1, by version
   v - 1 (the first step of a stage, or of a resume, generates it now, by v);
2. step t + 1's rollout starts generating in the background, by v (`Prefetch`): generation
   then overlaps this step's scoring and update, on a server that is not the trainer;
3. the rollout is scored; rows sampled by v - 1 also get their log-probs under v - 1
   (`score_behaviour`: the policy adapter of v - 1 was kept, `PolicySnapshot`, and is swapped
   in for one no-grad pass), for the truncated importance weights of the update
   (`posttrain.rl.losses.truncated_importance_weights`);
4. the adapter of v is kept, the update trains, the background generation is waited for, and
   the server gets v + 1.
Only generation runs in the background thread: it makes HTTP requests and no collective, while
every forward of the sharded model (a collective) stays on the main thread.

Every row carries the version that sampled it (`Rollout.versions`); one more than
`max_staleness` behind (or ahead) fails the stage (`StaleRollout`): nothing is ever trained on
as if it were fresher than it is.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch

from posttrain.distributed.runtime import all_reduce_sum
from posttrain.errors import StageVerdict
from posttrain.models.adapters import POLICY
from posttrain.models.roles import adapter_of
from posttrain.rl.rollout.collect import RolloutSetup, score_rollout
from posttrain.rl.rollout.sample import Rollout


class StaleRollout(StageVerdict):
    """A rollout sampled by other weights than the update may correct for."""


def staleness(ro: Rollout, version: int, max_staleness: int) -> torch.Tensor:
    """[N] long: how many updates behind `version` each row's sampler was; a row further
    behind than `max_staleness` (or ahead, or with no version) fails."""
    if ro.versions is None:
        raise StaleRollout("a rollout reached the update without the version that sampled it")
    lag = version - ro.versions
    if bool((lag < 0).any()) or bool((lag > max_staleness).any()):
        raise StaleRollout(
            f"a rollout sampled by policy versions {sorted(set(ro.versions.tolist()))} reached "
            f"the update of version {version}; rollout.max_staleness is {max_staleness}"
        )
    return lag


class PolicySnapshot:
    """The policy adapter's parameters (this rank's shards) as they were at `take()`, which
    `active()` swaps into the model for a moment. LoRA weights: megabytes, not a model copy."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.params = [p for n, p in model.named_parameters() if adapter_of(n) == POLICY]
        self.saved: list[torch.Tensor] | None = None

    def take(self) -> None:
        self.saved = [p.detach().clone() for p in self.params]

    @contextmanager
    def active(self) -> Iterator[None]:
        assert self.saved is not None, "take() first"
        now = [p.detach().clone() for p in self.params]
        with torch.no_grad():
            for p, s in zip(self.params, self.saved, strict=True):
                p.copy_(s)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, s in zip(self.params, now, strict=True):
                    p.copy_(s)


@torch.no_grad()
def score_behaviour(
    s: RolloutSetup, ro: Rollout, lag: torch.Tensor, snapshot: PolicySnapshot, device: torch.device
) -> None:
    """`ro.scored["behaviour_logps"]` [N, R]: every row's log-probs under the snapshot's
    weights, when any rank has a row that lagged (all rows: the forwards are collectives)."""
    if not all_reduce_sum(float(bool((lag > 0).any())), device):
        return
    scratch = replace(ro, scored={})
    with snapshot.active():
        score_rollout(s, scratch, None, (POLICY,))
    ro.scored["behaviour_logps"] = scratch.scored["logps"]


class Prefetch:
    """One generation running in a daemon thread: `start(step, fn)`, then `take(step)` its
    result (None when none was started for that step) or its exception. A daemon, so a stage
    that fails meanwhile is not held up at exit by a request still waiting."""

    def __init__(self) -> None:
        self._step: int | None = None
        self._done = threading.Event()
        self._out: Any = None
        self._error: BaseException | None = None
        self.seconds = 0.0  # how long the last generation took, wherever it waited

    def start(self, step: int, fn: Callable[[], Any]) -> None:
        assert self._step is None, "one generation at a time"
        self._step, self._out, self._error = step, None, None
        self._done.clear()

        def run() -> None:
            t = time.perf_counter()
            try:
                self._out = fn()
            except BaseException as e:  # re-raised in the main thread by take()
                self._error = e
            self.seconds = time.perf_counter() - t
            self._done.set()

        threading.Thread(target=run, name=f"rollout-step{step + 1}", daemon=True).start()

    def wait(self) -> None:
        if self._step is not None:
            self._done.wait()

    def take(self, step: int) -> Any:
        if self._step != step:
            return None
        self._done.wait()
        self._step = None
        if self._error is not None:
            raise self._error
        return self._out
