"""Build a small model and tokenizer offline: the `from_config` ingest mode, quickstart and tests.

No model hub is reachable, so the tokenizer is a byte-level BPE trained on text we generate, and
the model is a transformers architecture built from a config with random weights.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from posttrain.kinds.ingest import FromConfigModel
from posttrain.models.chatml import CHATML_TEMPLATE

IM_START, IM_END, PAD, EOT = "<|im_start|>", "<|im_end|>", "<|pad|>", "<|endoftext|>"
SPECIAL_TOKENS = [PAD, EOT, IM_START, IM_END]


def train_tokenizer(corpus: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE (every byte representable, so no unknown tokens) with ChatML specials."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    return _wrap(tok)


def _wrap(tok: Tokenizer) -> PreTrainedTokenizerFast:
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=PAD,
        unk_token=None,
        additional_special_tokens=[IM_START, EOT],
        model_max_length=1 << 20,
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def fill_vocabulary(tokenizer: PreTrainedTokenizerFast, size: int) -> PreTrainedTokenizerFast:
    """The same BPE extended to exactly `size` tokens (specials included) by merges of pairs of
    its own tokens, in a fixed order. A small corpus trains a few thousand tokens at most; this
    gives a real model's vocabulary size (151,665 for Qwen2.5) so embedding, LM head, logits
    and tokenizer files have real sizes. The added merges rank after the trained ones, so text
    tokenizes much as before."""
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab: dict[str, int] = spec["model"]["vocab"]
    merges: list = spec["model"]["merges"]
    special = set(SPECIAL_TOKENS)
    base = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1]) if t not in special]
    pairs = ((a, b) for a in base for b in base)  # base^2 exceeds any real vocabulary
    while len(vocab) < size:
        a, b = next(pairs)
        if a + b not in vocab:
            vocab[a + b] = len(vocab)
            merges.append([a, b])
    return _wrap(Tokenizer.from_str(json.dumps(spec)))


def build_model(cfg: FromConfigModel, tokenizer: PreTrainedTokenizerFast) -> PreTrainedModel:
    """Random-init causal LM of the configured family, with `embedding_rows` rows (default the
    tokenizer's vocabulary)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(
        vocab_size=cfg.embedding_rows or len(tokenizer),
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads or cfg.num_heads,
        intermediate_size=cfg.intermediate_size,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        torch_dtype="float32",
    )
    if cfg.architecture == "llama":
        return LlamaForCausalLM(LlamaConfig(**common))
    return Qwen2ForCausalLM(Qwen2Config(**common))
