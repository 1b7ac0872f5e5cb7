"""Data loading errors, chat formatting and masks, batch order, packing, the loss."""

import json
import math
from pathlib import Path

import pytest
import torch

from posttrain.data.batching import pack_examples, pad_batch, step_indices
from posttrain.data.chat import IGNORE, encode_chat, prompt_text
from posttrain.data.loading import DataError, load_sft_rows
from posttrain.data.synthetic import pretrain_corpus, quickstart_sft_rows
from posttrain.models.tiny import IM_END, train_tokenizer
from posttrain.train.losses import token_nll_sum


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(pretrain_corpus(300, 0), 400)


CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "2 + 3 = 5."},
    {"role": "user", "content": "And 1 + 1?"},
    {"role": "assistant", "content": "1 + 1 = 2."},
]


def test_mask_covers_exactly_the_assistant_turns(tok) -> None:
    enc = encode_chat(tok, CHAT, max_len=512)
    learned = [i for i, lab in zip(enc["input_ids"], enc["labels"], strict=True) if lab != IGNORE]
    text = tok.decode(learned)
    # Both answers, each with its end-of-turn token, and nothing from system or user turns.
    assert text == f"2 + 3 = 5.{IM_END}\n1 + 1 = 2.{IM_END}\n"
    assert all(lab in (IGNORE, i) for i, lab in zip(enc["input_ids"], enc["labels"], strict=True))


def test_no_double_bos_or_eos(tok) -> None:
    ids = encode_chat(tok, CHAT, max_len=512)["input_ids"]
    eos = tok.convert_tokens_to_ids(IM_END)
    assert ids.count(eos) == len(CHAT), "one end-of-turn per message, no duplicates"
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert ids[:2].count(ids[0]) == 1


def test_truncate_and_drop(tok) -> None:
    full = encode_chat(tok, CHAT, max_len=512)
    cut = encode_chat(tok, CHAT, max_len=len(full["input_ids"]) - 3)
    assert cut["input_ids"] == full["input_ids"][:-3]
    assert encode_chat(tok, CHAT, max_len=10, on_too_long="drop") is None
    assert encode_chat(tok, CHAT, max_len=5) is None, "no assistant token left: row unusable"


def test_prompt_text_ends_with_generation_prompt(tok) -> None:
    prompt, ref = prompt_text(tok, CHAT)
    assert prompt.endswith("<|im_start|>assistant\n") and ref == "1 + 1 = 2."


def _write(path: Path, lines: list[str | bytes]) -> Path:
    path.write_bytes(b"".join((x if isinstance(x, bytes) else x.encode()) + b"\n" for x in lines))
    return path


def test_bad_rows_name_file_and_line(tmp_path: Path) -> None:
    good = json.dumps({"prompt": "p", "completion": "c"})
    cases = {
        "invalid JSON": [good, "{not json"],
        "messages[0].role must be one of": [
            good,
            json.dumps({"messages": [{"role": "bot", "content": "x"}]}),
        ],
        "'completion' must be a string": [good, json.dumps({"prompt": "p", "completion": 3})],
        "no non-empty assistant message": [
            good,
            json.dumps({"messages": [{"role": "user", "content": "x"}]}),
        ],
        "expected one of 'messages'": [good, json.dumps({"text": "x"})],
        "row must be a JSON object": [good, "[1, 2]"],
        "not valid UTF-8": [good, b'{"prompt": "\xff\xfe"}'],
    }
    for i, (msg, lines) in enumerate(cases.items()):
        f = _write(tmp_path / f"d{i}.jsonl", lines)
        with pytest.raises(DataError) as exc:
            load_sft_rows(f)
        assert str(exc.value).startswith(f"{f}:2: ") and msg in str(exc.value), str(exc.value)


def test_empty_and_missing_files(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="no rows"):
        load_sft_rows(_write(tmp_path / "e.jsonl", [""]))
    with pytest.raises(DataError, match="nope.jsonl does not exist"):
        load_sft_rows(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match="unknown data format"):
        load_sft_rows(_write(tmp_path / "x.csv", ["a,b"]))


def test_formats_agree(tmp_path: Path) -> None:
    from datasets import Dataset

    rows = [{"prompt": f"q{i}", "completion": f"a{i}"} for i in range(5)]
    _write(tmp_path / "d.jsonl", [json.dumps(r) for r in rows])
    (tmp_path / "d.json").write_text(json.dumps(rows))
    Dataset.from_list(rows).to_parquet(str(tmp_path / "d.parquet"))
    Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    loaded = [load_sft_rows(tmp_path / n) for n in ("d.jsonl", "d.json", "d.parquet", "saved")]
    assert all(x == loaded[0] for x in loaded)
    assert loaded[0][1]["messages"] == [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"},
    ]


def test_synthetic_rows_are_deterministic_and_valid(tmp_path: Path) -> None:
    rows = quickstart_sft_rows(50, 7)
    assert rows == quickstart_sft_rows(50, 7) and rows != quickstart_sft_rows(50, 8)
    f = _write(tmp_path / "q.jsonl", [json.dumps(r) for r in rows])
    assert len(load_sft_rows(f)) == 50


def test_step_indices_split_ranks_like_one_big_batch() -> None:
    kw = dict(micro=2, seed=3)
    one = step_indices(10, 4, accum=2, dp_size=1, rank=0, **kw)
    # Two ranks at the same global batch see the same rows between them.
    two = [step_indices(10, 4, accum=1, dp_size=2, rank=r, **kw) for r in (0, 1)]
    assert sorted(sum(one, [])) == sorted(sum(two[0] + two[1], []))
    # Consecutive steps walk a permutation: one epoch covers every row once.
    epoch = sum(
        (
            sum(step_indices(8, s, accum=1, dp_size=2, rank=r, micro=2, seed=1), [])
            for s in range(2)
            for r in (0, 1)
        ),
        [],
    )
    assert sorted(epoch) == list(range(8))


def test_pad_and_pack() -> None:
    ex = [
        {"input_ids": [1, 2, 3], "labels": [IGNORE, 2, 3]},
        {"input_ids": [4, 5], "labels": [IGNORE, 5]},
    ]
    b = pad_batch(ex, pad_id=0)
    assert b["input_ids"].tolist() == [[1, 2, 3], [4, 5, 0]]
    assert b["labels"].tolist() == [[IGNORE, 2, 3], [IGNORE, 5, IGNORE]]
    assert b["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    packed = pack_examples(ex * 2, max_len=5)
    assert [p["input_ids"] for p in packed] == [[1, 2, 3, 4, 5], [1, 2, 3, 4, 5]]
    assert packed[0]["position_ids"] == [0, 1, 2, 0, 1]
    assert packed[0]["labels"] == [IGNORE, 2, 3, IGNORE, 5]


def test_token_nll_sum_by_hand() -> None:
    # Vocab 2, one sequence of 3 tokens; position 0 predicts label[1], position 1 predicts label[2].
    logits = torch.tensor([[[0.0, math.log(3)], [math.log(4), 0.0], [5.0, 5.0]]])
    labels = torch.tensor([[IGNORE, 1, 0]])
    nll, n = token_nll_sum(logits, labels)
    # p(1 | pos0) = 3/4, p(0 | pos1) = 4/5
    assert n.item() == 2
    assert nll.item() == pytest.approx(-math.log(3 / 4) - math.log(4 / 5), abs=1e-6)
    nll2, n2 = token_nll_sum(logits, torch.tensor([[IGNORE, IGNORE, 0]]))
    assert n2.item() == 1 and nll2.item() == pytest.approx(-math.log(4 / 5), abs=1e-6)
