"""Check real chat templates offline: ingest's self-check and the SFT mask for every `.jinja`
file in a folder (e.g. ../shared/templates, verbatim copies of hub models' templates).

    PYTHONPATH=. HF_HUB_OFFLINE=1 python scripts/check_templates.py ../shared/templates

No hub tokenizer can be downloaded, so each template runs on a locally trained byte-level BPE
with that family's markers added as special tokens (one id each, as in the real tokenizer) and
its BOS/EOS. Per template it prints the strategy, ok/FAIL, and the masked text of the sample
conversation and of a reasoning sample. Exit status 1 when any template fails.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from posttrain.data.chat import (
    IGNORE,
    MARKER,
    SAMPLE_CHAT,
    TemplateError,
    assistant_char_spans,
    encode_chat,
    prompt_text,
    template_info,
)
from posttrain.data.preference import encode_pair
from posttrain.data.synthetic import pretrain_corpus
from posttrain.models.tiny import train_tokenizer
from tests.chat_template_fixtures import with_chat_tokens

# (BOS, EOS) of each family's own tokenizer, by file name; markers come from the template text.
FAMILY_TOKENS: dict[str, tuple[str | None, str]] = {
    "llama3.1": ("<|begin_of_text|>", "<|eot_id|>"),
    "qwen2.5": (None, "<|im_end|>"),
    "qwen3": (None, "<|im_end|>"),
    "gemma2": ("<bos>", "<eos>"),
    "phi3.5": ("<s>", "<|endoftext|>"),
    "deepseek-r1-distill": ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
    "mistral-v0.3": ("<s>", "</s>"),
}
REASONING_CHAT = [
    {"role": "user", "content": "hello"},
    {"role": "assistant", "content": "<think>\nold\n</think>\n\nhi"},
    {"role": "user", "content": "again"},
    {"role": "assistant", "content": "yes", "reasoning_content": "think"},
]


def masked_text(tok: Any, messages: list[dict[str, str]]) -> str:
    enc = encode_chat(tok, messages, 1 << 16)
    assert enc is not None
    return tok.decode(
        [i for i, lab in zip(enc["input_ids"], enc["labels"], strict=True) if lab != IGNORE]
    )


def check(tok: Any) -> tuple[str, list[str]]:
    """(strategy, problems) of the tokenizer's template on the ingest sample."""
    info = template_info(tok)
    sample = SAMPLE_CHAT if info.system_role else SAMPLE_CHAT[1:]
    problems = []
    text, spans = assistant_char_spans(tok, sample)
    enc = encode_chat(tok, sample, 1 << 16)
    if (
        tok.bos_token
        and text.startswith(tok.bos_token)
        and enc["input_ids"].count(tok.bos_token_id) != 1
    ):
        problems.append(f"BOS appears {enc['input_ids'].count(tok.bos_token_id)} times")
    answers = [m["content"] for m in sample if m["role"] == "assistant"]
    for (a, b), answer in zip(spans, answers, strict=True):
        turn = text[a:b]
        if answer not in turn or not turn.endswith(info.end_of_turn) or not info.end_of_turn:
            problems.append(
                f"span {turn!r} is not answer {answer!r} + end of turn {info.end_of_turn!r}"
            )
    if masked_text(tok, sample) != "".join(text[a:b] for a, b in spans):
        problems.append("masked tokens differ from the spans' text")
    prompt, _ = prompt_text(tok, sample)
    if not prompt:
        problems.append("empty generation prompt")
    # A preference pair: both sides share the prompt tokens, and each learns its reply + EOT.
    pair = encode_pair(tok, {"prompt": sample[:-1], "chosen": "yes", "rejected": "no"}, 4096, 2048)
    for key, reply in (("chosen", "yes"), ("rejected", "no")):
        ids, labels = pair[f"{key}_ids"], pair[f"{key}_labels"]
        learned = tok.decode([i for i, lab in zip(ids, labels, strict=True) if lab != IGNORE])
        if reply not in learned or not learned.endswith(info.end_of_turn):
            problems.append(f"pair side {key} learns {learned!r}")
    return info.strategy, problems


def family_tokenizer(base: Any, path: Path) -> Any:
    template = path.read_text(encoding="utf-8")
    bos, eos = FAMILY_TOKENS.get(path.stem, (None, "</s>"))
    markers = sorted({m.group() for m in MARKER.finditer(template)})
    return with_chat_tokens(base, template, markers, bos, eos)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    args = parser.parse_args(argv)
    files = sorted(args.folder.glob("*.jinja"))
    if not files:
        print(f"{args.folder}: no .jinja files", file=sys.stderr)
        return 1
    base = train_tokenizer(pretrain_corpus(200, 0), 400)
    failed = 0
    for path in files:
        tok = family_tokenizer(base, path)
        try:
            strategy, problems = check(tok)
            sample = SAMPLE_CHAT if template_info(tok).system_role else SAMPLE_CHAT[1:]
            status = "ok" if not problems else "FAIL"
            print(
                f"{path.stem:22} {strategy:10} {status:4} system_role={template_info(tok).system_role}"
            )
            print(f"    masked:    {masked_text(tok, sample)!r}")
            print(f"    reasoning: {masked_text(tok, REASONING_CHAT)!r}")
            print(f"    prompt:    ...{prompt_text(tok, sample)[0][-50:]!r}")
            pair = encode_pair(
                tok, {"prompt": sample[:-1], "chosen": "yes", "rejected": "no"}, 4096, 2048
            )
            n = pair["prompt_len"]
            print(
                f"    pair:      ...{tok.decode(pair['chosen_ids'][:n])[-30:]!r} + {tok.decode(pair['chosen_ids'][n:])!r}"
            )
            for p in problems:
                print(f"    problem:   {p}")
        except TemplateError as exc:
            status = "FAIL"
            print(f"{path.stem:22} {'-':10} FAIL {exc}")
        failed += status != "ok"
    print(f"{len(files) - failed}/{len(files)} templates ok")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
