"""Per-row counters a reward function reports beside its scores (the code verifier's runs,
timeouts, ...), for the stage's step records.

A reward function returns only its scores (TRL's contract), so counts travel on the side: the
function calls `record(name, per_row)` with one number per row of the call; the rewarder
`take`s them after calling the functions and keeps them beside the scores in the rollout
(`ro.scored["count:<name>"]` [N]), so they follow the rows through selection and
concatenation and are summed into the step's record as `<name>`. Rewards are called from one
thread per process, one batch at a time; the lock only guards a function's own worker threads.

Beside the counts, a few lines of text (the code verifier's error lines, `NameError: ...`) go by
`note(line)`; `take_notes()` returns how often each came (read them before `take`, which clears
them too: a stage that never reads them does not hold them).
"""

from __future__ import annotations

import threading
from collections import Counter

_lock = threading.Lock()
_pending: dict[str, list[float]] = {}
_notes: Counter[str] = Counter()
# Distinct lines kept until the next take: a summary shows the few most common, and a batch
# whose programs all fail differently must not grow without bound.
_MAX_NOTES = 256


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
        _notes.clear()
    return got


def note(line: str) -> None:
    """Count one occurrence of `line` (an error line), until the next `take` or `take_notes`;
    a new line past `_MAX_NOTES` distinct ones is dropped."""
    with _lock:
        if line in _notes or len(_notes) < _MAX_NOTES:
            _notes[line] += 1


def take_notes() -> Counter[str]:
    """The lines noted since the last `take` or `take_notes`, with their counts; clears them."""
    with _lock:
        got = Counter(_notes)
        _notes.clear()
    return got
