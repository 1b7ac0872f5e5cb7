"""Merged transformers folder -> one .gguf file per requested type (f16, bf16, q8_0), for llama.cpp.

Only the Llama and Qwen2 families are converted, and only with a byte-level BPE tokenizer whose
pre-tokenizer llama.cpp reproduces (GPT-2, Llama-3, Qwen2 splitting): `check_convertible` says
which of these a folder misses, up front, before anything is written.

Streaming. Tensor infos (names, shapes, types, byte sizes) are computed from the safetensors
headers alone and written first; then the tensors follow one at a time, each read from its shard,
converted and written before the next is read. Peak memory is about three copies of the largest
single tensor (stored, fp32, converted), e.g. ~9 GB for a 70B model's 128256 x 8192 embedding,
never the model.

Rotary layout. HF Llama checkpoints store q_proj/k_proj rows permuted for `rotate_half` rope
(dimension i pairs with i + head_dim/2); llama.cpp's LLAMA graph applies the original
interleaved rope (dimension 2i pairs with 2i+1). `hf_to_ggml_rope_rows` undoes HF's permutation
per head, as llama.cpp's own convert_hf_to_gguf.py does. Qwen2 runs NEOX rope in llama.cpp, which
is rotate_half, so its q/k rows are written as stored.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors import safe_open

# model_type in config.json -> llama.cpp architecture.
FAMILIES: dict[str, gguf.MODEL_ARCH] = {
    "llama": gguf.MODEL_ARCH.LLAMA,
    "qwen2": gguf.MODEL_ARCH.QWEN2,
}
Q = gguf.GGMLQuantizationType
# recipe name -> (type of 2-D weights, general.file_type). 1-D tensors (norms, biases) stay F32
# in every file, as llama.cpp keeps them.
GGUF_TYPES: dict[str, tuple[gguf.GGMLQuantizationType, gguf.LlamaFileType]] = {
    "f16": (Q.F16, gguf.LlamaFileType.MOSTLY_F16),
    "bf16": (Q.BF16, gguf.LlamaFileType.MOSTLY_BF16),
    "q8_0": (Q.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
}
SUPPORTED = "supported: Llama and Qwen2 families with a byte-level BPE tokenizer"

# The Split regexes of Llama-3's and Qwen2's tokenizer.json; they differ in digits (1-3 per
# token vs one). A bare ByteLevel pre-tokenizer with its regex on is GPT-2's split.
LLAMA3_SPLIT = (
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+"
    "[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
)
QWEN2_SPLIT = (
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+"
    "[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
)
# HF tensors llama.cpp has no use for (recomputed from rope_theta).
SKIPPED_SUFFIXES = ("rotary_emb.inv_freq",)


class GGUFUnsupported(ValueError):
    """The folder cannot be converted to a GGUF llama.cpp would run correctly."""


@dataclass(frozen=True)
class HParams:
    """What the conversion needs from config.json."""

    family: str
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ctx: int
    rope_theta: float
    rms_eps: float
    n_vocab: int  # embedding rows; may exceed the tokenizer's vocabulary (Qwen2 pads it)
    tied: bool
    rope: dict[str, Any] = field(default_factory=dict)

    @property
    def arch(self) -> gguf.MODEL_ARCH:
        return FAMILIES[self.family]


@dataclass(frozen=True)
class PlannedTensor:
    gguf_name: str
    shape: tuple[int, ...]  # numpy order, as in the HF tensor
    gtype: gguf.GGMLQuantizationType
    hf_name: str | None  # None for tensors computed here (rope_freqs)
    file: Path | None
    permute_heads: int = 0  # > 0: HF rotate_half rows -> GGML interleaved rope, this many heads

    @property
    def nbytes(self) -> int:
        block, size = gguf.GGML_QUANT_SIZES[self.gtype]
        return math.prod(self.shape) * size // block


def family_problem(config: dict[str, Any]) -> str | None:
    """One line saying why this config's family cannot go to GGUF, or None when it can."""
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        return (
            f"export.gguf: model_type {model_type!r} cannot be exported to GGUF "
            f"({SUPPORTED}); remove export.gguf or export another base"
        )
    kind = rope_kind(_rope(config))
    if kind not in ("default", "llama3") or (kind == "llama3" and model_type != "llama"):
        return (
            f"export.gguf: rope scaling {kind!r} of this {model_type} model is not converted "
            "(supported: none, and Llama-3's 'llama3')"
        )
    return None


def rope_kind(rope: dict[str, Any]) -> str:
    return str(rope.get("rope_type", rope.get("type", "default")))


def _rope(config: dict[str, Any]) -> dict[str, Any]:
    # transformers 5 writes `rope_parameters` (with rope_theta inside); older configs
    # `rope_theta` at the top and `rope_scaling` for the scaling.
    return dict(config.get("rope_parameters") or config.get("rope_scaling") or {})


def hparams(config: dict[str, Any]) -> HParams:
    if (problem := family_problem(config)) is not None:
        raise GGUFUnsupported(problem)
    n_head = int(config["num_attention_heads"])
    rope = _rope(config)
    return HParams(
        family=config["model_type"],
        n_layer=int(config["num_hidden_layers"]),
        n_embd=int(config["hidden_size"]),
        n_ff=int(config["intermediate_size"]),
        n_head=n_head,
        n_head_kv=int(config.get("num_key_value_heads") or n_head),
        head_dim=int(config.get("head_dim") or config["hidden_size"] // n_head),
        n_ctx=int(config["max_position_embeddings"]),
        rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
        rms_eps=float(config["rms_norm_eps"]),
        n_vocab=int(config["vocab_size"]),
        tied=bool(config.get("tie_word_embeddings", False)),
        rope=rope,
    )


def pre_tokenizer_name(tokenizer_json: dict[str, Any]) -> str:
    """llama.cpp's name (`tokenizer.ggml.pre`) for this tokenizer's pre-tokenizer. posttrain's
    own tokenizer (ByteLevel with its GPT-2 regex) is exactly llama.cpp's 'gpt-2'."""
    model = tokenizer_json.get("model") or {}
    decoder = tokenizer_json.get("decoder") or {}
    if (
        model.get("type") != "BPE"
        or model.get("byte_fallback")
        or decoder.get("type") != "ByteLevel"
    ):
        raise GGUFUnsupported(
            "export.gguf: the tokenizer is not a byte-level BPE (SentencePiece/byte-fallback "
            f"tokenizers are not converted; {SUPPORTED})"
        )
    pre = tokenizer_json.get("pre_tokenizer") or {}
    gpt2 = pre.get("use_regex", True) and not pre.get("add_prefix_space", False)
    if pre.get("type") == "ByteLevel" and gpt2:
        return "gpt-2"
    if pre.get("type") == "Sequence":
        parts = pre.get("pretokenizers", [])
        regexes = [(p.get("pattern") or {}).get("Regex") for p in parts if p.get("type") == "Split"]
        tail = parts[-1] if parts else {}
        if len(parts) == 2 and tail.get("type") == "ByteLevel" and not tail.get("use_regex"):
            if regexes == [LLAMA3_SPLIT]:
                return "llama-bpe"
            if regexes == [QWEN2_SPLIT]:
                return "qwen2"
    raise GGUFUnsupported(
        "export.gguf: the tokenizer's pre-tokenizer is none llama.cpp reproduces (known: GPT-2, "
        f"Llama-3, Qwen2 splitting): {json.dumps(pre)[:200]}"
    )


def check_convertible(model_dir: str | Path, tokenizer_dir: str | Path | None = None) -> HParams:
    """Raise GGUFUnsupported (one line naming export.gguf) unless the model in `model_dir`, with
    the tokenizer in `tokenizer_dir` (default the same folder), converts."""
    hp = hparams(json.loads((Path(model_dir) / "config.json").read_text()))
    tok_file = Path(tokenizer_dir or model_dir) / "tokenizer.json"
    if not tok_file.is_file():
        raise GGUFUnsupported(f"export.gguf: no tokenizer.json in {tok_file.parent} ({SUPPORTED})")
    pre_tokenizer_name(json.loads(tok_file.read_text()))
    return hp


def tensor_type(shape: tuple[int, ...], wanted: gguf.GGMLQuantizationType) -> Any:
    """1-D tensors stay F32; a row length that is not a whole number of quant blocks falls back
    to F16 (as llama.cpp's converter does)."""
    if len(shape) < 2:
        return Q.F32
    block, _ = gguf.GGML_QUANT_SIZES[wanted]
    return wanted if shape[-1] % block == 0 else Q.F16


def plan_tensors(model_dir: str | Path, hp: HParams, wanted: Any) -> list[PlannedTensor]:
    """Every tensor of the GGUF, in write order, from the safetensors headers only."""
    # Imported here: recipe loading imports this module (check_convertible) and needs no
    # transformers for that.
    from posttrain.models.sharded_load import CheckpointFiles

    model_dir = Path(model_dir)
    files = CheckpointFiles.of(model_dir).where
    names = gguf.get_tensor_name_map(hp.arch, hp.n_layer)
    plan: list[PlannedTensor] = []
    for hf_name in sorted(files, key=_block_order):
        if hf_name.endswith(SKIPPED_SUFFIXES):
            continue
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise GGUFUnsupported(
                f"export.gguf: tensor {hf_name!r} has no GGUF name for {hp.family} ({SUPPORTED})"
            )
        with safe_open(str(files[hf_name]), framework="pt") as st:
            shape = tuple(st.get_slice(hf_name).get_shape())
        heads = 0
        if hp.family == "llama" and ".self_attn.q_proj." in hf_name:
            heads = hp.n_head
        elif hp.family == "llama" and ".self_attn.k_proj." in hf_name:
            heads = hp.n_head_kv
        plan.append(
            PlannedTensor(
                gguf_name, shape, tensor_type(shape, wanted), hf_name, files[hf_name], heads
            )
        )
    got = {t.gguf_name for t in plan}
    if "output.weight" not in got and not hp.tied:
        raise GGUFUnsupported(
            f"export.gguf: {model_dir} has no lm_head.weight and tie_word_embeddings is false"
        )
    # Tied embeddings: no output.weight; llama.cpp's Llama and Qwen2 loaders then use
    # token_embd.weight as the output projection.
    if rope_kind(hp.rope) == "llama3":
        plan.insert(0, PlannedTensor("rope_freqs.weight", (hp.head_dim // 2,), Q.F32, None, None))
    return plan


def _block_order(name: str) -> tuple[int, str]:
    """Embeddings first, then blocks in numeric order (block 10 after block 9), then the rest."""
    parts = name.split(".")
    if "layers" in parts:
        i = parts.index("layers")
        return (1 + int(parts[i + 1]), name)
    return (0 if "embed" in name else 1_000_000, name)


def hf_to_ggml_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """[n_head * head_dim, ...] rows from HF's rotate_half order (per head: all first halves of
    the rotation pairs, then all second halves) to GGML's interleaved order (pair members
    adjacent). The same permutation applied to q and k leaves every q.k score unchanged, so the
    model computes the same attention under llama.cpp's LLAMA rope."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def ggml_to_hf_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of hf_to_ggml_rope_rows."""
    return (
        w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def llama3_rope_factors(hp: HParams) -> np.ndarray:
    """[head_dim / 2] per-frequency divisors of Llama-3.1's rope scaling (llama.cpp reads them
    from rope_freqs.weight), as transformers' `_compute_llama3_parameters` applies them."""
    r = hp.rope
    factor = float(r.get("factor", 8.0))
    low, high = float(r.get("low_freq_factor", 1.0)), float(r.get("high_freq_factor", 4.0))
    old_ctx = float(r.get("original_max_position_embeddings", 8192))
    freqs = 1.0 / hp.rope_theta ** (np.arange(0, hp.head_dim, 2, dtype=np.float64) / hp.head_dim)
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_ctx / high:
            out.append(1.0)
        elif wavelen > old_ctx / low:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def load_hf(t: PlannedTensor, hp: HParams) -> np.ndarray:
    """The tensor in fp32, in GGML's row order (q/k permuted for Llama)."""
    if t.hf_name is None:
        return llama3_rope_factors(hp)
    with safe_open(str(t.file), framework="pt") as st:
        w = st.get_tensor(t.hf_name).to(torch.float32).numpy()
    return hf_to_ggml_rope_rows(w, t.permute_heads) if t.permute_heads else w


def tokenizer_metadata(model_dir: Path, n_vocab: int) -> dict[str, Any]:
    """tokenizer.ggml.* keys: the vocabulary padded to the embedding rows (padding tokens are
    UNUSED), token types (special added tokens CONTROL), merges, special ids, chat template."""
    spec = json.loads((model_dir / "tokenizer.json").read_text())
    by_id: dict[int, str] = {i: t for t, i in spec["model"]["vocab"].items()}
    types: dict[int, int] = {}
    for added in spec.get("added_tokens", []):
        by_id[added["id"]] = added["content"]
        types[added["id"]] = (
            gguf.TokenType.CONTROL if added.get("special") else gguf.TokenType.USER_DEFINED
        )
    if max(by_id) >= n_vocab:
        raise GGUFUnsupported(
            f"export.gguf: tokenizer id {max(by_id)} is beyond the model's {n_vocab} embedding rows"
        )
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(n_vocab)]
    token_types = [
        int(types.get(i, gguf.TokenType.NORMAL if i in by_id else gguf.TokenType.UNUSED))
        for i in range(n_vocab)
    ]
    special = gguf.SpecialVocab(model_dir, load_merges=True, n_vocab=n_vocab)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    meta: dict[str, Any] = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre_tokenizer_name(spec),
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": token_types,
        "tokenizer.ggml.merges": special.merges,
        # BOS only where the HF tokenizer adds one itself (Llama-3); ours and Qwen2's add none.
        "tokenizer.ggml.add_bos_token": bool(
            special.add_special_token.get("bos", config.get("add_bos_token", False))
        ),
    }
    for kind, tid in special.special_token_ids.items():
        if kind in ("bos", "eos", "pad", "unk"):
            meta[f"tokenizer.ggml.{kind}_token_id"] = int(tid)
    if special.chat_template:
        meta["tokenizer.chat_template"] = special.chat_template
    return meta


def model_metadata(hp: HParams, name: str, gguf_type: str) -> dict[str, Any]:
    arch = gguf.MODEL_ARCH_NAMES[hp.arch]
    meta: dict[str, Any] = {
        "general.architecture": arch,
        "general.name": name,
        "general.file_type": int(GGUF_TYPES[gguf_type][1]),
        "general.quantization_version": gguf.GGML_QUANT_VERSION,
        f"{arch}.vocab_size": hp.n_vocab,
        f"{arch}.context_length": hp.n_ctx,
        f"{arch}.embedding_length": hp.n_embd,
        f"{arch}.block_count": hp.n_layer,
        f"{arch}.feed_forward_length": hp.n_ff,
        f"{arch}.attention.head_count": hp.n_head,
        f"{arch}.attention.head_count_kv": hp.n_head_kv,
        f"{arch}.attention.layer_norm_rms_epsilon": hp.rms_eps,
        f"{arch}.rope.freq_base": hp.rope_theta,
        f"{arch}.rope.dimension_count": hp.head_dim,
    }
    if hp.head_dim * hp.n_head != hp.n_embd:  # an explicit head_dim (e.g. some Llama variants)
        meta[f"{arch}.attention.key_length"] = hp.head_dim
        meta[f"{arch}.attention.value_length"] = hp.head_dim
    return meta


def _value_type(key: str, value: Any) -> tuple[Any, Any]:
    """GGUF value type (and array sub-type) of a metadata value."""
    V = gguf.GGUFValueType
    if isinstance(value, bool):
        return V.BOOL, None
    if isinstance(value, str):
        return V.STRING, None
    if isinstance(value, float):
        return V.FLOAT32, None
    if isinstance(value, int):
        return V.UINT32, None
    if isinstance(value, list):
        sub = V.INT32 if key.endswith("token_type") else V.STRING
        return V.ARRAY, sub
    raise TypeError(f"{key}: unsupported metadata value {type(value)}")


@dataclass(frozen=True)
class GGUFPlan:
    """Everything one file will hold, known before a byte is written."""

    hp: HParams
    tensors: list[PlannedTensor]
    metadata: dict[str, Any]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def plan_gguf(model_dir: str | Path, gguf_type: str, name: str) -> GGUFPlan:
    model_dir = Path(model_dir)
    hp = check_convertible(model_dir)
    tensors = plan_tensors(model_dir, hp, GGUF_TYPES[gguf_type][0])
    meta = model_metadata(hp, name, gguf_type) | tokenizer_metadata(model_dir, hp.n_vocab)
    meta = {k: v for k, v in meta.items() if v not in ([], "")}  # GGUF has no empty arrays
    return GGUFPlan(hp, tensors, meta)


def write_gguf(plan: GGUFPlan, out_path: str | Path) -> Path:
    """Write `plan` to out_path, one tensor in memory at a time. The file appears under its name
    only when complete (written as `<name>.partial`, then renamed)."""
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    partial = out_path.with_name(out_path.name + ".partial")
    writer = gguf.GGUFWriter(partial, gguf.MODEL_ARCH_NAMES[plan.hp.arch])
    try:
        for key, value in plan.metadata.items():
            if key == "general.architecture":
                continue  # the writer adds it
            vtype, sub = _value_type(key, value)
            writer.add_key_value(key, value, vtype, sub_type=sub)
        for t in plan.tensors:
            writer.add_tensor_info(t.gguf_name, t.shape, np.dtype(np.float32), t.nbytes, t.gtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for t in plan.tensors:  # fp32 -> the bytes (or f32/f16 array) of its type
            w = np.ascontiguousarray(load_hf(t, plan.hp), dtype=np.float32)
            writer.write_tensor_data(gguf.quants.quantize(w, t.gtype))
    except BaseException:
        writer.close()
        partial.unlink(missing_ok=True)
        raise
    writer.close()
    partial.replace(out_path)
    return out_path
