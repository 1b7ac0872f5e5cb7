"""Padding-free batches: rows end to end in one [1, N] sequence give what padded rows give.

Real tiny models (Llama; Qwen2 with grouped-query attention and a sliding window; a sequence
classifier with a LoRA adapter), random weights, rows of different lengths. Per-row log-probs,
summed NLL, reward scores and LoRA gradients are compared with the padded batch to 1e-5, and a
row's results must not move when another row of the same flat batch changes."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from posttrain.data.batching import pack_examples, pad_batch, regroup_by_tokens
from posttrain.data.chat import IGNORE
from posttrain.data.segments import Segments, batch_rows, flat_batch
from posttrain.models.lora import apply_lora, prepare_for_training
from posttrain.models.reward import pair_batch, pair_scores
from posttrain.sections.shared import LoraConfig
from posttrain.train.forward_logps import forward_nll_sum, forward_sequence_logps

VOCAB = 97


def rows(lengths: list[int], seed: int = 0) -> list[dict[str, list[int]]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(3, VOCAB, (n,), generator=g).tolist()
        k = n // 3  # a prompt of n//3 tokens, then the labelled reply
        out.append({"input_ids": ids, "labels": [IGNORE] * k + ids[k:]})
    return out


def llama(**over) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=128,
    )
    return LlamaForCausalLM(LlamaConfig(**(cfg | over))).eval()


def qwen2_windowed() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention
        max_position_embeddings=128,
        use_sliding_window=True,
        sliding_window=8,  # shorter than the rows: the window matters
        max_window_layers=0,
    )
    return Qwen2ForCausalLM(cfg).eval()


def test_segments_by_hand() -> None:
    s = Segments.from_lengths([2, 3, 1])
    assert s.row_of.tolist() == [0, 0, 1, 1, 1, 2]
    assert s.pos_of.tolist() == [0, 1, 0, 1, 2, 0]
    assert s.gather.tolist() == [[0, 1, 0], [2, 3, 4], [5, 5, 5]]
    assert s.last_positions().tolist() == [1, 4, 5]
    # Shifted values (N-1 of them) are credited to the row of the token they score.
    assert s.row_sums(torch.tensor([[1.0, 10, 100, 1000, 10000]])).tolist() == [1, 1110, 10000]


def test_flat_batch_layout() -> None:
    b = flat_batch(rows([4, 3]))
    assert b["input_ids"].shape == (1, 7) and "attention_mask" not in b
    assert b["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2]]
    # Each row's first label is never a target: the previous row's last token would predict it.
    assert b["labels"][0, 4].item() == IGNORE
    assert b["segments"].tokens == 7 and batch_rows(b) == 2
    padded = pad_batch(rows([4, 3]), 0)
    assert int(padded["attention_mask"].sum()) == 7 and batch_rows(padded) == 2
    # Same targets either way.
    assert int((b["labels"][:, 1:] != IGNORE).sum()) == int(
        (padded["labels"][:, 1:] != IGNORE).sum()
    )


@pytest.mark.parametrize("chunk", [0, 16])
@pytest.mark.parametrize("make", [llama, qwen2_windowed], ids=["llama", "qwen2-gqa-window"])
def test_per_row_logps_and_nll_match_padded(make, chunk: int) -> None:
    model = make()
    data = rows([23, 7, 31, 12, 2])
    with torch.no_grad():
        lp_pad, n_pad = forward_sequence_logps(model, pad_batch(data, 0), chunk)
        lp_flat, n_flat = forward_sequence_logps(model, flat_batch(data), chunk)
        nll_pad, cnt_pad = forward_nll_sum(model, pad_batch(data, 0), chunk)
        nll_flat, cnt_flat = forward_nll_sum(model, flat_batch(data), chunk)
    assert n_flat.tolist() == n_pad.tolist()
    torch.testing.assert_close(lp_flat, lp_pad, atol=1e-5, rtol=1e-5)
    assert int(cnt_flat) == int(cnt_pad)
    torch.testing.assert_close(nll_flat, nll_pad, atol=1e-5, rtol=1e-5)


def test_no_row_sees_another() -> None:
    model = llama()
    data = rows([20, 20, 20])
    other = [dict(r) for r in data]
    other[0] = rows([35], seed=9)[0]  # a different first row, longer
    with torch.no_grad():
        a, _ = forward_sequence_logps(model, flat_batch(data), 0)
        b, _ = forward_sequence_logps(model, flat_batch(other), 0)
    torch.testing.assert_close(a[1:], b[1:], atol=1e-6, rtol=1e-6)
    assert not torch.allclose(a[0], b[0])


@pytest.mark.parametrize("checkpointing", [False, True])
def test_lora_gradients_match_padded(checkpointing: bool) -> None:
    data = rows([19, 5, 27, 11])
    grads = []
    for batch in (pad_batch(data, 0), flat_batch(data)):
        base = llama()
        prepare_for_training(base, checkpointing)
        model = apply_lora(base, LoraConfig(r=4, alpha=8))
        model.train()
        # B starts at zero (no gradient reaches A): move it off zero, the same way both times.
        torch.manual_seed(1)
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.data.normal_(0, 0.02)
        nll, count = forward_nll_sum(model, batch, 0)
        (nll / count).backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], atol=1e-5, rtol=1e-4, msg=n)


def test_reward_scores_match_padded() -> None:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=128,
        num_labels=1,
        pad_token_id=0,
    )
    model = apply_lora(LlamaForSequenceClassification(cfg), LoraConfig(r=4, alpha=8), "SEQ_CLS")
    model.eval()
    a, b = rows([9, 14, 21]), rows([17, 6, 12], seed=3)
    pairs = [
        {
            "chosen_ids": c["input_ids"],
            "chosen_labels": c["labels"],
            "rejected_ids": r["input_ids"],
            "rejected_labels": r["labels"],
        }
        for c, r in zip(a, b, strict=True)
    ]
    with torch.no_grad():
        c_pad, r_pad = pair_scores(model, pair_batch(pairs, 0))
        c_flat, r_flat = pair_scores(model, pair_batch(pairs, 0, padding_free=True))
    torch.testing.assert_close(c_flat, c_pad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(r_flat, r_pad, atol=1e-5, rtol=1e-5)


def test_packed_rows_no_longer_attend_across() -> None:
    """`packing` laid rows end to end in one row of max_seq_len without masking across them;
    through the padding-free path each packed piece is its own row again."""
    model = llama()
    data = rows([10, 12, 9, 14])
    packed = pack_examples(data, 48)
    assert len(packed) == 1  # all four in one packed row
    with torch.no_grad():
        nll_sep, n_sep = forward_nll_sum(model, pad_batch(data, 0), 0)
        nll_pack, n_pack = forward_nll_sum(model, flat_batch(packed), 0)
    assert int(n_pack) == int(n_sep) - 0  # the same targets (first labels were already ignored)
    torch.testing.assert_close(nll_pack, nll_sep, atol=1e-5, rtol=1e-5)


def test_regroup_by_tokens_by_hand() -> None:
    lengths = {0: 50, 1: 10, 2: 40, 3: 30, 4: 70, 5: 20}
    groups = regroup_by_tokens(list(lengths), lengths.__getitem__, 80)
    # Longest first, first fit: 70+10 | 50+30 | 40+20
    assert groups == [[4, 1], [0, 3], [2, 5]]
    # A row over the budget goes alone; every row is kept exactly once.
    assert regroup_by_tokens([0, 4], lengths.__getitem__, 60) == [[4], [0]]
    # Ranks must run as many forwards as the busiest: split the fullest group.
    # One group of all six (longest first), split largest first into three.
    assert regroup_by_tokens(list(lengths), lengths.__getitem__, 1000, at_least=3) == [
        [3, 5, 1],
        [4],
        [0, 2],
    ]
