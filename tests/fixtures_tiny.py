"""A tiny real model, tokenizer and LoRA adapters shared by the eval and export tests.

Test modules wrap `tiny_assets` in their own fixture (another engineer owns conftest.py). The
assets are built once per process (about 2 s on an idle machine) however many modules ask: the
cache lives here, not in a fixture scope.

- base: Llama, hidden 64, 2 layers, 400-token byte-level BPE, given a 30-step causal-LM warm-up
  on the synthetic corpus so that greedy decoding produces varied text, not one repeated token.
- adapter_zero: a freshly initialised LoRA adapter (B = 0), i.e. an untrained adapter.
- adapter_trained: the same adapter after a few AdamW steps on one SFT batch.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModelForCausalLM, PreTrainedModel  # noqa: E402

from posttrain.data.batching import pad_batch  # noqa: E402
from posttrain.data.chat import IGNORE, encode_chat, prompt_text  # noqa: E402
from posttrain.data.synthetic import pretrain_corpus, quickstart_sft_rows  # noqa: E402
from posttrain.kinds.ingest import FromConfigModel
from posttrain.models.lora import apply_lora  # noqa: E402
from posttrain.models.tiny import build_model, train_tokenizer  # noqa: E402
from posttrain.sections.shared import LoraConfig
from posttrain.train.losses import token_nll_sum  # noqa: E402

MODEL_CFG = FromConfigModel(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128)
LORA_CFG = LoraConfig(r=4, alpha=8)
VOCAB = 400
MAX_LEN = 96


@dataclass(frozen=True)
class TinyAssets:
    tokenizer: Any
    base_dir: Path
    adapter_zero: Path
    adapter_trained: Path
    root: Path


_CACHE: dict[str, TinyAssets] = {}


def sft_examples(tokenizer: Any, n: int, seed: int) -> list[dict[str, list[int]]]:
    rows = quickstart_sft_rows(n, seed)
    out = [encode_chat(tokenizer, r["messages"], MAX_LEN) for r in rows]
    return [e for e in out if e is not None]


def sft_batch(tokenizer: Any, n: int = 8, seed: int = 0) -> dict[str, torch.Tensor]:
    return pad_batch(sft_examples(tokenizer, n, seed), tokenizer.pad_token_id)


def prompts(tokenizer: Any, n: int, seed: int = 7) -> list[str]:
    """Chat-templated prompts ending in the assistant header, of varied lengths."""
    return [prompt_text(tokenizer, r["messages"])[0] for r in quickstart_sft_rows(n, seed)]


def train_steps(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], steps: int, lr: float
) -> list[float]:
    """Plain AdamW steps on one batch; returns the loss before each step."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr)
    model.train()
    losses = []
    for _ in range(steps):
        logits = model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
            use_cache=False,
        ).logits
        nll, n = token_nll_sum(logits, batch["labels"])
        loss = nll / n
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    model.eval()
    return losses


def _warm_up(model: PreTrainedModel, tokenizer: Any, steps: int) -> None:
    docs = pretrain_corpus(steps * 16, seed=1)
    for i in range(steps):
        enc = tokenizer(
            docs[i * 16 : (i + 1) * 16], add_special_tokens=False, padding=True, return_tensors="pt"
        )
        mask = enc["attention_mask"]
        batch = {
            "input_ids": enc["input_ids"],
            "attention_mask": mask,
            "labels": enc["input_ids"].masked_fill(mask == 0, IGNORE),
            "position_ids": torch.arange(mask.shape[1]).expand_as(mask),
        }
        train_steps(model, batch, steps=1, lr=1e-2)


def load_base(assets: TinyAssets) -> PreTrainedModel:
    """A fresh fp32 copy of the tiny base (tests may train or mutate it)."""
    return AutoModelForCausalLM.from_pretrained(str(assets.base_dir), dtype=torch.float32).eval()


def _build(root: Path) -> TinyAssets:
    torch.manual_seed(0)
    tok = train_tokenizer(pretrain_corpus(500, seed=0), VOCAB)
    model = build_model(MODEL_CFG, tok)
    _warm_up(model, tok, steps=30)
    base_dir = root / "base"
    model.save_pretrained(str(base_dir))
    tok.save_pretrained(str(base_dir))
    assets = TinyAssets(tok, base_dir, root / "adapter_zero", root / "adapter_trained", root)

    torch.manual_seed(1)
    apply_lora(load_base(assets), LORA_CFG).save_pretrained(str(assets.adapter_zero))
    torch.manual_seed(1)
    trained = apply_lora(load_base(assets), LORA_CFG)
    train_steps(trained, sft_batch(tok, n=8, seed=0), steps=8, lr=1e-2)
    trained.save_pretrained(str(assets.adapter_trained))
    return assets


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """One intra-op thread inside the block. Matmuls this small gain nothing from a second
    thread, and on shared cores two threads contending with other processes ran the same test
    up to 20x slower. The caller's setting is restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def tiny_assets(tmp_path_factory: pytest.TempPathFactory) -> TinyAssets:
    """The shared assets, built on first use in this process."""
    if "assets" not in _CACHE:
        with one_torch_thread():
            _CACHE["assets"] = _build(tmp_path_factory.mktemp("tiny"))
    return _CACHE["assets"]


def family_role_model(family: str) -> Any:
    """A random-init tiny LoRA policy of another cache layout than the tiny Llama, as a
    `RoleModel`: grouped KV heads (`qwen2`, `qwen3`), or Gemma-2's sliding-window layers
    (window 8, shorter than the tests' prompts) with its logit soft-cap (`gemma2`). Vocabulary
    300, pad id 0, LoRA B random (the adapter changes the outputs)."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from torch import nn
    from transformers import (
        Gemma2Config,
        Gemma2ForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    from posttrain.models.roles import RoleModel

    common = dict(
        vocab_size=300,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        pad_token_id=0,
    )
    cls, cfg = {
        "qwen2": (Qwen2ForCausalLM, Qwen2Config(**common)),
        "qwen3": (Qwen3ForCausalLM, Qwen3Config(head_dim=16, **common)),
        "gemma2": (
            Gemma2ForCausalLM,
            Gemma2Config(head_dim=16, sliding_window=8, final_logit_softcapping=30.0, **common),
        ),
    }[family]
    torch.manual_seed(0)
    lora = PeftLoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    lm = get_peft_model(cls(cfg).float().eval(), lora)
    return RoleModel(lm, nn.Linear(64, 1), None)
