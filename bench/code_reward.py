"""What scoring code costs: programs per second through `posttrain.rewards.code:code_tests`,
sandboxed (bubblewrap) and not, at several worker counts, and what the cache saves.

The workload is a GRPO-like batch: `--replies` replies to MBPP-style rows with 3 asserts each
(one process per assert), half the replies right and half wrong (a wrong answer runs to its
failed assert, as most of a rollout's failures do), all with distinct programs so nothing hits
the cache. Each row of the table is one configuration, timed on a cold cache (best of
`--rounds`); the last line scores the same batch a second time (every test from the cache).

    python bench/code_reward.py [--replies 32] [--workers 1,2,4] [--rounds 2] [--parent-mib 512]

`--parent-mib` makes this process hold that much touched memory first, as a stage holding a
model does: what starting each program costs depends on the size of the process that starts it
(a fork copies its page tables; a vfork does not).

Ratios are to the unsandboxed run at the same worker count: the sandbox's own cost.
"""

from __future__ import annotations

import argparse
import time

from posttrain.rewards import code, counters
from posttrain.rewards.sandbox import unavailable


def batch(n: int) -> tuple[list, list, dict]:
    """`n` replies (distinct programs, every other one wrong) and their rows' tests."""
    prompts, completions, tests = [], [], []
    for i in range(n):
        body = f"x + {i}" if i % 2 == 0 else f"x - {i} + 1"  # right: adds i; wrong: does not
        reply = f"```python\ndef add_{i}(x):\n    return {body}\n```"
        prompts.append([{"role": "user", "content": f"add {i}"}])
        completions.append([{"role": "assistant", "content": reply}])
        tests.append([f"assert add_{i}({k}) == {k + i}" for k in (1, 2, 3)])
    return prompts, completions, {"test_list": tests}


def timed(n: int, sandbox: str, workers: int, rounds: int) -> tuple[float, int]:
    """(best seconds for scoring a cold batch, programs run in it)."""
    prompts, completions, columns = batch(n)
    best, runs = float("inf"), 0
    for _ in range(rounds):
        code._cache.clear()
        counters.take(0)
        t = time.perf_counter()
        code.code_tests(prompts, completions, sandbox=sandbox, workers=workers, **columns)
        best = min(best, time.perf_counter() - t)
        runs = int(sum(counters.take(n).get("code_runs", [])))
    return best, runs


def cached(n: int, workers: int) -> float:
    """Seconds to score the batch again with every test in the cache."""
    prompts, completions, columns = batch(n)
    code.code_tests(prompts, completions, sandbox="bwrap", workers=workers, **columns)
    t = time.perf_counter()
    code.code_tests(prompts, completions, sandbox="bwrap", workers=workers, **columns)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replies", type=int, default=32)
    ap.add_argument("--workers", default="1,2,4")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--parent-mib", type=int, default=0)
    args = ap.parse_args()
    held = bytearray(args.parent_mib << 20)  # zero-filled: every page touched
    held[:: 1 << 12] = b"\1" * len(held[:: 1 << 12])
    if (why := unavailable()) is not None:
        raise SystemExit(f"bubblewrap cannot run here: {why}")
    n = args.replies
    print(
        f"{n} replies x 3 asserts = {3 * n} programs, half failing; best of {args.rounds}; "
        f"this process holds {len(held) >> 20} MiB"
    )
    print(f"{'workers':>7}  {'bwrap prog/s':>12}  {'none prog/s':>11}  {'bwrap/none':>10}")
    for w in (int(x) for x in args.workers.split(",")):
        s_box, runs = timed(n, "bwrap", w, args.rounds)
        s_none, _ = timed(n, "none", w, args.rounds)
        box, none = runs / s_box, runs / s_none
        print(f"{w:>7}  {box:>12.1f}  {none:>11.1f}  {box / none:>9.2f}x")
    w = max(int(x) for x in args.workers.split(","))
    print(f"cached: the same {3 * n} tests again in {cached(n, w) * 1000:.1f} ms (no run)")


if __name__ == "__main__":
    main()
