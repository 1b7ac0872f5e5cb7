"""How a global batch is split must not change what SFT computes.

The sft stage backprops sum(token NLL) * world / N_targets(global batch) per micro-batch and FSDP2
averages gradients over ranks, so every target token of the global batch weighs the same however
the batch is cut into micro-batches, accumulation steps and ranks. These tests run the real stage
on data built so that micro-batches hold very different numbers of target tokens (two rows with
long answers, two with one-word answers in every optimizer step), where a per-micro-batch or
per-rank mean would give a visibly different loss and gradient:

- micro 2 x accum 2 equals micro 4 x accum 1 (one rank): losses, grad norms, adapter weights;
- 2 ranks x micro 2 (torchrun) gives the same trajectory too;
- the step-1 loss equals a hand computation: the base model's token-mean NLL over exactly the rows
  `step_indices` picks for step 0 (LoRA B starts at zero, so the policy is the base), and the
  step-1 gradient norm equals that of the token-mean loss recomputed by autograd.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from stage_helpers import TINY, planned_dir, run_inprocess, run_shared, run_torchrun, write_recipe

from posttrain.config.loader import load_recipe
from posttrain.data.batching import step_indices
from posttrain.data.chat import IGNORE
from posttrain.data.sft_data import prepare
from posttrain.data.synthetic import quickstart_sft_rows
from posttrain.models.loading import load_base, load_tokenizer
from posttrain.telemetry.records import read_metrics

pytestmark = pytest.mark.slow

SEED = 0
GLOBAL = 4  # rows per optimizer step, split three ways below
STEPS = 6
N_TRAIN = GLOBAL * STEPS  # one epoch: the long/short layout below holds for every step
# Stream positions (mod GLOBAL) that get a long answer: micro-batch 0 (micro 2) / rank 0 gets the
# long rows, micro-batch 1 / rank 1 the one-word ones.
LONG_SLOTS = (0, 1)

# How the global batch of 4 is split. The sft fingerprint depends on the global batch only, so
# each variant runs in a workspace of its own.
VARIANTS = {
    "micro4": ("sft.batch.micro_batch_size=4", "sft.batch.grad_accum_steps=1"),
    "micro2_accum2": ("sft.batch.micro_batch_size=2", "sft.batch.grad_accum_steps=2"),
    "ranks2_micro2": (
        "infra.devices_per_node=2",
        "sft.batch.micro_batch_size=2",
        "sft.batch.grad_accum_steps=1",
    ),
}


def _dataset() -> tuple[list[dict], list[dict]]:
    """(train rows, eval rows): a row at a LONG_SLOTS stream position of epoch 0 answers with
    several sentences (~50 target tokens), every other row with one word (~4 target tokens)."""
    pool = quickstart_sft_rows(8 * N_TRAIN, 7)
    questions = [r["messages"][-2]["content"] for r in pool]
    answers = [r["messages"][-1]["content"] for r in pool]
    perm = step_indices(N_TRAIN, 0, micro=N_TRAIN, accum=1, dp_size=1, rank=0, seed=SEED)[0]
    train: list[dict | None] = [None] * N_TRAIN
    for pos, row in enumerate(perm):
        i = pos * 6
        if pos % GLOBAL in LONG_SLOTS:
            answer = " ".join(answers[i : i + 6])
        else:
            answer = answers[i].split()[-1].strip(".")
        train[row] = {"prompt": questions[i], "completion": answer}
    # Held out: four ordinary rows the training rows do not use.
    evals = [{"prompt": questions[-k], "completion": answers[-k]} for k in range(1, 5)]
    return [r for r in train if r is not None], evals


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def env(tmp_path_factory, shared_parents: Path) -> dict:
    folder = tmp_path_factory.mktemp("equivalence")
    train, evals = _dataset()
    data = copy.deepcopy(TINY)
    data["infra"]["threads_per_rank"] = 1
    data["run"]["allowed_paths"] = [str(folder)]  # the data files, beside the variants' folders
    data["sft"].update(
        data={
            "path": str(_write_jsonl(folder / "train.jsonl", train)),
            "eval_path": str(_write_jsonl(folder / "eval.jsonl", evals)),
            "max_seq_len": 96,
        },
        optim={"lr": 1e-2, "warmup_steps": 2},
        batch={"micro_batch_size": 4, "grad_accum_steps": 1},
        max_steps=STEPS,
        checkpoint_every=0,
    )
    # The variants compute the same result, so they share a fingerprint (the batch split is
    # not part of it): each gets a workspace of its own, with TINY's ingest (built once per
    # session) copied in.
    for name in VARIANTS:
        (folder / name).mkdir()
    recipes = {name: write_recipe(folder / name, data) for name in VARIANTS}
    for recipe in recipes.values():
        run_shared("ingest", recipe, shared_parents)
    dirs = {name: planned_dir("sft", recipes[name], *over) for name, over in VARIANTS.items()}
    assert len({d.name for d in dirs.values()}) == 1, "the batch split moved the fingerprint"
    assert len(set(dirs.values())) == len(dirs), "variants would share an output folder"
    return {"recipe": recipes["micro4"], "recipes": recipes, "dirs": dirs, "done": set()}


def _run(env: dict, name: str) -> Path:
    """Run one variant of the sft stage once per module; returns its output folder."""
    if name not in env["done"]:
        over = VARIANTS[name]
        recipe = env["recipes"][name]
        if name.startswith("ranks2"):
            proc = run_torchrun("sft", recipe, 2, *over)
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        else:
            run_inprocess("sft", recipe, *over)
        env["done"].add(name)
    return env["dirs"][name]


def _train(out: Path) -> list[dict]:
    rows = read_metrics(out / "metrics.jsonl", "train")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    return rows


def _targets_per_row(env: dict) -> tuple[list[dict], list[int]]:
    """The tokenized training rows as the stage builds them, and each row's target count."""
    recipe = load_recipe(env["recipe"])
    tok = load_tokenizer(planned_dir("ingest", env["recipe"]) / "tokenizer")
    data = prepare(recipe.sft.data, tok, SEED)
    assert len(data.train) == N_TRAIN  # nothing dropped: row indices are file lines
    return data.train, [sum(x != IGNORE for x in e["labels"][1:]) for e in data.train]


def test_data_gives_unequal_micro_batches(env) -> None:
    """The premise of the other tests: in every step, micro-batch 0 (= rank 0) holds several
    times the target tokens of micro-batch 1 (= rank 1)."""
    _, n = _targets_per_row(env)
    for step in range(STEPS):
        accum = step_indices(N_TRAIN, step, micro=2, accum=2, dp_size=1, rank=0, seed=SEED)
        ranks = [
            step_indices(N_TRAIN, step, micro=2, accum=1, dp_size=2, rank=r, seed=SEED)[0]
            for r in (0, 1)
        ]
        assert accum == ranks  # rank-major: micro-batch k of one rank = rank k's micro-batch
        long, short = (sum(n[i] for i in ix) for ix in accum)
        assert long > 5 * short, (step, long, short)


def test_accumulation_matches_one_big_micro_batch(env) -> None:
    """micro 2 x accum 2 == micro 4 x accum 1 on one rank: every step's loss and pre-clip
    gradient norm, the held-out losses and the final adapter weights."""
    a, b = _run(env, "micro4"), _run(env, "micro2_accum2")
    for x, y in zip(_train(a), _train(b), strict=True):
        assert y["loss"] == pytest.approx(x["loss"], abs=1e-5), x["step"]
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-5, abs=1e-7), x["step"]
        assert y["target_tokens"] == x["target_tokens"]
    ev_a, ev_b = (read_metrics(d / "metrics.jsonl", "eval") for d in (a, b))
    assert [r["step"] for r in ev_a] == [0, STEPS]
    for x, y in zip(ev_a, ev_b, strict=True):
        assert y["eval_loss"] == pytest.approx(x["eval_loss"], abs=1e-5)
    wa, wb = (load_file(str(d / "adapter" / "adapter_model.safetensors")) for d in (a, b))
    assert wa.keys() == wb.keys() and len(wa) > 0
    # Adam divides each update by sqrt(second moment), so an element whose gradient is near
    # rounding noise moves by an amount sensitive to last-bit differences of summation order
    # (seen: one element of 17k off by 1.5e-5 after 6 steps). Hence: all elements within 5e-5,
    # and the whole adapter within 1e-5 relative.
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=0, atol=5e-5, msg=k)
    diff = torch.cat([(wb[k] - wa[k]).flatten() for k in wa])
    norm = torch.cat([wa[k].flatten() for k in wa])
    assert float(diff.norm() / norm.norm()) < 1e-5
    # The adapter did train (B left zero), so equal weights are not trivially equal.
    assert max(float(v.abs().max()) for k, v in wa.items() if "lora_B" in k) > 1e-3


def test_two_ranks_match_one_rank(env) -> None:
    """2 ranks x micro 2 (rank 0 holds the long rows, rank 1 the short ones) == 1 rank x micro 4
    == 1 rank x micro 2 x accum 2, step by step, and FSDP2's gathered adapter is the one rank's.
    The SFT loop's one 2-rank run: every 2-rank SFT invariant is asserted on it."""
    one, accum = _train(_run(env, "micro4")), _train(_run(env, "micro2_accum2"))
    two = _train(_run(env, "ranks2_micro2"))
    for x, y, z in zip(one, accum, two, strict=True):
        assert z["loss"] == pytest.approx(x["loss"], abs=1e-5), x["step"]
        assert z["loss"] == pytest.approx(y["loss"], abs=1e-5), x["step"]
        assert z["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-5), x["step"]
        assert z["target_tokens"] == x["target_tokens"]
    start = read_metrics(env["dirs"]["ranks2_micro2"] / "metrics.jsonl", "start")[0]
    assert (start["world_size"], start["micro_batch_size"]) == (2, 2)
    w1, w2 = (
        load_file(str(env["dirs"][name] / "adapter" / "adapter_model.safetensors"))
        for name in ("micro4", "ranks2_micro2")
    )
    assert w1.keys() == w2.keys() and len(w1) > 0
    # Reduce-scatter sums in another order than one rank's backward: 1e-4 (as on 16 steps).
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], atol=1e-4, rtol=1e-3, msg=k)


def _row_nll(model: torch.nn.Module, example: dict) -> tuple[torch.Tensor, int]:
    """Summed NLL of one row's target tokens, the row alone (no padding), log-softmax by hand."""
    ids = torch.tensor([example["input_ids"]])
    labels = torch.tensor(example["labels"][1:])
    logits = model(input_ids=ids).logits[0, :-1].double()
    logp = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
    mask = labels != IGNORE
    return -logp[mask].gather(1, labels[mask].unsqueeze(1)).sum(), int(mask.sum())


def test_step_loss_is_token_mean_over_global_batch(env) -> None:
    """Step 1's reported loss = sum of NLL over every target token of the global batch / number
    of those tokens, from the base model (LoRA B = 0) on the rows step_indices picks for step 0;
    a per-micro-batch (= per-rank here) mean is far from it on this data."""
    train, n = _targets_per_row(env)
    ingest = planned_dir("ingest", env["recipe"])
    model, _ = load_base(ingest, json.loads((ingest / "manifest.json").read_text()))
    model.eval()
    (rows,) = step_indices(N_TRAIN, 0, micro=GLOBAL, accum=1, dp_size=1, rank=0, seed=SEED)
    with torch.no_grad():
        per_row = [_row_nll(model, train[i]) for i in rows]
    assert [c for _, c in per_row] == [n[i] for i in rows]
    total = sum(float(s) for s, _ in per_row)
    count = sum(c for _, c in per_row)
    token_mean = total / count
    micro_means = [
        sum(float(s) for s, _ in per_row[j : j + 2]) / sum(c for _, c in per_row[j : j + 2])
        for j in (0, 2)
    ]
    naive = sum(micro_means) / 2
    row_mean = sum(float(s) / c for s, c in per_row) / len(per_row)
    assert abs(naive - token_mean) > 0.1, (naive, token_mean)  # the test can tell them apart
    assert abs(row_mean - token_mean) > 0.1, (row_mean, token_mean)
    for name in VARIANTS:
        first = _train(_run(env, name))[0]
        assert first["target_tokens"] == count, name
        assert first["loss"] == pytest.approx(token_mean, abs=2e-5), (name, naive)
        assert math.isfinite(first["grad_norm"]) and first["grad_norm"] > 0


def test_step_gradient_is_token_mean_gradient(env) -> None:
    """Step 1's pre-clip gradient norm = the norm of the gradient of the global token-mean loss,
    recomputed by autograd row by row. The adapter after one step holds the initial LoRA A (its
    gradient is exactly zero while B = 0, and AdamW without weight decay leaves it alone); with B
    set back to zero that is the model of step 1. A per-micro-batch mean (the two micro-batches
    weighted equally whatever their token counts) gives a different norm on this data."""
    from peft import PeftModel

    over = (*VARIANTS["micro2_accum2"], "sft.max_steps=1")
    run_inprocess("sft", env["recipe"], *over)
    out = planned_dir("sft", env["recipe"], *over)
    (first,) = read_metrics(out / "metrics.jsonl", "train")
    train, _ = _targets_per_row(env)
    ingest = planned_dir("ingest", env["recipe"])
    base, _ = load_base(ingest, json.loads((ingest / "manifest.json").read_text()))
    model = PeftModel.from_pretrained(base, str(out / "adapter"), is_trainable=True)
    model.eval()  # no dropout (none configured), as the stage's training forward
    params = [p for n, p in model.named_parameters() if p.requires_grad]
    assert params and all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.zero_()
    (rows,) = step_indices(N_TRAIN, 0, micro=GLOBAL, accum=1, dp_size=1, rank=0, seed=SEED)
    per_row = [_row_nll(model, train[i]) for i in rows]
    count = sum(c for _, c in per_row)

    def grad_norm(loss: torch.Tensor) -> float:
        grads = torch.autograd.grad(loss, params, retain_graph=True)
        return float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads)))

    token_mean = sum(s for s, _ in per_row) / count
    halves = [per_row[:2], per_row[2:]]  # the two micro-batches of micro 2 (= the two ranks)
    naive = sum(sum(s for s, _ in h) / sum(c for _, c in h) for h in halves) / 2
    expected, naive_norm = grad_norm(token_mean), grad_norm(naive)
    assert abs(naive_norm - expected) > 0.05 * expected, (naive_norm, expected)
    assert first["grad_norm"] == pytest.approx(expected, rel=1e-4), naive_norm
    for name in VARIANTS:
        assert _train(_run(env, name))[0]["grad_norm"] == pytest.approx(expected, rel=1e-4), name
