"""Online DPO's pair selection: from a judge's scores of each prompt's k samples, the best/worst
pair that trains a DPO step; groups with nothing to prefer are skipped and counted.

Pure functions on plain lists (scores as the judge gave them: a reward model's scalars, the
verifiers' rewards, or a mix), so the stage can call them on gathered scores and log the counts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

Pair = tuple[int, int, int]  # (prompt index, chosen sample index, rejected sample index)


@dataclass(frozen=True)
class PairSelection:
    """The pairs of one batch of prompts and what became of the others."""

    pairs: list[Pair]  # one per informative prompt, in prompt order
    informative: int  # prompts that gave a pair (= len(pairs))
    all_equal: int  # prompts whose samples' scores are all within tie_eps of each other

    @property
    def informative_frac(self) -> float:  # 0.0 for an empty batch
        total = self.informative + self.all_equal
        return self.informative / total if total else 0.0


def _best_worst(group: list[float], prompt: int) -> tuple[int, int]:
    if len(group) < 2:
        raise ValueError(f"prompt {prompt} has {len(group)} scored samples: a pair needs k >= 2")
    if any(math.isnan(x) for x in group):
        raise ValueError(f"prompt {prompt}'s scores hold NaN: {group}")
    best = max(range(len(group)), key=group.__getitem__)  # max/min return the first on ties
    worst = min(range(len(group)), key=group.__getitem__)
    return best, worst


def select_pairs(scores: list[list[float]], tie_eps: float = 0.0) -> PairSelection:
    """scores[i]: the judge's scores of prompt i's k >= 2 samples. The best and worst (the
    first index on ties) form a (chosen, rejected) pair when best - worst > tie_eps (the score
    difference a judge's noise could make: 0 with exact verifiers); otherwise the prompt is
    skipped as all_equal."""
    if tie_eps < 0:
        raise ValueError(f"tie_eps must be >= 0, got {tie_eps}")
    pairs: list[Pair] = []
    all_equal = 0
    for i, group in enumerate(scores):
        best, worst = _best_worst(group, i)
        if group[best] - group[worst] > tie_eps:
            pairs.append((i, best, worst))
        else:
            all_equal += 1
    return PairSelection(pairs=pairs, informative=len(pairs), all_equal=all_equal)


def judge_agreement(
    a: list[list[float]], b: list[list[float]], tie_eps: float = 0.0
) -> float | None:
    """Share of prompts where two judges of the same samples (say a reward model and the
    verifiers) select the same (chosen, rejected) pair, among the prompts both find informative
    (select_pairs with tie_eps on each). None when no prompt is informative to both.

    Ties are broken by the first index for both judges, so a judge that ties (a 0/1 verifier)
    agrees only when the other's best and worst happen to be its first tied ones: this is
    agreement on the pair trained on, not on the ranking."""
    if len(a) != len(b):
        raise ValueError(f"the judges scored {len(a)} and {len(b)} prompts")
    for i, (ga, gb) in enumerate(zip(a, b, strict=True)):
        if len(ga) != len(gb):
            raise ValueError(f"prompt {i}: the judges scored {len(ga)} and {len(gb)} samples")
    pairs_a = {p[0]: p for p in select_pairs(a, tie_eps).pairs}
    pairs_b = {p[0]: p for p in select_pairs(b, tie_eps).pairs}
    both = pairs_a.keys() & pairs_b.keys()
    if not both:
        return None
    return sum(pairs_a[i] == pairs_b[i] for i in both) / len(both)
