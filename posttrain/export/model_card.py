"""The export's README.md: a Hugging Face model card with lineage, file hashes and metrics.

A pure function of its inputs (no clock, no file reads), so the same run renders the same card
byte for byte and the card can be part of the export's content hash.
"""

from __future__ import annotations

import json
from typing import Any

import yaml

# Every card's tags; the kinds of the stages the shipped policy went through follow them.
TAGS = ["posttrain", "lora", "merged-lora", "text-generation"]
USAGE = (
    "```python\n"
    "from transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
    'model = AutoModelForCausalLM.from_pretrained("path/to/this/folder")\n'
    'tokenizer = AutoTokenizer.from_pretrained("path/to/this/folder")\n'
    'messages = [{"role": "user", "content": "Hello"}]\n'
    "inputs = tokenizer.apply_chat_template(\n"
    '    messages, add_generation_prompt=True, return_dict=True, return_tensors="pt"\n'
    ")\n"
    "out = model.generate(**inputs, max_new_tokens=48)\n"
    'print(tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))\n'
    "```\n"
)


def _cell(value: Any) -> str:
    """One markdown table cell: pipes escaped, newlines flattened."""
    if isinstance(value, float):
        text = f"{value:.4g}"
    elif isinstance(value, (list, tuple)):
        text = ", ".join(str(v) for v in value) or "-"
    elif value is None or value == "":
        text = "-"
    else:
        text = str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def _table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _flatten(metrics: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """{"heldout": {"loss": 1.2}} -> [("heldout.loss", 1.2)], in insertion order."""
    out: list[tuple[str, Any]] = []
    for key, value in metrics.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out += _flatten(value, prefix=f"{name}.")
        else:
            out.append((name, value))
    return out


def pipeline_text(path: list[tuple[str, str]], evaluated: bool) -> str:
    """The stages that made the shipped policy, base first, as one chain of (stage name, kind):
    `ingest -> sft -> dpo -> grpo (grpo_long) -> evaluate -> export`. A stage named other
    than its kind shows its name, so two stages of one kind stay apart."""
    steps = [kind if name == kind else f"{kind} ({name})" for name, kind in path]
    return " -> ".join([*steps, *(["evaluate"] if evaluated else []), "export"])


def path_tags(path: list[tuple[str, str]]) -> list[str]:
    """TAGS, then each training kind on the path once, in order (the base's ingest is none)."""
    kinds = [kind for _, kind in path[1:]]
    return [*TAGS, *dict.fromkeys(kinds)]


def _front_matter(base: dict[str, Any], tags: list[str]) -> str:
    meta: dict[str, Any] = {"library_name": "transformers", "pipeline_tag": "text-generation"}
    # The Hub links `base_model` to a repository id and rejects anything else, so a local base
    # (a folder, or a model built from a config) is described in the card body only.
    if base.get("hub_id"):
        meta["base_model"] = base["hub_id"]
        # A LoRA merged into its base is a fine-tune of it ("merge" means model merging).
        meta["base_model_relation"] = "finetune"
    meta["tags"] = tags
    return "---\n" + yaml.safe_dump(meta, sort_keys=False) + "---\n"


def model_card(
    name: str,
    base: dict[str, Any],
    lineage: list[dict[str, Any]],
    files: dict[str, str],
    metrics: dict[str, Any],
    recipe_sections: dict[str, Any],
    path: list[tuple[str, str]],
    evaluated: bool,
    gguf_files: dict[str, str] | None = None,
) -> str:
    """Render README.md for an export.

    base: facts about the base model (e.g. name, hub_id, architecture, params, fingerprint);
    `hub_id`, when given, becomes the front matter's `base_model`.
    lineage: one dict per stage in run order: {"stage", "fingerprint", "parents": [fingerprints]}.
    files: relative path -> sha256 of each file in the export.
    metrics: key figures, nested dicts allowed (rendered as dotted names).
    recipe_sections: recipe section name -> its resolved settings, shown as YAML.
    path: (stage name, kind) of the base and of every stage the shipped policy descends from,
    base first; with `evaluated` (an evaluate stage measured it), the card's pipeline sentence
    and tags.
    gguf_files: path relative to the export folder (`gguf/<name>-<type>.gguf`) -> sha256, for
    llama.cpp/Ollama; the card then says how to run them.
    """
    base_name = base.get("hub_id") or base.get("name") or "the base model"
    parts = [
        _front_matter(base, path_tags(path)),
        f"# {name}\n",
        f"A LoRA fine-tune of {base_name}, merged into the base weights and saved as a plain "
        "transformers checkpoint (safetensors); it loads without peft. Produced by the "
        f"posttrain pipeline: {pipeline_text(path, evaluated)}.\n",
        "## Base model\n",
        _table(["field", "value"], [[k, v] for k, v in base.items()]) + "\n",
        "## Key metrics\n",
        (
            _table(["metric", "value"], [list(kv) for kv in _flatten(metrics)])
            if metrics
            else "No metrics were recorded."
        )
        + "\n",
        "## Lineage\n",
        "Each stage's fingerprint hashes its code version, recipe section and parents' "
        "fingerprints; the same fingerprint means the same inputs.\n",
        _table(
            ["stage", "fingerprint", "parents"],
            [[s.get("stage"), s.get("fingerprint"), s.get("parents", [])] for s in lineage],
        )
        + "\n",
        "## Files\n",
        _table(["file", "sha256"], [[p, files[p]] for p in sorted(files)]) + "\n",
        "## How it was produced\n",
        "Stages, in order: " + " -> ".join(str(s.get("stage")) for s in lineage) + ".\n",
    ]
    for section, settings in recipe_sections.items():
        body = yaml.safe_dump(json.loads(json.dumps(settings, default=str)), sort_keys=False)
        parts.append(f"### `{section}`\n\n```yaml\n{body.rstrip()}\n```\n")
    parts += ["## Usage\n", USAGE]
    if gguf_files:
        parts.append(_gguf_usage(gguf_files))
    return "\n".join(parts)


def _gguf_usage(gguf_files: dict[str, str]) -> str:
    """How to run the GGUF files beside this folder with llama.cpp and Ollama."""
    first = sorted(gguf_files)[0]
    return "\n".join(
        [
            "## GGUF (llama.cpp, Ollama)\n",
            "The same merged weights converted to GGUF, in the export's `gguf/` folder (next to "
            "this one); each was read back and compared with the merged weights. The chat "
            "template is inside the file.\n",
            _table(["file", "sha256"], [[p, gguf_files[p]] for p in sorted(gguf_files)]) + "\n",
            "```bash\n"
            f"llama-cli -m {first} -cnv          # chat, with the embedded chat template\n"
            f"llama-server -m {first} --port 8080  # OpenAI-compatible server\n"
            "```\n",
            "Ollama: a `Modelfile` beside the file holding\n",
            f"```\nFROM ./{first.rsplit('/', 1)[-1]}\n```\n",
            "then `ollama create my-model -f Modelfile` and `ollama run my-model`.\n",
        ]
    )
