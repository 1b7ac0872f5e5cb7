"""`ServerEngine`: the `RolloutEngine` (`posttrain.rl.rollout.engine`) that samples from a
rollout server (`posttrain.serving.server`).

Each prompt is one request, `max_concurrency` in flight per rank; ranks send theirs on their
own (no collective: the server batches them), so an episode loop on this engine needs no
lock-step between ranks. Every answer is checked: it must come from the model the request
named (the policy version the engine stands for), or the stage fails: a rollout the engine
cannot vouch for is never trained on as if it were fresh. What each call saw is counted for the
step's metrics (`take_counts`): responses, those with the sampled ids (`exact`), the
re-tokenised ones the server's own token count contradicts, prompts the server read as another
length than sent. The server's log-prob of each sampled token is kept for the rollout
(`take_logps`) and, once the rollout is scored, held against the trainer's (`check_rollout`,
`posttrain.rl.rollout.server_probe`).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter

import torch

from posttrain.rl.rollout.engine import right_pad
from posttrain.rl.rollout.sample import Rollout
from posttrain.rl.rollout.server_probe import ServerCheck, completion_logps
from posttrain.sections.shared import SamplingConfig
from posttrain.serving.api import Completion, ServerError
from posttrain.serving.server import RolloutServer

log = logging.getLogger("posttrain.serving")


class ServerEngine:
    """Samples `role` ("policy": the version the server holds now; "reference": the stage's
    reference policy) from `server`; `check`: the policy's stale-sampler check (None: none)."""

    collective = False  # generate runs no collective: ranks sample independently

    def __init__(self, server: RolloutServer, role: str, check: ServerCheck | None = None) -> None:
        self.server, self.role, self.check = server, role, check
        # Per thread: a rollout generated ahead in the background counts apart from the
        # main thread's calls (`posttrain.rl.rollout.offpolicy`).
        self._local = threading.local()
        self._warned = False

    @property
    def counts(self) -> Counter[str]:
        if not hasattr(self._local, "counts"):
            self._local.counts = Counter()
        return self._local.counts

    @property
    def version(self) -> int:
        """The policy version this engine samples (-1 for the reference)."""
        return self.server.version if self.role == "policy" else -1

    def generate(
        self,
        prompts: list[list[int]],
        sampling: SamplingConfig,
        stop_ids: list[int],
        pad_id: int,
        seed: int,
        turns: bool = False,
    ) -> torch.Tensor:
        s = self.server
        model = s.names[self.role]
        # One seed per row: rows of one call must not share a random stream on servers that
        # honour seeds (transformers serve without continuous batching, vLLM, SGLang).
        bodies = [
            s.api.request(p, model, sampling, stop_ids, (seed * 1_000_003 + i) % 2**31)
            for i, p in enumerate(prompts)
        ]
        answers = s.client.post_many(s.api.path, bodies)
        try:
            done = [s.api.parse(a, stop_ids) for a in answers]
        except ServerError as e:
            raise s.client.failed(f"gave an answer that is not a completion ({e})") from None
        for c, p in zip(done, prompts, strict=True):
            self._check(c, model, len(p))
        out = right_pad([c.ids[: sampling.max_new_tokens] for c in done], pad_id)  # [N, R]
        self._local.logps = completion_logps(done, out.size(1), sampling.max_new_tokens)
        return out

    def _check(self, c: Completion, model: str, prompt_len: int) -> None:
        """Count what an answer says; fail on one from another model than asked."""
        if self.server.api.named_versions and c.model is not None and c.model != model:
            raise self.server.client.failed(
                f"answered with model {c.model!r} when {model!r} was asked: the rollout would "
                "come from other weights than the policy's version"
            )
        self.counts["responses"] += 1
        self.counts["exact"] += int(c.exact)
        self.counts["retokenized_mismatch"] += int(c.known_mismatch)
        if c.prompt_tokens is not None and c.prompt_tokens != prompt_len:
            self.counts["prompt_mismatch"] += 1
            if not self._warned:
                self._warned = True
                log.warning(
                    "the rollout server read a prompt of %d tokens as %d: its tokenizer does not "
                    "give the stage's ids back (an added BOS?)",
                    prompt_len,
                    c.prompt_tokens,
                )

    def take_counts(self) -> dict[str, float]:
        out = {k: float(v) for k, v in self.counts.items()}
        self.counts.clear()
        return out

    def take_logps(self) -> torch.Tensor | None:
        """[N, R] the server's log-prob of each token of this thread's last call (NaN where
        it gave none), or None without a check to feed."""
        logps, self._local.logps = getattr(self._local, "logps", None), None
        return logps if self.check is not None else None

    def check_rollout(self, ro: Rollout, lag: torch.Tensor) -> dict[str, float]:
        """The stale-sampler check (`posttrain.rl.rollout.server_probe`) of the scored `ro`."""
        return self.check(ro, lag) if self.check is not None else {}

    def release(self) -> None:
        pass  # the server's own prefix cache keeps what it keeps

    def sync_weights(self, model: torch.nn.Module) -> dict[str, float]:
        """The next policy version (a collective): the model's adapter, written and loaded.
        No probe figures here: the first rollout after it is checked (`check_rollout`)."""
        if self.role != "policy":
            raise ValueError("only the policy's engine syncs weights")
        self.server.sync(model, self.server.version + 1)
        return {}
