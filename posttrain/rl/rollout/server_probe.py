"""The stale-sampler check of `rollout.engine: server`: the server's own log-prob of every token
it sampled, held against the trainer's log-prob of the same token under the weights that should
have sampled it. A server that kept an old adapter, loaded the wrong one or lost a weight sync
scores its tokens otherwise than the trainer does, and the stage fails with `StaleSampler`
(`posttrain.rl.rollout.probe.compare`: the `fast` engine's verdict, tolerance and figures).

No extra forward: the trainer's side is the rollout's own scoring, "logps" [N, R] (the policy's
scoring pass, or the update's own log-probs taken before its one optimizer step), and for rows
sampled one update behind (`rollout.max_staleness: 1`) "behaviour_logps", the snapshot of the
version that sampled them (`posttrain.rl.rollout.offpolicy`). Every rollout is the first after
a weight refresh (the server gets the policy after every update), so every step is checked.

Comparable only where both sides mean one distribution. The trainer scores log softmax(z / T)
of the whole vocabulary (T = `rollout.temperature`). vLLM returns, by default
(`--logprobs-mode raw_logprobs`), log softmax(z) before temperature and top-k/top-p, and
after them with `processed_logprobs`; SGLang returns the log-probs of the distribution it
samples from (after temperature; before it with SGLANG_RETURN_ORIGINAL_LOGPROB). The three agree
at temperature 1 without top-k or top-p, and only there is the check run; otherwise it is skipped
and the log says why, once. `transformers serve` returns no log-probs (and re-tokenised text):
not checked, said once. Rows whose answer was re-tokenised or came without log-probs carry NaN
and are left out.
"""

from __future__ import annotations

import logging
import math

import torch

from posttrain.rl.rollout.probe import TOLERANCE, compare
from posttrain.rl.rollout.sample import Rollout
from posttrain.sections.shared import SamplingConfig
from posttrain.serving.api import Completion

log = logging.getLogger("posttrain.serving")
SERVER_TOLERANCE = TOLERANCE[torch.bfloat16]  # servers sample in bf16 on GPUs


def not_comparable(sampling: SamplingConfig) -> str | None:
    """Why a server's returned log-probs measure another distribution than the trainer's
    scoring under these settings, or None where they agree (temperature 1, no top-k/top-p)."""
    if sampling.strategy != "sample" or sampling.temperature != 1.0:
        return (
            f"rollout.temperature is {sampling.temperature:g}: vLLM returns log-probs before "
            "temperature (its default logprobs_mode raw_logprobs), SGLang after it, and the "
            "trainer scores after it; they agree at temperature 1 only"
        )
    if sampling.top_k or (sampling.top_p is not None and sampling.top_p < 1.0):
        return (
            f"rollout.top_k {sampling.top_k} / top_p {sampling.top_p}: a server that returns "
            "log-probs after top-k/top-p (vLLM's processed_logprobs) renormalises over the tokens "
            "kept, the trainer scores the whole vocabulary"
        )
    return None


def completion_logps(done: list[Completion], width: int, max_new_tokens: int) -> torch.Tensor:
    """[N, width] the server's log-prob of each response token (the ids cut to
    `max_new_tokens`), NaN where it gave none: a re-tokenised answer, none returned, or not one
    per id."""
    out = torch.full((len(done), width), math.nan)
    for i, c in enumerate(done):
        n = min(len(c.ids), max_new_tokens)
        if c.exact and c.logps is not None and len(c.logps) >= n:
            out[i, :n] = torch.tensor(c.logps[:n], dtype=torch.float32)
    return out


def trainer_logps(ro: Rollout, lag: torch.Tensor) -> torch.Tensor | None:
    """[N, R] the trainer's log-probs of each row under the weights that sampled it: the
    snapshot's ("behaviour_logps") for rows that lag, the policy's ("logps") for the others;
    None where the rollout has none."""
    logps = ro.scored.get("logps")
    if logps is None:
        return None
    behaviour = ro.scored.get("behaviour_logps")
    if behaviour is None or not bool((lag > 0).any()):
        return logps
    return torch.where((lag > 0)[:, None], behaviour, logps)


class ServerCheck:
    """The check of one stage's server engine: `api` ("vllm", "sglang", "transformers"),
    whether it returns log-probs, the rollout's sampling, `tolerance` (None: bf16's 0.05).
    Why it cannot run is logged once, at construction or at the first rollout that shows it."""

    def __init__(
        self, api: str, returns_logps: bool, sampling: SamplingConfig, tolerance: float | None
    ) -> None:
        self.api = api
        self.tolerance = SERVER_TOLERANCE if tolerance is None else tolerance
        self.why_not = (
            None
            if returns_logps
            else f"the {api} server returns no log-probs of the tokens it samples"
        ) or not_comparable(sampling)
        self._said: set[str] = set()
        if self.why_not:
            self._skip(self.why_not)

    def _skip(self, why: str) -> dict[str, float]:
        if why not in self._said:
            self._said.add(why)
            log.info("rollout.engine server (%s): the sampler is not checked: %s", self.api, why)
        return {}

    def __call__(self, ro: Rollout, lag: torch.Tensor) -> dict[str, float]:
        """The figures of rollout `ro` (`lag` [N]: updates each row's sampler was behind), or
        `StaleSampler`; {} when not checked. A collective under torch.distributed: every rank
        calls it (the reasons to skip are the same on every rank)."""
        if self.why_not:
            return {}
        sampler = ro.scored.get("sampler_logps")  # [N, R], `sample` keeps the engine's
        if sampler is None:
            return self._skip("episodes (rollout.tools / environment) keep no server log-probs")
        trainer = trainer_logps(ro, lag)
        if trainer is None:
            return self._skip("this kind's update keeps no policy log-probs of the rollout")
        mask = ro.mask.bool() & ~sampler.isnan()
        assert ro.versions is not None, "the policy's rollouts carry their versions"
        what = f"the tokens it sampled ({self.api}'s log-probs)"
        version = int(ro.versions.max()) if ro.n else -1
        figures = compare(
            sampler.nan_to_num(0.0), trainer, mask, self.tolerance, "server", version, what
        )
        return figures or self._skip("no answer carried the log-probs of its tokens")
