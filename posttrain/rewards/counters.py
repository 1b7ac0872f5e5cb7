"""Per-row counters a reward function reports beside its scores (the code verifier's runs,
timeouts, ...), for the stage's step records.

A reward function returns only its scores (TRL's contract), so counts travel on the side: the
function calls `record(name, per_row)` with one number per row of the call; the rewarder
`take`s them after calling the functions and keeps them beside the scores in the rollout
(`ro.scored["count:<name>"]` [N]), so they follow the rows through selection and
concatenation and are summed into the step's record as `<name>`. Rewards are called from one
thread per process, one batch at a time; the lock only guards a function's own worker threads.
"""

from __future__ import annotations

import threading

_lock = threading.Lock()
_pending: dict[str, list[float]] = {}


def record(name: str, per_row: list[float]) -> None:
    """Add `per_row` (one count per row of the current call) to the counter `name`; two calls
    on the same rows (two code rewards in one recipe) add up."""
    with _lock:
        have = _pending.get(name)
        if have is not None and len(have) == len(per_row):
            _pending[name] = [a + b for a, b in zip(have, per_row, strict=True)]
        else:
            _pending[name] = list(per_row)


def take(n: int) -> dict[str, list[float]]:
    """The counters recorded since the last `take` that hold `n` rows (others came from calls
    on other batches, such as a held-out evaluation, and are dropped), and clear them."""
    with _lock:
        got = {k: v for k, v in _pending.items() if len(v) == n}
        _pending.clear()
    return got
