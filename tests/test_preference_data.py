"""Preference rows: formats, validation errors with locations, skip counts, pair tokenization."""

import copy
import json
from pathlib import Path

import pytest
from tokenizers import processors

from posttrain.data.chat import IGNORE
from posttrain.data.loading import DataError
from posttrain.data.preference import (
    PreferenceDataError,
    check_preference_row,
    encode_pair,
    encode_pairs,
    quickstart_preference_rows,
    read_preference_rows,
)
from posttrain.data.synthetic import pretrain_corpus
from posttrain.models.chatml import CHATML_TEMPLATE
from posttrain.models.tiny import EOT, IM_END, IM_START, train_tokenizer


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(pretrain_corpus(300, 0), 400)


SYS = {"role": "system", "content": "Be brief."}
USER = {"role": "user", "content": "What is 2 + 3?"}
GOOD, BAD = "2 + 3 = 5.", "2 + 3 = 6."
NORMAL = {"prompt": [USER], "chosen": GOOD, "rejected": BAD}


def asst(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


def test_every_format_normalises_to_the_same_row() -> None:
    formats = [
        {"prompt": USER["content"], "chosen": GOOD, "rejected": BAD},  # (a)
        {"prompt": [USER], "chosen": [asst(GOOD)], "rejected": [asst(BAD)]},  # (b)
        {"prompt": [USER], "chosen": GOOD, "rejected": BAD},  # (b), string replies
        {"chosen": [USER, asst(GOOD)], "rejected": [USER, asst(BAD)]},  # (c)
        # Extra keys inside messages and the row are dropped.
        {"prompt": [USER | {"name": None}], "chosen": GOOD, "rejected": BAD, "score": 1},
    ]
    assert all(check_preference_row(r, "x") == NORMAL for r in formats)


def test_implicit_prompt_is_the_longest_common_prefix() -> None:
    turns = [SYS, USER, asst("5."), {"role": "user", "content": "Show it."}]
    row = {"chosen": [*turns, asst(GOOD)], "rejected": [*turns, asst(BAD)]}
    assert check_preference_row(row, "x") == {"prompt": turns, "chosen": GOOD, "rejected": BAD}
    # Conversational lists that repeat part of the prompt resolve the same way.
    row = {"prompt": [SYS], "chosen": [USER, asst(GOOD)], "rejected": [USER, asst(BAD)]}
    assert check_preference_row(row, "x") == {
        "prompt": [SYS, USER],
        "chosen": GOOD,
        "rejected": BAD,
    }


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


# problem in the error message -> (reason, bad row)
BAD_ROWS = {
    "row must be a JSON object": ("wrong_type", [1, 2]),
    "missing 'chosen'": ("missing_field", {"prompt": "p", "rejected": "r"}),
    "missing 'rejected'": ("missing_field", {"prompt": "p", "chosen": "c", "rejected": None}),
    "missing 'prompt'": ("missing_field", {"chosen": "c", "rejected": "r"}),
    "prompt[0].role must be one of": (
        "wrong_type",
        {"prompt": [{"role": "bot", "content": "p"}], "chosen": "c", "rejected": "r"},
    ),
    "chosen[0].content must be a string": (
        "wrong_type",
        {"prompt": "p", "chosen": [{"role": "assistant", "content": 3}], "rejected": "r"},
    ),
    "'prompt' must be a string or a list": (
        "wrong_type",
        {"prompt": 7, "chosen": "c", "rejected": "r"},
    ),
    "'chosen' must be a string or a list": (
        "wrong_type",
        {"prompt": "p", "chosen": 1, "rejected": "r"},
    ),
    "'prompt' must be a non-empty list": (
        "wrong_type",
        {"prompt": [], "chosen": "c", "rejected": "r"},
    ),
    "'rejected' is empty": ("empty_response", {"prompt": "p", "chosen": "c", "rejected": "  "}),
    "identical": ("identical", {"prompt": "p", "chosen": "same", "rejected": "same"}),
    "no non-empty user turn": (
        "no_user_turn",
        {"prompt": [{"role": "system", "content": "s"}], "chosen": "c", "rejected": "r"},
    ),
    "must end with a user turn": (
        "prompt_end_not_user",
        {"prompt": [USER, asst("hm")], "chosen": "c", "rejected": "r"},
    ),
    "differ only in one final assistant reply": (
        "not_final_reply",
        {"chosen": [USER, asst("a"), USER, asst("b")], "rejected": [USER, asst("c")]},
    ),
}


def test_every_validation_error_names_file_line_and_reason(tmp_path: Path) -> None:
    good = json.dumps(NORMAL)
    for i, (problem, (reason, row)) in enumerate(BAD_ROWS.items()):
        f = _write(tmp_path / f"d{i}.jsonl", [good, json.dumps(row)])
        with pytest.raises(PreferenceDataError) as exc:
            read_preference_rows(f, on_invalid="error")
        msg = str(exc.value)
        assert msg.startswith(f"{f}:2: ") and problem in msg, msg
        assert exc.value.reason == reason and isinstance(exc.value, DataError)


def test_skip_mode_drops_and_counts_by_reason(tmp_path: Path) -> None:
    empty = {"prompt": "p", "chosen": "", "rejected": "r"}
    same = {"prompt": "p", "chosen": "x", "rejected": "x"}
    f = _write(tmp_path / "d.jsonl", [json.dumps(r) for r in (NORMAL, empty, same, empty, NORMAL)])
    located, dropped = read_preference_rows(f, on_invalid="skip")
    assert [row for _, row in located] == [NORMAL, NORMAL]
    assert dropped == {"empty_response": 2, "identical": 1}
    assert [w for w, _ in located] == [f"{f}:1", f"{f}:5"]
    with pytest.raises(DataError, match="no valid preference row"):
        read_preference_rows(_write(tmp_path / "bad.jsonl", [json.dumps(same)]), on_invalid="skip")
    with pytest.raises(ValueError, match="on_invalid"):
        read_preference_rows(f, on_invalid="ignore")  # type: ignore[arg-type]


def test_file_formats_agree(tmp_path: Path) -> None:
    from datasets import Dataset

    raw = [
        {"prompt": [USER], "chosen": [asst(f"{i}")], "rejected": [asst(f"-{i}")]} for i in range(4)
    ]
    _write(tmp_path / "d.jsonl", [json.dumps(r) for r in raw])
    (tmp_path / "d.json").write_text(json.dumps(raw))
    Dataset.from_list(raw).to_parquet(str(tmp_path / "d.parquet"))
    Dataset.from_list(raw).save_to_disk(str(tmp_path / "saved"))
    # Each format names its rows its own way; the rows themselves agree.
    loaded = [
        ([row for _, row in located], dropped)
        for located, dropped in (
            read_preference_rows(tmp_path / n) for n in ("d.jsonl", "d.json", "d.parquet", "saved")
        )
    ]
    assert all(x == loaded[0] for x in loaded)
    assert loaded[0][0][3] == {"prompt": [USER], "chosen": "3", "rejected": "-3"}
    # Saved datasets name rows by index.
    bad = Dataset.from_list([{"prompt": "p", "chosen": "c", "rejected": "c"}])
    bad.save_to_disk(str(tmp_path / "bad"))
    with pytest.raises(DataError, match=f"^{tmp_path / 'bad'} row 0: .*identical"):
        read_preference_rows(tmp_path / "bad")


def _learned(tok, ids: list[int], labels: list[int]) -> str:
    assert all(lab in (IGNORE, i) for i, lab in zip(ids, labels, strict=True))
    return tok.decode([i for i, lab in zip(ids, labels, strict=True) if lab != IGNORE])


def test_encode_pair_masks_exactly_the_final_reply(tok) -> None:
    prompt = [SYS, USER, asst("5."), {"role": "user", "content": "Again?"}]
    enc = encode_pair(tok, {"prompt": prompt, "chosen": GOOD, "rejected": BAD}, 512, 256)
    n = enc["prompt_len"]
    for key, reply in (("chosen", GOOD), ("rejected", BAD)):
        ids, labels = enc[f"{key}_ids"], enc[f"{key}_labels"]
        # The reply plus its end-of-turn token; not the earlier assistant turn "5.".
        assert _learned(tok, ids, labels) == f"{reply}{IM_END}\n"
        assert labels[:n] == [IGNORE] * n and labels[n] != IGNORE
        full = tok.apply_chat_template([*prompt, asst(reply)], tokenize=False)
        assert tok.decode(ids) == full
    assert enc["chosen_ids"][:n] == enc["rejected_ids"][:n]
    assert tok.decode(enc["chosen_ids"][:n]).endswith(f"{IM_START}assistant\n")


def test_prompt_is_left_truncated_and_response_cut_to_max_len(tok) -> None:
    row = {"prompt": [SYS, USER], "chosen": GOOD, "rejected": "No idea, sorry, but maybe 6?"}
    full = encode_pair(tok, row, 512, 512)
    cut = encode_pair(tok, row, 512, 5)
    # The prompt keeps its LAST 5 tokens (the generation prompt end), responses unchanged.
    assert cut["prompt_len"] == 5
    assert cut["chosen_ids"] == full["chosen_ids"][full["prompt_len"] - 5 :]
    short = encode_pair(tok, row, 9, 5)
    assert len(short["chosen_ids"]) <= 9 and len(short["rejected_ids"]) == 9
    assert short["rejected_ids"] == cut["rejected_ids"][:9]
    rows = [row, row]
    _, stats = encode_pairs(tok, rows, 9, 5)
    assert stats == {"pairs": 2, "no_room": 0, "prompt_truncated": 2, "response_truncated": 2}


def test_no_room_drops_or_names_the_row(tok) -> None:
    row = {"prompt": [USER], "chosen": GOOD, "rejected": BAD}
    assert encode_pair(tok, row, max_len=8, max_prompt_len=8) is None
    assert encode_pair(tok, row, max_len=9, max_prompt_len=8) is not None  # one response token
    out, stats = encode_pairs(tok, [row, row], 8, 8, on_invalid="skip")
    assert out == [] and stats["no_room"] == 2
    with pytest.raises(PreferenceDataError, match=r"^data\.jsonl:7: .*no room") as exc:
        encode_pairs(tok, [row], 8, 8, on_invalid="error", wheres=["data.jsonl:7"])
    assert exc.value.reason == "no_room"


def test_no_room_error_names_the_file_row(tok, tmp_path: Path) -> None:
    f = _write(tmp_path / "d.jsonl", [json.dumps(NORMAL)] * 2)
    located, _ = read_preference_rows(f)
    with pytest.raises(PreferenceDataError, match=f"^{f}:1: "):
        encode_pairs(tok, [r for _, r in located], 8, 8, wheres=[w for w, _ in located])


@pytest.fixture(scope="module")
def bos_tok(tok):
    """A tokenizer that adds BOS and EOS when asked to (add_special_tokens=True), with a template
    that writes the BOS itself, as Llama-style templates do."""
    t = copy.deepcopy(tok)
    t.bos_token = EOT
    specials = [(x, t.convert_tokens_to_ids(x)) for x in (EOT, IM_END)]
    t.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{EOT} $A {IM_END}", special_tokens=specials
    )
    t.chat_template = "{{ bos_token }}" + CHATML_TEMPLATE
    return t


def test_no_double_bos_and_no_duplicated_eos(bos_tok) -> None:
    bos, eos = bos_tok.bos_token_id, bos_tok.convert_tokens_to_ids(IM_END)
    text = bos_tok.apply_chat_template([USER, asst(GOOD)], tokenize=False)
    # The trap: the default add_special_tokens=True doubles the template's BOS and adds an EOS.
    naive = bos_tok(text)["input_ids"]
    assert naive[:2] == [bos, bos] and naive.count(eos) == 3
    enc = encode_pair(bos_tok, {"prompt": [SYS, USER], "chosen": GOOD, "rejected": BAD}, 512, 256)
    for key in ("chosen", "rejected"):
        ids, labels = enc[f"{key}_ids"], enc[f"{key}_labels"]
        assert ids[0] == bos and ids.count(bos) == 1, "exactly one BOS, at position 0"
        assert ids.count(eos) == 3, "one end-of-turn per message (system, user, reply)"
        response = [i for i, lab in zip(ids, labels, strict=True) if lab != IGNORE]
        assert response.count(eos) == 1 and bos_tok.decode(response[-2:]) == f"{IM_END}\n"


def test_prompt_truncation_keeps_the_bos(bos_tok) -> None:
    row = {"prompt": [SYS, USER], "chosen": GOOD, "rejected": BAD}
    full, cut = encode_pair(bos_tok, row, 512, 512), encode_pair(bos_tok, row, 512, 6)
    assert cut["prompt_len"] == 6
    assert (
        cut["chosen_ids"] == [bos_tok.bos_token_id] + full["chosen_ids"][full["prompt_len"] - 5 :]
    )


def test_quickstart_rows_are_valid_and_deterministic(tok, tmp_path: Path) -> None:
    rows = quickstart_preference_rows(30, 3)
    assert rows == quickstart_preference_rows(30, 3) and rows != quickstart_preference_rows(30, 4)
    assert sum(r["prompt"][0]["role"] == "system" for r in rows) == 10
    f = _write(tmp_path / "q.jsonl", [json.dumps(r) for r in rows])
    located, dropped = read_preference_rows(f)
    assert [row for _, row in located] == rows and dropped == {}
    enc, stats = encode_pairs(tok, rows, 128, 96)
    assert len(enc) == 30 and stats["no_room"] == 0
