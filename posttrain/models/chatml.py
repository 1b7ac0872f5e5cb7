"""The chat templates of the from-config tiny model (`ingest.from_config.template`), apart from
the tokenizer code so that recipe checks can read them without importing it."""

# ChatML layout. `<|im_end|>` closes every turn and is the EOS a generation stops at; the template
# adds no BOS, so there is no double-BOS when text is tokenized without special tokens.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# CHATML_TEMPLATE with tools (written for this project), hermes-style so that
# `posttrain.agents.tool_calls` reads its calls: an assistant turn's calls follow its content as
# `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` blocks, a tool result is a
# `<|im_start|>tool` turn, and the tools are listed in the system turn one line each,
# `add(a, b): Add two integers.`, not as JSON schemas: the tiny model has few positions.
CHATML_TOOLS_TEMPLATE = (
    "{%- set rest = messages %}{%- set system = '' %}"
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{%- set system = messages[0]['content'] %}{%- set rest = messages[1:] %}{%- endif %}"
    "{%- if system or tools %}{{ '<|im_start|>system\n' + system }}"
    "{%- if tools %}{{ '\n' if system else '' }}{{ 'Tools:' }}{%- for t in tools %}"
    "{%- set f = t['function'] %}{%- set args = (f['parameters'] or {}).get('properties', {}) %}"
    "{{ '\n' + f['name'] + '(' + (args | list | join(', ')) + '): ' + f['description'] }}"
    "{%- endfor %}{%- endif %}{{ '<|im_end|>\n' }}{%- endif %}"
    "{%- for message in rest %}"
    "{%- if message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{ '<|im_start|>assistant\n' + message['content'] }}"
    "{%- for call in message['tool_calls'] %}{%- set f = call['function'] %}"
    "{{ '\n' if message['content'] or not loop.first else '' }}"
    "{{ '<tool_call>\n{\"name\": \"' + f['name'] + '\", \"arguments\": ' }}"
    "{{ f['arguments'] | tojson }}{{ '}\n</tool_call>' }}"
    "{%- endfor %}{{ '<|im_end|>\n' }}"
    "{%- else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{%- endif %}"
)
# `ingest.from_config.template` names one of these.
TEMPLATES = {"chatml": CHATML_TEMPLATE, "chatml_tools": CHATML_TOOLS_TEMPLATE}
