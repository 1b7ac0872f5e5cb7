"""`posttrain validate --full` and `plan --full` (issue 41, point 3): every row of every data
file read with the stage's reader, every bad row named by file and line, each stage's rows
tokenized as the stage will tokenize them, and the check's speed. Real recipe files, data files
and a tiny real tokenizer in tmp_path; the texts a user sees."""

from __future__ import annotations

import io
import json
import re
import shutil
import textwrap
from pathlib import Path
from typing import Any

import pytest

from flows.cli import cmd_plan, cmd_validate, main
from posttrain.config.loader import load_recipe
from posttrain.plan.planner import plan
from posttrain.store.artifacts import write_manifest

FIX = (
    "  fix:  correct the rows and fields named above (or create the files they name), then "
    "`posttrain validate --full` again; nothing ran"
)
SPEED = re.compile(
    r"full check: ([\d,]+) rows read and checked in \d+\.\d\d s \(\d+\.\d s per 100k rows\)"
    r"(; ([\d,]+) rows tokenized in \d+\.\d\d s \(\d+\.\d s per 100k rows\))?"
)


def chat(user: str, reply: str) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
    }


ROW = chat("hi", "hello")


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny byte-level BPE tokenizer (ChatML template), saved once per module."""
    from posttrain.data.synthetic import pretrain_corpus
    from posttrain.models.tiny import train_tokenizer

    folder = tmp_path_factory.mktemp("full") / "tokenizer"
    train_tokenizer(pretrain_corpus(100, seed=0), 300).save_pretrained(str(folder))
    return folder


@pytest.fixture()
def base(tmp_path: Path, tokenizer_files: Path) -> Path:
    """A local base folder beside the recipe (where a recipe may read): the tokenizer and a
    config.json, no weights (validate loads none)."""
    folder = tmp_path / "base"
    shutil.copytree(tokenizer_files, folder)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return folder


def _recipe(tmp_path: Path, body: str, ingest: str = "{source: from_config}") -> Path:
    path = tmp_path / "r.yaml"
    head = f"run: {{name: full, workspace: {tmp_path}/ws}}\n"
    head += f"infra: {{device: cpu, precision: fp32}}\ningest: {ingest}\n"
    path.write_text(head + textwrap.dedent(body).format(d=tmp_path))
    return path


def _jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _validate(path: Path, full: bool = True) -> tuple[int, list[str]]:
    out, err = io.StringIO(), io.StringIO()
    code = cmd_validate(str(path), [], out, err, full=full)
    assert err.getvalue() == "", err.getvalue()
    return code, out.getvalue().splitlines()


def test_a_bad_row_at_line_200_is_missed_by_default_and_named_by_full(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows: list[Any] = [ROW] * 300
    rows[199] = '{"messages": [}'
    data = _jsonl(tmp_path / "chat.jsonl", rows)
    path = _recipe(tmp_path, "sft:\n  data: {{path: {d}/chat.jsonl}}\n")
    code, lines = _validate(path, full=False)
    assert code == 0, lines
    shape = f"sft.data.path: {data}: messages (role/content)"
    assert f"{shape}, first 5 rows read (--full reads all): 5 ok" in lines

    assert main(["validate", "--full", str(path)]) == 2  # the flag, through the parser
    out, err = capsys.readouterr()
    assert err == "" and "Traceback" not in out
    assert out.splitlines()[:3] == [
        f"posttrain: recipe {path} refused: 1 problem (nothing ran)",
        f"  sft.data.path: {data}:200: invalid JSON: Expecting value (column 15)",
        FIX,
    ]
    assert f"{shape}, all 300 rows read: 299 ok, 1 bad" in out.splitlines()


def test_bad_rows_are_listed_ten_per_file_then_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Line 2 is over the line limit: it is measured, named, and the lines after it still read.
    monkeypatch.setenv("POSTTRAIN_MAX_LINE_BYTES", "200")
    rows: list[Any] = [ROW, chat("x" * 300, "y"), *[{"text": f"row {i}"} for i in range(12)], ROW]
    data = _jsonl(tmp_path / "chat.jsonl", rows)
    code, lines = _validate(_recipe(tmp_path, "sft:\n  data: {{path: {d}/chat.jsonl}}\n"))
    assert code == 2
    assert lines[0] == f"posttrain: recipe {tmp_path}/r.yaml refused: 11 problems (nothing ran)"
    assert lines[1].startswith(f"  sft.data.path: {data}:2: line of 3")
    assert "over the 200-byte limit" in lines[1]
    wrong = "expected one of 'messages'; ShareGPT 'conversations'; Alpaca"
    assert lines[2].startswith(f"  sft.data.path: {data}:3: {wrong}")
    assert lines[10].startswith(f"  sft.data.path: {data}:11: {wrong}")
    assert lines[11] == f"  sft.data.path: {data}: 3 more bad rows not listed (13 in all)"
    assert lines[12] == FIX
    shapes = "unrecognised (keys text) (12 rows) | messages (role/content) (2 rows)"
    assert f"sft.data.path: {data}: {shapes}, all 15 rows read: 2 ok, 13 bad" in lines


def _tokens(tok: Any, messages: list[dict[str, str]], prompt: bool = False) -> int:
    """Token count of a conversation as the template writes it (a prompt: with the assistant
    header), straight from the tokenizer: what the report's figures must agree with."""
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
    return len(tok(text, add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize("on_too_long", ["truncate", "drop"])
def test_rows_over_max_seq_len_are_counted_with_their_lengths(
    tmp_path: Path, base: Path, on_too_long: str
) -> None:
    from posttrain.models.loading import load_tokenizer

    # 10 short rows, 6 with a long answer (a short prompt: truncate keeps them, cut), 4 with a
    # long question (no answer token fits: dropped either way).
    short, long_answer, long_question = ROW, chat("hi", "sum " * 60), chat("add " * 80, "ok")
    _jsonl(tmp_path / "chat.jsonl", [short] * 10 + [long_answer] * 6 + [long_question] * 4)
    data = f"path: {{d}}/chat.jsonl, max_seq_len: 64, on_too_long: {on_too_long}"
    body = f"sft:\n  data: {{{{{data}, eval_fraction: 0}}}}\n"
    code, lines = _validate(_recipe(tmp_path, body, f"{{source: path, path: {base}}}"))
    assert code == 0, lines

    tok = load_tokenizer(base)
    s, a, q = (_tokens(tok, r["messages"]) for r in (short, long_answer, long_question))
    assert s < 64 < a < q
    prompt = _tokens(tok, long_question["messages"][:1], prompt=True)
    if on_too_long == "truncate":
        fate, need = "4 dropped (4 too long to keep), 6 truncated to 64 tokens", prompt + 1
    else:
        fate, need = "10 dropped (10 too long to keep), 0 truncated to 64 tokens", q
    tokenizer = f"tokenizer for the stages on base ingest: {base} (the base folder's, as ingest "
    assert tokenizer + "saves it)" in lines
    assert lines[-3:-1] == [
        f"sft train: 20 rows: {fate}; tokens p50 {s}, p95 {q}, max {q} (max_seq_len 64, "
        f"on_too_long: {on_too_long}); their longest prompt before the first assistant token "
        f"is {prompt} tokens; max_seq_len {need} would keep 90% of them, {need} all",
        "sft eval: no rows",
    ]
    speed = SPEED.fullmatch(lines[-1])
    assert speed and speed.group(1) == speed.group(3) == "20", lines[-1]


def test_no_row_that_fits_is_refused_as_the_stage_refuses_it(tmp_path: Path, base: Path) -> None:
    _jsonl(tmp_path / "chat.jsonl", [chat("add " * 60, "ok")] * 3)
    body = "sft:\n  data: {{path: {d}/chat.jsonl, max_seq_len: 16, eval_fraction: 0}}\n"
    code, lines = _validate(_recipe(tmp_path, body, f"{{source: path, path: {base}}}"))
    assert code == 2
    assert lines[1].startswith(
        "  sft.data: none of the 3 training rows fits sft.data.max_seq_len 16 (on_too_long: "
        "truncate): their longest prompt before the first assistant token is "
    )
    assert lines[2] == FIX


DPO = """
    sft:
      data: {{synthetic: {{n_examples: 20}}}}
    dpo:
      data:
        path: {d}/pairs.jsonl
        on_invalid: skip
        eval_fraction: 0
        max_seq_len: 48
        max_prompt_len: 24
"""


def test_preference_rows_cut_and_skipped(tmp_path: Path, base: Path) -> None:
    pair = {"prompt": "hi", "chosen": "yes", "rejected": "no"}
    long_prompt = {**pair, "prompt": "add " * 40}
    rows = [pair] * 6 + [long_prompt] * 4 + [{**pair, "rejected": "yes"}]  # the last: identical
    data = _jsonl(tmp_path / "pairs.jsonl", rows)
    code, lines = _validate(_recipe(tmp_path, DPO, f"{{source: path, path: {base}}}"))
    assert code == 0, lines
    read = "all 11 rows read: 10 ok, 1 would be skipped ({'identical': 1})"
    assert f"dpo.data.path: {data}: prompt/chosen/rejected (text), {read}" in lines
    dpo = next(x for x in lines if x.startswith("dpo train: "))
    assert dpo.startswith(
        "dpo train: 10 pairs: 0 no room, 4 prompts cut to their last 24 tokens, 0 responses cut "
        "to fit 48; prompt tokens p50 "
    )
    assert "(max_prompt_len 24), prompt + longer response p50 " in dpo
    assert dpo.endswith("(max_seq_len 48)")
    # Generated rows are generated and split as the stage does it.
    assert "sft.data: synthetic (task quickstart, 20 rows, generated)" in lines
    assert any(x.startswith("sft train: 19 rows: ") for x in lines), lines
    assert any(x.startswith("sft eval: 1 row: none dropped") for x in lines), lines


def test_a_built_base_tokenizes_with_its_ingest_artifact_once_it_exists(
    tmp_path: Path, tokenizer_files: Path
) -> None:
    _jsonl(tmp_path / "chat.jsonl", [ROW] * 10)
    path = _recipe(tmp_path, "sft:\n  data: {{path: {d}/chat.jsonl}}\n")
    code, lines = _validate(path)
    assert code == 0, lines
    assert (
        "tokenizer for the stages on base ingest: trained at ingest (from_config), so rows cannot "
        "be tokenized before ingest has run; run the recipe `--until ingest` once, then --full "
        "again"
    ) in lines
    assert not any(x.startswith("sft train:") for x in lines)
    speed = SPEED.fullmatch(lines[-1])
    assert speed and speed.group(2) is None, lines[-1]

    ingest = plan(load_recipe(path)).stages[0]  # a finished ingest: its saved tokenizer
    shutil.copytree(tokenizer_files, ingest.out_dir / "tokenizer")
    write_manifest(
        ingest.out_dir,
        stage="ingest",
        fp=ingest.fingerprint,
        parents=[],
        section={},
        seed=0,
        summary={},
    )
    code, lines = _validate(path)
    assert (code, lines[0]) == (0, "recipe ok: 4 stages, 3 to run")
    assert (
        f"tokenizer for the stages on base ingest: {ingest.out_dir}/tokenizer (its ingest "
        "artifact's, as the stages load it)"
    ) in lines
    sft = next(x for x in lines if x.startswith("sft train: "))
    assert sft.startswith("sft train: 9 rows: none dropped, 0 truncated to 256 tokens; tokens p50 ")


def test_plan_full_prints_the_same_report(tmp_path: Path, base: Path) -> None:
    _jsonl(tmp_path / "chat.jsonl", [ROW] * 30 + [chat("hi", "sum " * 90)] * 3)
    body = "sft:\n  data: {{path: {d}/chat.jsonl, max_seq_len: 64, eval_fraction: 0}}\n"
    path = _recipe(tmp_path, body, f"{{source: path, path: {base}}}")
    code, report = _validate(path)
    assert code == 0, report
    out, err = io.StringIO(), io.StringIO()
    assert cmd_plan(str(path), [], out, err, full=True) == 0 and err.getvalue() == ""
    lines = out.getvalue().splitlines()
    # The same lines, the speed figures aside, then plan's own table.
    assert lines[: len(report) - 1] == report[:-1]
    assert SPEED.fullmatch(lines[len(report) - 1]) and lines[len(report)] == ""
    assert any(x.startswith("sft train: 33 rows: none dropped, 3 truncated to 64") for x in lines)


def test_a_cached_hub_dataset_is_read_to_its_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.hub_cache import add_snapshot, commit_sha
    from tests.test_hub import parquet

    cache = tmp_path / "hf-cache"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets-cache"))
    rows = [{"prompt": "p", "completion": "c"}] * 8 + [{"prompt": "p", "completion": " "}]
    files = {"data/train-00000-of-00001.parquet": parquet(rows)}
    add_snapshot(cache, "org/sft", files, commit_sha("sft"), repo_type="dataset")
    code, lines = _validate(_recipe(tmp_path, "sft:\n  data: {{path: org/sft}}\n"))
    assert code == 2
    empty = "'completion' is empty, nothing to learn from"
    assert lines[1] == f"  sft.data.path: org/sft[train] row 8: {empty}"
    assert "sft.data.path: org/sft: prompt/completion, all 9 rows read: 8 ok, 1 bad" in lines
