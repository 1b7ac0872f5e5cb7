"""KTO: the loss and its KL reference point against hand-computed numbers, unpaired data
(labels, paired files expanded, bad rows named by file and line), and the stage end to end."""

from __future__ import annotations

import copy
import json
import logging
import math
from pathlib import Path

import pytest
import torch

from posttrain.data.loading import DataError
from posttrain.data.pref_prepare import prepare_unpaired
from posttrain.data.preference import (
    check_unpaired_row,
    encode_completions,
    encode_pair,
    quickstart_preference_rows,
    quickstart_unpaired_rows,
    read_unpaired_rows,
)
from posttrain.data.synthetic import pretrain_corpus
from posttrain.kinds.kto import KTOConfig, KTODataConfig
from posttrain.models.tiny import train_tokenizer
from posttrain.stages.kto import mismatched, pair_accuracy, partner_rows, warn_balance
from posttrain.train.preference_losses import (
    kto_kl_estimate,
    kto_loss,
    kto_summary,
    kto_weight_balance,
)


def sig(x: float) -> float:
    return 1 / (1 + math.exp(-x))


# --- loss -------------------------------------------------------------------------------------

POLICY = [-1.0, -2.0, -3.0, -1.5]
REF = [-2.0, -2.0, -2.0, -1.0]  # r = policy - ref = [1.0, 0.0, -1.0, -0.5]
GOOD = [True, True, False, False]


def test_kto_loss_matches_hand_arithmetic() -> None:
    beta, z0, lam_d, lam_u = 0.5, 0.2, 2.0, 0.5
    policy = torch.tensor(POLICY, requires_grad=True)
    losses, m = kto_loss(
        policy,
        torch.tensor(REF),
        torch.tensor(GOOD),
        torch.tensor(z0),
        beta=beta,
        desirable_weight=lam_d,
        undesirable_weight=lam_u,
    )
    # desirable:   2.0 * (1 - sigmoid(0.5 * (r - 0.2)))  r = 1.0 -> 0.4;  r = 0.0 -> -0.1
    # undesirable: 0.5 * (1 - sigmoid(0.5 * (0.2 - r)))  r = -1.0 -> 0.6; r = -0.5 -> 0.35
    want = [
        2.0 * (1 - 0.598687660),  # sigmoid(0.4)  = 0.598687660 -> 0.80262468
        2.0 * (1 - 0.475020813),  # sigmoid(-0.1) = 0.475020813 -> 1.04995837
        0.5 * (1 - 0.645656306),  # sigmoid(0.6)  = 0.645656306 -> 0.17717185
        0.5 * (1 - 0.586618554),  # sigmoid(0.35) = 0.586618554 -> 0.20669072
    ]
    assert losses.tolist() == pytest.approx(want, abs=1e-6)
    assert want[0] == pytest.approx(2.0 * (1 - sig(0.4)), abs=1e-8)  # the table above is right
    # rewards beta * r = [0.5, 0.0, -0.5, -0.25]: desirable sum 0.5, undesirable sum -0.75
    assert float(m["reward_desirable"]) == pytest.approx(0.5)
    assert float(m["reward_undesirable"]) == pytest.approx(-0.75)
    assert (float(m["n_desirable"]), float(m["n_undesirable"])) == (2.0, 2.0)
    s = kto_summary({k: float(v) for k, v in m.items()})
    # means 0.5 / 2 = 0.25 and -0.75 / 2 = -0.375; margin 0.625; z0 passes through
    assert (s["reward_desirable"], s["reward_undesirable"]) == pytest.approx((0.25, -0.375))
    assert s["margin"] == pytest.approx(0.625) and s["kl"] == pytest.approx(0.2)
    # d loss_0 / d pi_0 = -lambda_D * beta * s (1 - s), s = sigmoid(0.4):
    # -2.0 * 0.5 * 0.598687660 * 0.401312340 = -0.240260746; undesirable rows have +.
    losses.sum().backward()
    assert policy.grad[0].item() == pytest.approx(-0.240260746, abs=1e-6)
    assert policy.grad[2].item() == pytest.approx(0.5 * 0.5 * 0.645656306 * 0.354343694, abs=1e-6)


def test_kto_loss_at_the_reference_is_half_the_weight() -> None:
    # policy = reference and z0 = 0: every row is lambda * (1 - sigmoid(0)) = lambda / 2.
    x = torch.tensor([-3.0, -4.0])
    losses, _ = kto_loss(
        x,
        x.clone(),
        torch.tensor([True, False]),
        torch.tensor(0.0),
        beta=0.1,
        desirable_weight=1.0,
        undesirable_weight=3.0,
    )
    assert losses.tolist() == pytest.approx([0.5, 1.5])


def test_kto_loss_refuses_bad_hyperparameters() -> None:
    x, good, z = torch.zeros(1), torch.tensor([True]), torch.tensor(0.0)
    with pytest.raises(ValueError, match="beta"):
        kto_loss(x, x, good, z, beta=0.0)
    with pytest.raises(ValueError, match="weights"):
        kto_loss(x, x, good, z, beta=0.1, undesirable_weight=-1.0)


def test_kl_estimate_is_a_clamped_detached_mean_over_ranks() -> None:
    policy = torch.tensor([-3.0, -1.0, -2.0], requires_grad=True)
    ref = torch.tensor([-4.0, -1.5, -1.0])
    # pi - ref = [1.0, 0.5, -1.0]: mean 0.5 / 3
    z0 = kto_kl_estimate(policy, ref)
    assert z0.item() == pytest.approx(0.5 / 3) and not z0.requires_grad
    # Another rank holds one mismatched pair with pi - ref = 2.0: (0.5 + 2.0) / (3 + 1) = 0.625
    other = torch.tensor([2.0, 1.0])
    assert kto_kl_estimate(policy, ref, lambda t: t + other).item() == pytest.approx(0.625)
    # A negative estimate (pi - ref = [-1.0, -2.0]) clamps to 0.
    assert kto_kl_estimate(torch.tensor([-2.0, -3.0]), torch.tensor([-1.0, -1.0])).item() == 0.0


def test_weight_balance_and_its_warning(caplog) -> None:
    # 1.0 * 3 / (1.0 * 4) = 0.75 < 1;  1.0 * 4 / (1.0 * 3) = 1.333 is in range; no undesirable: None
    assert kto_weight_balance(3, 4, 1.0, 1.0) == pytest.approx(0.75)
    assert kto_weight_balance(3, 0, 1.0, 1.0) is None
    with caplog.at_level(logging.WARNING, logger="posttrain.kto"):
        warn_balance({"train_desirable": 4, "train_undesirable": 3}, 1.0, 1.0)
        assert not caplog.records
        warn_balance({"train_desirable": 3, "train_undesirable": 4}, 1.0, 1.0)
    (rec,) = caplog.records
    assert (
        "kto.desirable_weight" in rec.getMessage() and "kto.undesirable_weight" in rec.getMessage()
    )
    assert "0.750" in rec.getMessage()


def test_pair_accuracy_counts_ties_half() -> None:
    rows = [
        {"pair": "a", "desirable": True},
        {"pair": "a", "desirable": False},
        {"pair": "b", "desirable": False},
        {"pair": "b", "desirable": True},
        {"pair": "c", "desirable": True},
        {"pair": "c", "desirable": False},
        {"pair": None, "desirable": True},
    ]
    # a: 1.0 > 0.0 right; b: desirable 0.0 < undesirable 2.0 wrong; c: tie, half -> 1.5 / 3
    acc, n = pair_accuracy(rows, torch.tensor([1.0, 0.0, 2.0, 0.0, 0.3, 0.3, 9.0]))
    assert (acc, n) == (pytest.approx(0.5), 3)


def test_every_field_is_documented() -> None:
    for model in (KTOConfig, KTODataConfig):
        for name, f in model.model_fields.items():
            assert f.description, f"{model.__name__}.{name}"
    assert KTOConfig(data={"synthetic": {"n_examples": 10}}).beta == 0.1


# --- batches ----------------------------------------------------------------------------------


def test_partners_are_the_next_row_of_the_global_batch_whatever_the_split() -> None:
    one = partner_rows(50, 3, micro=8, accum=1, rank=0, world=1, seed=0)[0]
    from posttrain.data.batching import step_indices

    rows = step_indices(50, 3, micro=8, accum=1, dp_size=1, rank=0, seed=0)[0]
    assert one == rows[1:] + rows[:1]
    # Two ranks x two micro-batches of 2: stream positions (k * world + rank) * micro + j.
    split = {r: partner_rows(50, 3, micro=2, accum=2, rank=r, world=2, seed=0) for r in (0, 1)}
    assert split[0][0] + split[1][0] + split[0][1] + split[1][1] == one


def test_mismatched_splices_one_prompt_and_another_completion() -> None:
    a = {"ids": [1, 2, 3, 4], "labels": [-100, -100, 3, 4], "prompt_len": 2}
    b = {"ids": [5, 6, 7, 8, 9], "labels": [-100, -100, -100, 8, 9], "prompt_len": 3}
    assert mismatched(a, b, 10) == {"ids": [1, 2, 8, 9], "labels": [-100, -100, 8, 9]}
    assert mismatched(a, b, 3) == {"ids": [1, 2, 8], "labels": [-100, -100, 8]}


# --- data -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(pretrain_corpus(300, 0), 400)


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_unpaired_and_paired_rows_read_as_labelled_rows(tmp_path) -> None:
    path = _jsonl(
        tmp_path / "fb.jsonl",
        [
            {"prompt": "What is 2 + 2?", "completion": "4.", "label": True},
            {
                "prompt": [{"role": "user", "content": "Capital of France?"}],
                "completion": [{"role": "assistant", "content": "Berlin."}],
                "label": False,
            },
            {"prompt": "Hi", "chosen": "Hello!", "rejected": "Go away."},
            {
                "chosen": [
                    {"role": "user", "content": "Sort 3 1 2"},
                    {"role": "assistant", "content": "1 2 3"},
                ],
                "rejected": [
                    {"role": "user", "content": "Sort 3 1 2"},
                    {"role": "assistant", "content": "3 2 1"},
                ],
            },
        ],
    )
    located, dropped = read_unpaired_rows(path)
    assert dropped == {}
    rows = [r for _, rs in located for r in rs]
    assert [(r["completion"], r["desirable"]) for r in rows] == [
        ("4.", True),
        ("Berlin.", False),
        ("Hello!", True),
        ("Go away.", False),
        ("1 2 3", True),
        ("3 2 1", False),
    ]
    assert rows[0]["pair"] is None and rows[1]["prompt"][-1]["content"] == "Capital of France?"
    # The two rows of a pair share its location as pair id; the implicit prompt is the prefix.
    assert rows[2]["pair"] == rows[3]["pair"] == f"{path}:3"
    assert rows[4]["prompt"] == [{"role": "user", "content": "Sort 3 1 2"}]


@pytest.mark.parametrize(
    ("row", "match"),
    [
        ({"prompt": "Hi", "completion": "Hello"}, "missing 'label'"),
        ({"prompt": "Hi", "completion": "Hello", "label": "yes"}, "'label' must be true or false"),
        ({"prompt": "Hi", "completion": "Hello", "label": 1}, "'label' must be true or false"),
        ({"prompt": "Hi", "completion": "  ", "label": True}, "'completion' is empty"),
        ({"completion": "Hello", "label": True}, "missing 'prompt'"),
    ],
)
def test_a_bad_row_names_file_and_line(tmp_path, row: dict, match: str) -> None:
    good = {"prompt": "Hi", "completion": "Hello", "label": True}
    path = _jsonl(tmp_path / "fb.jsonl", [good, row])
    with pytest.raises(DataError, match=match) as exc:
        read_unpaired_rows(path)
    assert str(exc.value).startswith(f"{path}:2: ")
    located, dropped = read_unpaired_rows(path, on_invalid="skip")
    assert len(located) == 1 and sum(dropped.values()) == 1


def test_a_completion_encodes_like_the_same_pair_side(tok) -> None:
    pair = quickstart_preference_rows(3, 0)[0]
    rows = [r for rs in quickstart_unpaired_rows(3, 0) for r in rs]
    enc, stats = encode_completions(tok, rows, 64, 40)
    want = encode_pair(tok, pair, 64, 40)
    assert (enc[0]["ids"], enc[0]["labels"]) == (want["chosen_ids"], want["chosen_labels"])
    assert (enc[1]["ids"], enc[1]["labels"]) == (want["rejected_ids"], want["rejected_labels"])
    assert enc[0]["prompt_len"] == want["prompt_len"] and stats["rows"] == 6
    row = check_unpaired_row({"prompt": "x " * 200, "completion": "y", "label": True}, "f:1")
    with pytest.raises(DataError, match="f:1: .*no room"):
        encode_completions(tok, row, 40, 40, wheres=["f:1"])


def test_prepare_keeps_pairs_together_in_the_held_out_split(tok) -> None:
    cfg = KTODataConfig(
        synthetic={"n_examples": 40}, eval_fraction=0.25, max_seq_len=64, max_prompt_len=40
    )
    data = prepare_unpaired(cfg, tok, seed=0)
    assert len(data.train) == 60 and len(data.eval) == 20
    held = [r["pair"] for r in data.eval]
    assert all(held.count(p) == 2 for p in held)
    assert not set(held) & {r["pair"] for r in data.train}
    assert data.stats["train_desirable"] == data.stats["train_undesirable"] == 30


# --- the stage --------------------------------------------------------------------------------

KTO_SECTION = {
    "data": {
        "synthetic": {"n_examples": 200, "seed": 5},
        "eval_fraction": 0.2,
        "max_seq_len": 64,
        "max_prompt_len": 40,
    },
    "optim": {"lr": 1e-3},
    "batch": {"micro_batch_size": 4, "grad_accum_steps": 2},
    "max_steps": 60,
    "checkpoint_every": 0,
}


@pytest.mark.slow
def test_kto_stage_end_to_end(tmp_path, shared_parents) -> None:
    from posttrain.telemetry.records import read_metrics
    from tests.stage_helpers import TINY, run_inprocess, run_shared, write_recipe

    recipe_data = copy.deepcopy(TINY)
    recipe_data["kto"] = KTO_SECTION
    recipe = write_recipe(tmp_path, recipe_data)
    for stage in ("ingest", "sft"):  # TINY's, built once per session
        run_shared(stage, recipe, shared_parents)
    out = run_inprocess("kto", recipe)
    assert (out / "adapter" / "adapter_model.safetensors").exists()
    s = json.loads((out / "manifest.json").read_text())["summary"]
    train = read_metrics(out / "metrics.jsonl", "train")
    assert len(train) == 60
    assert {"loss", "kl", "reward_desirable", "reward_undesirable", "margin"} <= set(train[0])
    assert all(math.isfinite(r["loss"]) for r in train)
    # Step 0: policy = reference, so every reward is 0, z0 is 0, every row's loss is 1/2 and
    # each pair is a tie (counted half).
    first, final = s["eval_start"], s["eval_final"]
    assert first["pairs"] == final["pairs"] == 40
    assert first["loss"] == pytest.approx(0.5, abs=1e-6) and first["kl"] == 0.0
    assert first["pair_accuracy"] == 0.5 and first["margin"] == 0.0
    # Measured 0.65 (26 of 40 pairs right) at 1.5 epochs; a tiny base learns these slowly.
    assert final["pair_accuracy"] >= 0.6, final
    assert final["margin"] > 0 and final["loss"] < first["loss"]
    assert s["headline"]["eval_pair_accuracy"] == pytest.approx(final["pair_accuracy"], abs=1e-4)
    assert s["train_desirable"] == s["train_undesirable"] == 160
