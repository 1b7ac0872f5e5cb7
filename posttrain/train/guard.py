"""Numerical guards of a training stage: which optimizer steps are bad, and when to give up.

Pure bookkeeping (no torch): `TrainSession.optimizer_step` asks `StepGuard.judge` about each
step's loss and gradient norm, skips the update of a bad step, then tells `StepGuard.commit`,
which raises `TooManyBadSteps` once more than `max_bad_steps` of the last `window` optimizer steps
were bad. Every rank feeds it the same numbers (the loss is all-reduced, the clipped norm is
global), so every rank takes the same decisions without another collective.

A bad step is one whose loss or global gradient norm is not finite, or (with `loss_spike_k`)
whose loss exceeds mean + k x std of the last `loss_spike_window` good losses once at least
`loss_spike_min_history` of them exist. Skipped losses never enter that history: a burst of
divergence cannot drag the baseline up and hide itself.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

from posttrain.sections.shared import GuardConfig


class TooManyBadSteps(RuntimeError):
    """More bad optimizer steps within the guard's window than `guard.max_bad_steps`."""

    def __init__(self, message: str, step: int, bad: list[tuple[int, str]]):
        super().__init__(message)
        self.step = step
        self.bad = bad  # (step, reason) of the bad steps in the window, oldest first


def _mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and population standard deviation."""
    mean = sum(values) / len(values)
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))


class StepGuard:
    """The window of recent verdicts and the history of good losses of one training stage."""

    def __init__(self, cfg: GuardConfig, where: str = "training"):
        self.cfg = cfg
        self.where = where  # names the stage in errors
        # (step, reason or None) of the last `window` optimizer steps, oldest first
        self.recent: deque[tuple[int, str | None]] = deque(maxlen=cfg.window)
        self.good_losses: deque[float] = deque(maxlen=cfg.loss_spike_window)
        self.skipped = 0  # bad steps of this stage so far (resume included)

    def judge(self, loss: float, grad_norm: float, check_norm: bool = True) -> str | None:
        """Why this step is bad, or None when its update may be applied. `check_norm=False`
        when a loss scaler owns non-finite gradients (fp16 overflow lowers its scale)."""
        if not math.isfinite(loss):
            return f"non-finite loss ({loss})"
        if check_norm and not math.isfinite(grad_norm):
            return f"non-finite grad norm ({grad_norm})"
        k = self.cfg.loss_spike_k
        if k is not None and len(self.good_losses) >= self.cfg.loss_spike_min_history:
            mean, std = _mean_std(list(self.good_losses))
            limit = mean + k * std
            if loss > limit:
                return (
                    f"loss spike ({loss:.6g} > mean {mean:.6g} + {k:g} x std {std:.6g} "
                    f"= {limit:.6g} of the last {len(self.good_losses)} good steps)"
                )
        return None

    def commit(self, step: int, loss: float, reason: str | None) -> None:
        """Record this step's verdict. Raises `TooManyBadSteps` when the window holds more bad
        steps than allowed (the update was already skipped: nothing bad is applied)."""
        self.recent.append((step, reason))
        if reason is None:
            self.good_losses.append(loss)
            return
        self.skipped += 1
        bad = [(s, r) for s, r in self.recent if r is not None]
        if len(bad) > self.cfg.max_bad_steps:
            listing = "; ".join(f"step {s}: {r}" for s, r in bad)
            raise TooManyBadSteps(
                f"{self.where}: stopped at step {step}: {len(bad)} bad steps within the last "
                f"{len(self.recent)} optimizer steps (guard.max_bad_steps {self.cfg.max_bad_steps},"
                f" guard.window {self.cfg.window}) - {listing}. Their updates were skipped and "
                "no checkpoint was written after them: the newest checkpoint holds the last good "
                "state. Lower the learning rate, check the data of these steps, or raise "
                "guard.max_bad_steps, then re-run to resume.",
                step,
                bad,
            )

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state for a checkpoint's meta.json, so a resumed run decides as the
        uninterrupted run would."""
        return {
            "recent": [list(x) for x in self.recent],
            "good_losses": list(self.good_losses),
            "skipped": self.skipped,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.recent.clear()
        self.recent.extend((int(s), r) for s, r in state.get("recent", []))
        self.good_losses.clear()
        self.good_losses.extend(float(v) for v in state.get("good_losses", []))
        self.skipped = int(state.get("skipped", 0))
