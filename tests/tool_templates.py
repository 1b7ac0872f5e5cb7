"""Chat templates with tools, written for these tests (not copies of the real ones), each
rendering tool calls the way one family's template does: Qwen's `<tool_call>` blocks with tool
results in a user turn (HERMES), Llama 3.1's bare JSON with an `ipython` turn (LLAMA_JSON),
Mistral v0.3's `[TOOL_CALLS]` list and `[TOOL_RESULTS]` (MISTRAL)."""

from __future__ import annotations

HERMES = (
    "{% for m in messages %}"
    "{% if m.role == 'assistant' and m.tool_calls %}{{ '<|im_start|>assistant' }}"
    "{% if m.content %}{{ '\n' + m.content }}{% endif %}"
    "{% for c in m.tool_calls %}{% set c = c.function %}"
    '{{ \'\n<tool_call>\n{"name": "\' + c.name + \'", "arguments": \' }}'
    "{{ c.arguments | tojson }}{{ '}\n</tool_call>' }}{% endfor %}{{ '<|im_end|>\n' }}"
    "{% elif m.role == 'tool' %}"
    "{{ '<|im_start|>user\n<tool_response>\n' + m.content + '\n</tool_response><|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA_JSON = (
    "{{ bos_token }}{% for m in messages %}"
    "{% set role = 'ipython' if m.role == 'tool' else m.role %}"
    "{{ '<|start_header_id|>' + role + '<|end_header_id|>\n\n' }}"
    "{% if m.tool_calls %}{% set c = m.tool_calls[0].function %}"
    "{{ '{\"name\": \"' + c.name + '\", \"parameters\": ' }}{{ c.arguments | tojson }}{{ '}' }}"
    "{% else %}{{ m.content | trim }}{% endif %}{{ '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)
MISTRAL = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m.role == 'user' %}{{ '[INST] ' + m.content + '[/INST]' }}"
    "{% elif m.tool_calls %}{{ '[TOOL_CALLS] [' }}{% for c in m.tool_calls %}"
    "{% set out = c.function | tojson %}{{ out[:-1] + ', \"id\": \"' + c.id + '\"}' }}"
    "{% if not loop.last %}{{ ', ' }}{% else %}{{ ']' + eos_token }}{% endif %}{% endfor %}"
    "{% elif m.role == 'tool' %}"
    '{{ \'[TOOL_RESULTS] {"content": \' + m.content + \', "call_id": "\' + m.tool_call_id }}'
    "{{ '\"}[/TOOL_RESULTS]' }}"
    "{% else %}{{ ' ' + m.content | trim + eos_token }}{% endif %}{% endfor %}"
)
# (template, special tokens, bos, eos, the end-of-turn text a reply stops at)
STYLES = {
    "hermes": (HERMES, ("<|im_start|>", "<|im_end|>"), None, "<|im_end|>", "<|im_end|>"),
    "llama3_json": (
        LLAMA_JSON,
        ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|python_tag|>"),
        "<|begin_of_text|>",
        "<|eot_id|>",
        "<|eot_id|>",
    ),
    "mistral": (
        MISTRAL,
        ("[INST]", "[/INST]", "[TOOL_CALLS]", "[TOOL_RESULTS]"),
        "<s>",
        "</s>",
        "</s>",
    ),
}

# HERMES with an empty think block opening a tool-call turn only when it is the last message (a
# Qwen3-like "last turn apart"): the render that ends at the call is no prefix of the full
# trace, so such rows fall back from "prefix" to "search".
HERMES_LAST_THINKS = HERMES.replace(
    "{{ '<|im_start|>assistant' }}",
    "{{ '<|im_start|>assistant' }}{% if loop.last %}{{ '\n<think>\n\n</think>\n' }}{% endif %}",
)

# HERMES whose assistant text, calls included, is marked with {% generation %}.
HERMES_GENERATION = (
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}{{ '<|im_start|>assistant\n' }}{% generation %}"
    "{% if m.content %}{{ m.content }}{% endif %}"
    "{% for c in m.tool_calls or [] %}{% set c = c.function %}"
    '{{ \'<tool_call>\n{"name": "\' + c.name + \'", "arguments": \' }}'
    "{{ c.arguments | tojson }}{{ '}\n</tool_call>' }}{% endfor %}{{ '<|im_end|>\n' }}"
    "{% endgeneration %}"
    "{% elif m.role == 'tool' %}"
    "{{ '<|im_start|>user\n<tool_response>\n' + m.content + '\n</tool_response><|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
