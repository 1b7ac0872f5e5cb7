"""The quickstart task: small instruction data the project generates itself, learnable in minutes.

Five templated skills (addition, list reversal, sorting, capitals, word counting). Answers are
deterministic functions of the prompt, so held-out loss and exact-match show learning, and wrong
answers make natural rejected responses for preference stages.
"""

from __future__ import annotations

import random
from collections.abc import Callable

WORDS = [
    "apple",
    "river",
    "stone",
    "cloud",
    "tiger",
    "piano",
    "garden",
    "rocket",
    "candle",
    "forest",
    "mirror",
    "silver",
    "ocean",
    "pencil",
    "winter",
    "orange",
    "castle",
    "dragon",
    "meadow",
    "button",
    "violin",
    "desert",
    "island",
    "planet",
    "lantern",
    "harbor",
    "jacket",
    "marble",
    "needle",
    "pepper",
    "rabbit",
    "saddle",
    "thunder",
    "velvet",
    "wagon",
    "yellow",
    "zebra",
    "anchor",
    "bridge",
    "copper",
]

CAPITALS = {
    "France": "Paris",
    "Germany": "Berlin",
    "Italy": "Rome",
    "Spain": "Madrid",
    "Japan": "Tokyo",
    "Canada": "Ottawa",
    "Egypt": "Cairo",
    "Kenya": "Nairobi",
    "Peru": "Lima",
    "Norway": "Oslo",
    "Greece": "Athens",
    "India": "New Delhi",
    "Chile": "Santiago",
    "Poland": "Warsaw",
    "Cuba": "Havana",
    "Ireland": "Dublin",
    "Austria": "Vienna",
    "Portugal": "Lisbon",
    "Sweden": "Stockholm",
    "Mexico": "Mexico City",
}

SYSTEM_PROMPT = "You are a precise assistant. Answer in one short line."

# A task returns (prompt, correct answer, plausible wrong answer).
Task = Callable[[random.Random], tuple[str, str, str]]


def _add(rng: random.Random) -> tuple[str, str, str]:
    a, b = rng.randint(0, 49), rng.randint(0, 49)
    wrong = a + b + rng.choice([-2, -1, 1, 2, 10])
    return f"What is {a} + {b}?", f"{a} + {b} = {a + b}.", f"{a} + {b} = {wrong}."


def _reverse(rng: random.Random) -> tuple[str, str, str]:
    words = rng.sample(WORDS, rng.randint(3, 5))
    right = " ".join(reversed(words))
    shuffled = words[:]
    while shuffled == words[::-1]:
        rng.shuffle(shuffled)
    return f"Reverse the list: {' '.join(words)}", right, " ".join(shuffled)


def _sort(rng: random.Random) -> tuple[str, str, str]:
    nums = rng.sample(range(1, 60), rng.randint(3, 5))
    right = " ".join(map(str, sorted(nums)))
    wrong = " ".join(map(str, sorted(nums, reverse=True)))
    return f"Sort ascending: {' '.join(map(str, nums))}", right, wrong


def _capital(rng: random.Random) -> tuple[str, str, str]:
    country = rng.choice(sorted(CAPITALS))
    other = rng.choice([c for c in sorted(CAPITALS) if c != country])
    return (
        f"What is the capital of {country}?",
        f"The capital of {country} is {CAPITALS[country]}.",
        f"The capital of {country} is {CAPITALS[other]}.",
    )


def _count(rng: random.Random) -> tuple[str, str, str]:
    n = rng.randint(2, 6)
    words = rng.sample(WORDS, n)
    wrong = n + rng.choice([-1, 1])
    return (
        f"How many words are in: {' '.join(words)}?",
        f"There are {n} words.",
        f"There are {wrong} words.",
    )


TASKS: dict[str, Task] = {
    "add": _add,
    "reverse": _reverse,
    "sort": _sort,
    "capital": _capital,
    "count": _count,
}


def quickstart_triples(n: int, seed: int) -> list[tuple[str, str, str, str]]:
    """n (task, prompt, correct, wrong) tuples, tasks in round-robin, deterministic in seed."""
    rng = random.Random(seed)
    names = sorted(TASKS)
    return [(names[i % len(names)], *TASKS[names[i % len(names)]](rng)) for i in range(n)]


def quickstart_sft_rows(n: int, seed: int) -> list[dict]:
    """Conversational SFT rows: {"messages": [...], "task": name}. Every third row has a system
    prompt so templates with and without one are both exercised."""
    rows = []
    for i, (task, prompt, answer, _) in enumerate(quickstart_triples(n, seed)):
        msgs = [{"role": "system", "content": SYSTEM_PROMPT}] if i % 3 == 0 else []
        msgs += [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
        rows.append({"messages": msgs, "task": task})
    return rows


def pretrain_corpus(n: int, seed: int) -> list[str]:
    """Plain-text documents over the same vocabulary and facts, for tokenizer training and a
    causal-LM warm-up of a from-config base (no chat format: SFT has to teach that)."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        a, b = rng.randint(0, 49), rng.randint(0, 49)
        country = rng.choice(sorted(CAPITALS))
        words = rng.sample(WORDS, rng.randint(3, 6))
        nums = rng.sample(range(1, 60), 4)
        docs.append(
            rng.choice(
                [
                    f"{a} plus {b} is {a + b}. So {a} + {b} = {a + b}.",
                    f"The capital of {country} is {CAPITALS[country]}. {CAPITALS[country]} is in {country}.",
                    f"The words {' '.join(words)} in reverse are {' '.join(reversed(words))}.",
                    f"The numbers {' '.join(map(str, nums))} sorted are {' '.join(map(str, sorted(nums)))}.",
                    f"There are {len(words)} words in: {' '.join(words)}.",
                ]
            )
        )
    return docs
