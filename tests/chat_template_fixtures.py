"""Small chat templates written for these tests, each reproducing one behaviour of a real model
family's template (not copies of them: the real ones are third-party data, kept outside the
project). Each fixture names its special tokens, BOS/EOS, the strategy it must get, whether it
accepts a system role, and the exact text the SFT mask must cover for CHAT.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from transformers import PreTrainedTokenizerFast

from posttrain.data.synthetic import pretrain_corpus
from posttrain.models.chatml import CHATML_TEMPLATE
from posttrain.models.tiny import IM_END, train_tokenizer

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "2 + 3 = 5."},
    {"role": "user", "content": "And 1 + 1?"},
    {"role": "assistant", "content": "1 + 1 = 2."},
]


@dataclass(frozen=True)
class Fixture:
    name: str
    template: str
    specials: tuple[str, ...]
    bos: str | None
    eos: str
    strategy: str
    system_role: bool
    masked: str  # decoded masked tokens of CHAT (without its system turn when refused)


# System role refused with raise_exception; content trimmed; BOS in the template (Gemma-2).
NO_SYSTEM = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + m['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)

# EOS after every render without a generation prompt, so no shorter render is a prefix (Phi-3.5).
EOS_EVERY_RENDER = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] + '<|end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}"
    "{% else %}{{ eos_token }}{% endif %}"
)

# Generation prompt ends in `<think>\n`; text before `</think>` is stripped from assistant turns;
# the system text goes first without a marker (DeepSeek-R1-Distill).
THINK_PROMPT = (
    "{% set ns = namespace(system='') %}{% for m in messages %}{% if m['role'] == 'system' %}"
    "{% set ns.system = m['content'] %}{% endif %}{% endfor %}{{ bos_token }}{{ ns.system }}"
    "{% for m in messages %}{% if m['role'] == 'user' %}{{ '<｜User｜>' + m['content'] }}"
    "{% elif m['role'] == 'assistant' %}{% set content = m['content'] %}"
    "{% if '</think>' in content %}{% set content = content.split('</think>')[-1] %}{% endif %}"
    "{{ '<｜Assistant｜>' + content + eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<｜Assistant｜><think>\n' }}{% endif %}"
)

# Think blocks (from reasoning_content or inline <think>) only on turns after the last user
# message; earlier turns lose their reasoning (Qwen3).
THINK_LAST = (
    "{%- set ns = namespace(last_user=0) %}{%- for m in messages %}{%- if m['role'] == 'user' %}"
    "{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}{%- if m['role'] == 'assistant' %}"
    "{%- set content = m['content'] %}{%- set reasoning = '' %}"
    "{%- if m.reasoning_content is defined and m.reasoning_content is not none %}"
    "{%- set reasoning = m.reasoning_content %}"
    "{%- elif '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\n') %}{%- endif %}"
    "{%- if loop.index0 > ns.last_user %}"
    "{{- '<|im_start|>assistant\n<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' + content }}"
    "{%- else %}{{- '<|im_start|>assistant\n' + content }}{%- endif %}{{- '<|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}"
    "{%- endif %}"
)

# The system message goes into the LAST user turn; replies are " " + trimmed content + EOS; no
# generation prompt of its own (Mistral v0.3).
SYSTEM_LAST_USER = (
    "{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}"
    "{%- endif %}{{- bos_token }}{%- for m in loop_messages %}{%- if m['role'] == 'user' %}"
    "{%- if loop.last and system is defined %}"
    "{{- '[INST] ' + system + '\n\n' + m['content'] + '[/INST]' }}"
    "{%- else %}{{- '[INST] ' + m['content'] + '[/INST]' }}{%- endif %}"
    "{%- else %}{{- ' ' + m['content'] | trim + eos_token }}{%- endif %}{%- endfor %}"
)

# BOS written by the template itself, header markers, one end-of-turn token (Llama-3.1).
BOS_IN_TEMPLATE = (
    "{{- bos_token }}{%- for m in messages %}"
    "{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + m['content'] | trim"
    " + '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{%- endif %}"
)

# ChatML whose assistant text is marked with {% generation %} (transformers' assistant mask).
GENERATION = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}"
    "{% generation %}{{ m['content'] + '<|im_end|>\n' }}{% endgeneration %}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# No strategy serves it: the message count comes first (so prefixes differ) and content is
# upper-cased (so no probe survives).
UNSERVABLE = (
    "{{ messages | length }}{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}"
    "{{ m['content'] | upper }}{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

DS_EOS = "<｜end▁of▁sentence｜>"
FIXTURES = [
    Fixture(
        "chatml",
        CHATML_TEMPLATE,
        (),
        None,
        IM_END,
        "prefix",
        True,
        f"2 + 3 = 5.{IM_END}\n1 + 1 = 2.{IM_END}\n",
    ),
    Fixture(
        "no_system",
        NO_SYSTEM,
        ("<start_of_turn>", "<end_of_turn>"),
        "<bos>",
        "<eos>",
        "prefix",
        False,
        "2 + 3 = 5.<end_of_turn>\n1 + 1 = 2.<end_of_turn>\n",
    ),
    Fixture(
        "eos_every_render",
        EOS_EVERY_RENDER,
        ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>"),
        None,
        "<|endoftext|>",
        "search",
        True,
        "2 + 3 = 5.<|end|>\n1 + 1 = 2.<|end|>\n",
    ),
    Fixture(
        "think_prompt",
        THINK_PROMPT,
        ("<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"),
        "<｜begin▁of▁sentence｜>",
        DS_EOS,
        "search",
        True,
        f"2 + 3 = 5.{DS_EOS}1 + 1 = 2.{DS_EOS}",
    ),
    Fixture(
        "think_last",
        THINK_LAST,
        ("<think>", "</think>"),
        None,
        IM_END,
        "search",
        True,
        f"2 + 3 = 5.{IM_END}\n<think>\n\n</think>\n\n1 + 1 = 2.{IM_END}\n",
    ),
    Fixture(
        "system_last_user",
        SYSTEM_LAST_USER,
        ("[INST]", "[/INST]"),
        "<s>",
        "</s>",
        "search",
        True,
        " 2 + 3 = 5.</s> 1 + 1 = 2.</s>",
    ),
    Fixture(
        "bos_in_template",
        BOS_IN_TEMPLATE,
        ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
        "<|begin_of_text|>",
        "<|eot_id|>",
        "prefix",
        True,
        "2 + 3 = 5.<|eot_id|>1 + 1 = 2.<|eot_id|>",
    ),
    Fixture(
        "generation",
        GENERATION,
        (),
        None,
        IM_END,
        "generation",
        True,
        f"2 + 3 = 5.{IM_END}\n1 + 1 = 2.{IM_END}\n",
    ),
]

_BASE: list = []


def base_tokenizer():
    """A 400-token byte-level BPE with the ChatML specials, trained once per process."""
    if not _BASE:
        _BASE.append(train_tokenizer(pretrain_corpus(200, 0), 400))
    return _BASE[0]


def fixture_tokenizer(f: Fixture):
    return with_chat_tokens(base_tokenizer(), f.template, f.specials, f.bos, f.eos)


def chat_for(f: Fixture) -> list[dict[str, str]]:
    return CHAT if f.system_role else CHAT[1:]


def with_chat_tokens(
    tokenizer: PreTrainedTokenizerFast,
    template: str,
    specials: Iterable[str],
    bos: str | None,
    eos: str,
) -> PreTrainedTokenizerFast:
    """A copy of `tokenizer` with a model family's chat markers added as special tokens (one id
    each, as in the family's own tokenizer), its BOS/EOS, and `template` installed: a stand-in
    for a hub tokenizer when checking real chat templates offline."""
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.add_tokens([s for s in (*specials, bos, eos) if s], special_tokens=True)
    tok.bos_token = bos
    tok.eos_token = eos
    tok.chat_template = template
    return tok
