"""Chat templates of every family's shape: the strategy each gets, the exact SFT mask, one BOS,
prompts that match the mask, preference pairs, reasoning, system-role refusal, and ingest's
self-check (strategy recorded, template files, vocabulary size, split markers)."""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path

import pytest
from transformers import LlamaConfig

from posttrain.data.chat import (
    IGNORE,
    TemplateError,
    assistant_char_spans,
    encode_chat,
    prompt_text,
    read_template,
    template_info,
    template_markers,
)
from posttrain.data.loading import DataError, check_sft_row
from posttrain.data.preference import encode_pair
from posttrain.data.sft_data import prepare
from posttrain.kinds.ingest import IngestConfig
from posttrain.sections.shared import DataConfig
from posttrain.stages.ingest import IngestError, check_vocab, install_template
from tests.chat_template_fixtures import (
    CHAT,
    DS_EOS,
    FIXTURES,
    NO_SYSTEM,
    UNSERVABLE,
    Fixture,
    base_tokenizer,
    chat_for,
    fixture_tokenizer,
)

BY_NAME = {f.name: f for f in FIXTURES}
SHARED_TEMPLATES = Path(__file__).resolve().parents[2] / "shared" / "templates"


def _learned(tok, enc: dict) -> str:
    ids, labels = enc["input_ids"], enc["labels"]
    assert all(lab in (IGNORE, i) for i, lab in zip(ids, labels, strict=True))
    return tok.decode([i for i, lab in zip(ids, labels, strict=True) if lab != IGNORE])


@pytest.mark.parametrize("f", FIXTURES, ids=lambda f: f.name)
def test_strategy_and_exact_mask(f: Fixture) -> None:
    tok = fixture_tokenizer(f)
    info = template_info(tok)
    assert (info.strategy, info.system_role) == (f.strategy, f.system_role)
    enc = encode_chat(tok, chat_for(f), max_len=4096)
    # Each answer plus its end-of-turn text, nothing of the system/user turns or headers.
    assert _learned(tok, enc) == f.masked
    if f.bos:
        assert (
            enc["input_ids"].count(tok.bos_token_id) == 1
            and enc["input_ids"][0] == tok.bos_token_id
        )


def test_bos_once_when_the_tokenizer_would_add_one() -> None:
    """A tokenizer that adds BOS itself (add_special_tokens=True) must not double the
    template's BOS: encode_chat tokenizes without special tokens."""
    from tokenizers import processors

    f = BY_NAME["bos_in_template"]
    tok = fixture_tokenizer(f)
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{f.bos} $A", special_tokens=[(f.bos, tok.bos_token_id)]
    )
    text = tok.apply_chat_template(CHAT, tokenize=False)
    assert tok(text)["input_ids"][:2] == [tok.bos_token_id] * 2, "the trap this guards against"
    ids = encode_chat(tok, CHAT, max_len=4096)["input_ids"]
    assert ids.count(tok.bos_token_id) == 1


@pytest.mark.parametrize("f", FIXTURES, ids=lambda f: f.name)
def test_generation_prompt_ends_where_the_mask_starts(f: Fixture) -> None:
    """prompt_text (generation, eval and RL prompts) is the text before the last reply's span,
    except where the template itself makes them differ: DeepSeek's `<think>\\n` tail, and
    Mistral's system message, which the full render drops (it ends with a reply)."""
    tok = fixture_tokenizer(f)
    msgs = CHAT[1:] if f.name == "system_last_user" else chat_for(f)
    text, spans = assistant_char_spans(tok, msgs)
    prompt, reference = prompt_text(tok, msgs)
    start = spans[-1][0]
    tail = "<think>\n" if f.name == "think_prompt" else ""
    assert prompt == text[:start] + tail
    assert reference in text[start:]


def test_mistral_like_moves_the_system_message() -> None:
    tok = fixture_tokenizer(BY_NAME["system_last_user"])
    prompt, _ = prompt_text(tok, CHAT)
    assert prompt.endswith("[INST] Be brief.\n\nAnd 1 + 1?[/INST]")
    text, _ = assistant_char_spans(tok, CHAT)
    assert "Be brief." not in text


@pytest.mark.parametrize("f", FIXTURES, ids=lambda f: f.name)
def test_preference_pair_shares_the_prompt_and_masks_the_reply(f: Fixture) -> None:
    tok = fixture_tokenizer(f)
    eot = template_info(tok).end_of_turn
    lead = {"system_last_user": " ", "think_last": "<think>\n\n</think>\n\n"}.get(f.name, "")
    prompt = [{"role": "user", "content": "Is 2 + 3 = 5?"}]
    enc = encode_pair(tok, {"prompt": prompt, "chosen": "Yes.", "rejected": "No way."}, 512, 256)
    n = enc["prompt_len"]
    assert enc["chosen_ids"][:n] == enc["rejected_ids"][:n]
    for key, reply in (("chosen", "Yes."), ("rejected", "No way.")):
        ids, labels = enc[f"{key}_ids"], enc[f"{key}_labels"]
        assert labels[:n] == [IGNORE] * n
        assert _learned(tok, {"input_ids": ids, "labels": labels}) == lead + reply + eot


def test_deepseek_like_pair_prompt_is_what_the_template_renders() -> None:
    """The reply follows `<｜Assistant｜>` in the render (no `<think>\\n`), and reasoning before
    `</think>` is stripped from the reply, as the template does."""
    tok = fixture_tokenizer(BY_NAME["think_prompt"])
    prompt = [{"role": "user", "content": "2 + 3?"}]
    row = {"prompt": prompt, "chosen": "<think>\nadd\n</think>\n\nFive.", "rejected": "Six."}
    enc = encode_pair(tok, row, 512, 256)
    n = enc["prompt_len"]
    assert tok.decode(enc["chosen_ids"][:n]).endswith("<｜User｜>2 + 3?<｜Assistant｜>")
    learned = _learned(tok, {"input_ids": enc["chosen_ids"], "labels": enc["chosen_labels"]})
    assert learned == f"\n\nFive.{DS_EOS}"


def test_reasoning_is_kept_or_stripped_as_the_template_does() -> None:
    chat = [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "<think>\nold\n</think>\n\nA1"},
        {"role": "user", "content": "Q2"},
        {"role": "assistant", "content": "A2", "reasoning_content": "R2"},
    ]
    qwen3 = fixture_tokenizer(BY_NAME["think_last"])
    expected = "A1<|im_end|>\n<think>\nR2\n</think>\n\nA2<|im_end|>\n"
    assert _learned(qwen3, encode_chat(qwen3, chat, 4096)) == expected
    deepseek = fixture_tokenizer(BY_NAME["think_prompt"])
    assert _learned(deepseek, encode_chat(deepseek, chat, 4096)) == f"\n\nA1{DS_EOS}A2{DS_EOS}"
    # A template that knows no reasoning keeps inline text and ignores the field.
    chatml = fixture_tokenizer(BY_NAME["chatml"])
    assert _learned(chatml, encode_chat(chatml, chat, 4096)).startswith("<think>\nold\n</think>")
    assert "R2" not in _learned(chatml, encode_chat(chatml, chat, 4096))


def test_sft_rows_keep_reasoning_content() -> None:
    row = {"messages": [CHAT[1], {**CHAT[2], "reasoning_content": "r"}]}
    assert check_sft_row(row, "f:1")["messages"][1]["reasoning_content"] == "r"
    bad = {"messages": [{**CHAT[1], "reasoning_content": "r"}, CHAT[2]]}
    with pytest.raises(DataError, match=r"^f:1: messages\[0\].reasoning_content"):
        check_sft_row(bad, "f:1")


def test_system_turn_under_a_template_without_one_names_the_row(tmp_path: Path) -> None:
    tok = fixture_tokenizer(BY_NAME["no_system"])
    rows = [{"messages": CHAT[1:3]}, {"messages": CHAT[:3]}, {"messages": CHAT[1:]}]
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError, match=f"{path}:2: a system message, but the chat template"):
        prepare(DataConfig(path=str(path)), tok, seed=0)


def test_unservable_template_is_refused_saying_why() -> None:
    with pytest.raises(IngestError, match="cannot be located in one render either"):
        install_template(_copy(base_tokenizer()), _cfg(UNSERVABLE))


def _copy(tok):
    import copy

    return copy.deepcopy(tok)


def _cfg(template: str | None) -> IngestConfig:
    return IngestConfig(source="from_config", chat_template=template)


def test_ingest_reads_a_template_file_and_records_it(tmp_path: Path, caplog) -> None:
    f = tmp_path / "gemma-like.jinja"
    f.write_text(NO_SYSTEM)
    tok = _copy(base_tokenizer())  # lacks <start_of_turn>/<end_of_turn>: split markers
    with caplog.at_level(logging.WARNING, logger="posttrain.ingest"):
        facts = install_template(tok, _cfg(str(f)))
    assert tok.chat_template == NO_SYSTEM
    assert facts["chat_template_file"] == str(f.resolve())
    assert facts["chat_template_strategy"] == "prefix"
    assert facts["chat_template_system_role"] is False
    assert facts["chat_template_split_markers"] == ["<end_of_turn>", "<start_of_turn>"]
    assert "not single tokens" in caplog.text and "<start_of_turn>" in caplog.text
    with pytest.raises(IngestError, match=r"^ingest\.chat_template: .*missing\.jinja' looks like"):
        install_template(_copy(base_tokenizer()), _cfg(str(tmp_path / "missing.jinja")))
    assert read_template("{{ x }}", "f") == ("{{ x }}", None)


def test_markers_that_are_single_tokens_are_not_reported() -> None:
    tok = fixture_tokenizer(BY_NAME["no_system"])
    assert template_markers(tok, CHAT[1:]) == []


def test_tokenizer_larger_than_the_embedding_is_refused() -> None:
    tok = base_tokenizer()
    check_vocab(tok, LlamaConfig(vocab_size=len(tok)))
    with pytest.raises(IngestError, match=f"{len(tok)} tokens but the model's embedding has 300"):
        check_vocab(tok, LlamaConfig(vocab_size=300))


def test_template_errors_are_template_errors() -> None:
    tok = fixture_tokenizer(BY_NAME["no_system"])
    with pytest.raises(TemplateError, match="System role not supported"):
        encode_chat(tok, CHAT, 4096)


def test_check_templates_script_passes_on_the_real_templates(capsys) -> None:
    """The seven real templates (verbatim hub copies in ../shared/templates, outside the
    project) each get a strategy and an exact mask."""
    if not SHARED_TEMPLATES.is_dir():
        pytest.skip(f"{SHARED_TEMPLATES} not present (real templates live outside the project)")
    script = Path(__file__).resolve().parents[1] / "scripts" / "check_templates.py"
    spec = importlib.util.spec_from_file_location("check_templates", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rc = module.main([str(SHARED_TEMPLATES)])
    out = capsys.readouterr().out
    assert rc == 0, out
    n = len(list(SHARED_TEMPLATES.glob("*.jinja")))
    assert f"{n}/{n} templates ok" in out


def test_template_file_is_resolved_and_fingerprinted_by_content(tmp_path: Path) -> None:
    import yaml

    from posttrain.config.loader import load_recipe
    from posttrain.plan.planner import plan

    f = tmp_path / "tpl.jinja"
    f.write_text(NO_SYSTEM)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "run": {"workspace": str(tmp_path / "ws")},
                "infra": {"device": "cpu", "devices_per_node": 1},
                "ingest": {"source": "from_config", "chat_template": str(f)},
                "sft": {"data": {"synthetic": {"n_examples": 10}}},
            }
        )
    )

    def ingest_fp() -> str:
        return next(s.fingerprint for s in plan(load_recipe(recipe)).stages if s.name == "ingest")

    before = ingest_fp()
    assert before == ingest_fp()
    f.write_text(NO_SYSTEM + " ")
    assert ingest_fp() != before, "the file's text, not its name, decides the fingerprint"


def test_stage_guard_reads_a_template_file(tmp_path: Path) -> None:
    from posttrain.data.pref_prepare import guard_template
    from posttrain.sections.shared import TemplateGuard

    f = tmp_path / "other.jinja"
    f.write_text(NO_SYSTEM)
    tok = _copy(base_tokenizer())
    guard_template(tok, None, "dpo", TemplateGuard(chat_template=str(f)))
    assert tok.chat_template == NO_SYSTEM
    with pytest.raises(TemplateError, match=r"^dpo\.chat_template: .*nope\.jinja' looks like"):
        guard_template(tok, None, "dpo", TemplateGuard(chat_template=str(tmp_path / "nope.jinja")))


@pytest.mark.parametrize("f", FIXTURES, ids=lambda f: f.name)
def test_search_agrees_with_exact_prefixes_wherever_they_apply(f: Fixture) -> None:
    """A prefix-strategy row whose prefixes disagree falls back to search: the two must mean
    the same span wherever both apply. The one difference by design: a render-final EOS (Phi's,
    on a one-reply conversation, where prefixes happen to agree) is not end-of-turn text."""
    from posttrain.data.chat import _prefix_spans, _search_spans

    tok = fixture_tokenizer(f)
    compared = 0
    for msgs in (chat_for(f), CHAT[1:], CHAT[1:3]):
        exact = _prefix_spans(tok, msgs)
        if exact is not None:
            text, spans = _search_spans(tok, msgs)
            if f.name == "eos_every_render":
                (a, b), (pa, pb) = spans[-1], exact[1][-1]
                assert (a, text[b:pb]) == (pa, f.eos)
                spans[-1] = (pa, pb)
            assert (text, spans) == exact
            compared += 1
    assert compared or f.strategy == "search"
