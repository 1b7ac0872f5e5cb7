"""ingest: admit a base checkpoint into the pipeline, or build one from a config.

`path` mode checks a local Hugging Face folder before anything trains on it: safetensors only
(pickle refused unless allowed), no custom code unless allowed, readable weight headers, a
tokenizer that fits the embedding, a chat template in which a strategy locates the assistant turns
(installed from the recipe when missing; see posttrain.data.chat), and it
hashes every file. The weights are not copied: the artifact records where they are and their
hashes; the tokenizer (with the template that will be used everywhere downstream) is saved into
the artifact. `path` may also be a hub id (`org/name` at `revision`): its snapshot folder in the
huggingface_hub cache goes through the same checks, and the summary records the repo, the
revision and the commit it resolved to (`posttrain.hub`).

`from_config` mode trains a byte-level BPE on the synthetic corpus, builds a random-init model
and optionally warms it up with a short causal-LM run, so LoRA has a base worth adapting.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any

import torch

from posttrain import hub
from posttrain.agents.tool_calls import format_of_template
from posttrain.config.inputs_check import model_folder_problem
from posttrain.data.calculator import calculator_corpus
from posttrain.data.chat import (
    SAMPLE_CHAT,
    TemplateError,
    assistant_char_spans,
    read_template,
    render,
    template_info,
    template_markers,
    template_sha256,
)
from posttrain.data.code_tasks import code_corpus, code_sft_rows
from posttrain.data.synthetic import pretrain_corpus, quickstart_sft_rows
from posttrain.kinds.ingest import FromConfigModel, IngestConfig
from posttrain.models.stop_tokens import end_of_turn_token
from posttrain.runtime.context import StageContext
from posttrain.stages.common import stage_main
from posttrain.store.artifacts import sha256_file

log = logging.getLogger("posttrain.ingest")

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


class IngestError(ValueError):
    pass


# Bits per element of every dtype the safetensors format defines (sub-byte float formats too).
SAFETENSORS_DTYPE_BITS = {
    **dict.fromkeys(("BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "E8M0"), 8),
    **dict.fromkeys(("I16", "U16", "F16", "BF16"), 16),
    **dict.fromkeys(("I32", "U32", "F32"), 32),
    **dict.fromkeys(("C64", "I64", "U64", "F64"), 64),
    **dict.fromkeys(("F6_E2M3", "F6_E3M2"), 6),
    "F4": 4,
}
# The format's own limit; a larger length is a corrupted header, not a big model.
SAFETENSORS_MAX_HEADER = 100_000_000


def check_safetensors_header(path: Path) -> dict[str, Any]:
    """Validate a safetensors file's layout from its header alone (no tensor is read):
    the 8-byte little-endian header length fits in the file, the header is a JSON object, and
    every tensor's data_offsets lie inside the data section, do not overlap, cover it without
    gaps and span exactly dtype x shape bytes. Returns the header; raises IngestError naming the
    file and what is wrong (a truncated download, a corrupted or hand-edited file)."""

    def bad(problem: str) -> IngestError:
        return IngestError(f"{path}: unreadable safetensors file ({problem})")

    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise bad(f"{size} bytes, shorter than the 8-byte header length")
        n = int.from_bytes(prefix, "little")
        if n > min(size - 8, SAFETENSORS_MAX_HEADER):
            raise bad(
                f"header length {n} exceeds the {size - 8} bytes after it: the file is truncated "
                "or its first 8 bytes are corrupted"
            )
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise bad(f"header is not valid JSON: {exc}") from None
    if not isinstance(header, dict):
        raise bad(f"header is a JSON {type(header).__name__}, not an object")
    data_len = size - 8 - n
    spans: list[tuple[int, int, str]] = []
    for name, info in header.items():
        if name == "__metadata__":
            if not isinstance(info, dict):
                raise bad("__metadata__ is not an object")
            continue
        if not isinstance(info, dict):
            raise bad(f"tensor {name!r}: entry is not an object")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dtype not in SAFETENSORS_DTYPE_BITS:
            raise bad(f"tensor {name!r}: unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise bad(f"tensor {name!r}: shape {shape!r} is not a list of non-negative integers")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        ):
            raise bad(f"tensor {name!r}: data_offsets {offsets!r} is not [begin, end]")
        begin, end = offsets
        if not 0 <= begin <= end:
            raise bad(f"tensor {name!r}: data_offsets [{begin}, {end}] are not 0 <= begin <= end")
        if end > data_len:
            raise bad(
                f"tensor {name!r}: data_offsets [{begin}, {end}] end beyond the {data_len}-byte "
                f"data section: the file is truncated (it needs at least {8 + n + end} bytes, "
                f"has {size})"
            )
        bits = math.prod(shape) * SAFETENSORS_DTYPE_BITS[dtype]
        if bits % 8 or end - begin != bits // 8:
            raise bad(
                f"tensor {name!r}: {dtype} {shape} needs {bits / 8:g} bytes but data_offsets "
                f"[{begin}, {end}] span {end - begin}"
            )
        spans.append((begin, end, name))
    covered = 0
    prev = ""
    for begin, end, name in sorted(spans):
        if begin < covered:
            raise bad(f"tensors {prev!r} and {name!r} overlap (byte {begin} < {covered})")
        if begin > covered:
            raise bad(f"bytes {covered}..{begin} of the data section belong to no tensor")
        covered, prev = end, name
    if covered != data_len:
        raise bad(f"bytes {covered}..{data_len} of the data section belong to no tensor")
    return header


def check_weights(folder: Path, allow_pickle: bool) -> tuple[list[Path], int, str]:
    """Weight files, parameter count and dtype(s) read from safetensors headers (no tensors
    loaded). Refuses pickle weights unless allowed; names the file whose header is unreadable
    or whose layout is inconsistent (`check_safetensors_header`)."""
    from safetensors import safe_open

    pickles = sorted(p for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
    safes = sorted(folder.glob("*.safetensors"))
    if pickles and not allow_pickle:
        raise IngestError(
            f"{folder}: pickle weight files {[p.name for p in pickles]} refused: loading pickle "
            "can run arbitrary code. Convert them to safetensors, or set ingest.allow_pickle: true"
        )
    if not safes:
        raise IngestError(f"{folder}: no *.safetensors weight files found")
    n_params, dtypes = 0, set()
    for f in safes:
        # The header's own arithmetic first: it names what is wrong (truncated, overlapping,
        # wrong span) where the library only says it cannot deserialize.
        check_safetensors_header(f)
        try:
            with safe_open(str(f), framework="pt") as st:
                for key in st.keys():  # noqa: SIM118 (safe_open is not a dict)
                    sl = st.get_slice(key)
                    n_params += math.prod(sl.get_shape())
                    dtypes.add(str(sl.get_dtype()))
        except Exception as exc:  # a truncated or corrupted file fails here
            raise IngestError(f"{f}: unreadable safetensors file ({exc})") from exc
    return safes, n_params, ",".join(sorted(dtypes))


def install_template(tokenizer: Any, cfg: IngestConfig) -> dict[str, Any]:
    """Use the recipe's template (a Jinja string or a .jinja file) if given, else the
    tokenizer's own; check that one strategy locates the assistant turns of a sample
    conversation (without its system turn when the template refuses a system role). Returns the
    facts for the summary; raises IngestError saying why no strategy serves the template."""
    source = None
    if cfg.chat_template:
        try:
            tokenizer.chat_template, source = read_template(
                cfg.chat_template, "ingest.chat_template"
            )
        except TemplateError as exc:
            raise IngestError(str(exc)) from None
    if not tokenizer.chat_template:
        raise IngestError("the tokenizer has no chat template; set ingest.chat_template")
    try:
        info = template_info(tokenizer)
        sample = SAMPLE_CHAT if info.system_role else SAMPLE_CHAT[1:]
        assistant_char_spans(tokenizer, sample)
        split = template_markers(tokenizer, sample)
        # Mistral v0.3 writes the system message into the last user turn only when the
        # conversation ends with one: a training conversation (ending with a reply) loses it.
        drops_system = info.system_role and SAMPLE_CHAT[0]["content"] not in render(
            tokenizer, sample, add_generation_prompt=False
        )
    except TemplateError as exc:
        raise IngestError(str(exc)) from exc
    except Exception as exc:
        raise IngestError(
            f"the chat template does not render a sample conversation: {exc}"
        ) from exc
    log.info(
        "chat template: strategy %s (assistant spans), system role %s, end of turn %r%s",
        info.strategy,
        "accepted" if info.system_role else "refused (rows with a system turn are errors)",
        info.end_of_turn,
        f", from {source}" if source else "",
    )
    if not info.end_of_turn:
        log.warning(
            "the chat template writes nothing after an assistant turn: the model cannot learn "
            "to end its turn"
        )
    elif (
        tokenizer.eos_token
        and not info.end_of_turn.startswith(tokenizer.eos_token)
        and end_of_turn_token(tokenizer) is None
    ):
        # A single-token marker is a stop token of every sampler (posttrain.models.stop_tokens);
        # one of several tokens is not, so only the EOS and generation_config ids end a turn.
        log.warning(
            "the chat template ends assistant turns with %r, not with the tokenizer's EOS %r, "
            "and that marker is not one token: generation stops at the EOS (and the model's "
            "generation_config eos ids) only, so it may run past the end of a turn",
            info.end_of_turn,
            tokenizer.eos_token,
        )
    if drops_system:
        log.warning(
            "the chat template drops the system message from a conversation that ends with an "
            "assistant turn: training text has no system prompt, generation prompts have it"
        )
    if split:
        log.warning(
            "chat template markers %s are not single tokens in this tokenizer: each costs "
            "several tokens per turn (add them as special tokens, and resize the embeddings)",
            split,
        )
    return {
        "chat_template_strategy": info.strategy,
        # The tool-call format its calls are rendered and parsed in; None: no tool support.
        "chat_template_tools": format_of_template(tokenizer.chat_template),
        "chat_template_system_role": info.system_role,
        "chat_template_end_of_turn": info.end_of_turn,
        "chat_template_file": source,
        "chat_template_split_markers": split,
        "chat_template_drops_system": drops_system,
    }


def check_vocab(tokenizer: Any, config: Any) -> None:
    """A token id at or past the embedding rows fails deep inside the first forward pass
    (IndexError); refuse such a pair here, naming both sizes."""
    rows = getattr(config.get_text_config(), "vocab_size", None)
    if rows is not None and len(tokenizer) > rows:
        raise IngestError(
            f"the tokenizer has {len(tokenizer)} tokens but the model's embedding has {rows} "
            "rows (config vocab_size): ids past the last row cannot be embedded; resize the "
            "model's embeddings (model.resize_token_embeddings) or use the matching tokenizer"
        )


# What a model needs from a hub snapshot: pickle weights are fetched only when allowed (a
# repo often holds both formats), so their mere presence does not refuse the model.
HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt", "*.tiktoken", "*.py"]


def hub_model_folder(cfg: IngestConfig) -> tuple[Path, dict[str, str]]:
    """(snapshot folder, hub record) of a hub id: resolved through the huggingface_hub cache
    (downloaded first unless HF_HUB_OFFLINE=1). Raises IngestError saying what was looked
    up, where, and whether offline mode was on."""
    assert cfg.path
    patterns = HUB_PATTERNS + (list(f"*{x}" for x in PICKLE_SUFFIXES) if cfg.allow_pickle else [])
    try:
        snap = hub.snapshot(cfg.path, cfg.revision, "model", allow_patterns=patterns)
    except hub.HubError as exc:
        raise IngestError(f"ingest.path: {exc}") from None
    log.info(
        "hub model %s@%s = commit %s (%s)", cfg.path, cfg.revision, snap.commit_sha, snap.folder
    )
    return snap.folder, snap.record()


def ingest_path(ctx: StageContext, cfg: IngestConfig) -> dict[str, Any]:
    """Check a local model folder (or a hub id's snapshot folder) and record it."""
    from transformers import AutoConfig

    from posttrain.models.loading import load_tokenizer

    record: dict[str, str] = {}
    if hub.is_hub_id(cfg.path):
        src, record = hub_model_folder(cfg)
    else:
        src = Path(cfg.path or "")
        if problem := model_folder_problem(str(src)):
            raise IngestError(f"ingest.path: {problem}")
    if not (src / "config.json").is_file():  # a hub snapshot without one
        raise IngestError(f"{src}: not a Hugging Face model folder (no config.json)")
    config_json = json.loads((src / "config.json").read_text())
    if config_json.get("auto_map") and not cfg.trust_remote_code:
        raise IngestError(
            f"{src}: config.json needs custom code (auto_map); refused unless "
            "ingest.trust_remote_code: true"
        )
    _, n_params, dtype = check_weights(src, cfg.allow_pickle)
    config = AutoConfig.from_pretrained(str(src), trust_remote_code=cfg.trust_remote_code)
    tok = load_tokenizer(src)
    check_vocab(tok, config)
    template = install_template(tok, cfg)
    tok.save_pretrained(str(ctx.stage.out_dir / "tokenizer"))
    files = {str(p.relative_to(src)): sha256_file(p) for p in sorted(src.rglob("*")) if p.is_file()}
    return {
        "model_dir": str(src),
        "architecture": (config.architectures or [config.model_type])[0],
        "model_type": config.model_type,
        "num_params": n_params,
        "dtype": dtype,
        "vocab_size": len(tok),
        "source_files": files,
        "trust_remote_code": cfg.trust_remote_code,
        **record,
        **template,
    }


def warm_up(
    model: torch.nn.Module,
    tok: Any,
    cfg: FromConfigModel,
    docs: list[str],
    seed: int,
) -> dict[str, float]:
    """Short full-parameter causal-LM training on plain text (documents joined by EOS)."""
    ids: list[int] = []
    for d in docs:
        ids += tok(d, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    seqs = torch.tensor(ids[: len(ids) // cfg.pretrain_seq_len * cfg.pretrain_seq_len])
    seqs = seqs.view(-1, cfg.pretrain_seq_len)  # [N, S]
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.pretrain_lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * s / cfg.pretrain_steps)),
    )
    model.train()
    losses = []
    t0 = time.perf_counter()
    for step in range(cfg.pretrain_steps):
        batch = seqs[torch.randint(len(seqs), (cfg.pretrain_batch_size,), generator=g)]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step % 25 == 0 or step == cfg.pretrain_steps - 1:
            log.info("warm-up step %d/%d loss %.4f", step + 1, cfg.pretrain_steps, losses[-1])
    model.eval()
    return {
        "warmup_first_loss": losses[0],
        "warmup_final_loss": sum(losses[-10:]) / len(losses[-10:]),
        "warmup_seconds": time.perf_counter() - t0,
    }


def from_config_tokenizer(fc: Any, seed: int) -> tuple[Any, list[str]]:
    """(the BPE a from_config base trains, the pre-training documents of its corpus). It
    depends on `TOKENIZER_FIELDS` of `fc` and `seed` only (not on the model's shape): the
    plan's vocabulary check for distillation relies on that."""
    from posttrain.models.tiny import fill_vocabulary, train_tokenizer

    if fc.corpus_task == "code":
        docs = code_corpus(fc.corpus_examples, seed)
        rows = code_sft_rows(fc.corpus_examples // 2, seed + 1)
    else:
        docs = pretrain_corpus(fc.corpus_examples, seed)
        rows = quickstart_sft_rows(fc.corpus_examples // 2, seed + 1)
    if fc.template == "chatml_tools":  # merges for the call JSON, and a warm-up on it
        docs += calculator_corpus(fc.corpus_examples // 2, seed + 2)
    chats = [r["messages"] for r in rows]
    corpus = docs + [m["content"] for c in chats for m in c]
    tok = train_tokenizer(corpus, fc.vocab_size)
    if fc.fill_vocab:
        tok = fill_vocabulary(tok, fc.vocab_size)
    return tok, docs


def ingest_from_config(ctx: StageContext, cfg: IngestConfig) -> dict[str, Any]:
    from posttrain.models.chatml import TEMPLATES
    from posttrain.models.tiny import build_model

    fc = cfg.from_config
    seed = ctx.recipe.run.seed
    tok, docs = from_config_tokenizer(fc, seed)
    tok.chat_template = TEMPLATES[fc.template]  # ingest.chat_template, if set, replaces it
    template = install_template(tok, cfg)
    torch.manual_seed(seed)
    model = build_model(fc, tok)
    summary: dict[str, Any] = {}
    if fc.pretrain_steps:
        summary.update(warm_up(model, tok, fc, docs, seed))
    model_dir = ctx.stage.out_dir / "model"
    model.save_pretrained(str(model_dir), safe_serialization=True)
    # model/ gets the tokenizer too: it is a complete checkpoint that another pipeline can
    # ingest by path (what `posttrain.base.published` announces).
    tok.save_pretrained(str(model_dir))
    tok.save_pretrained(str(ctx.stage.out_dir / "tokenizer"))
    return {
        "model_dir": str(model_dir),
        "architecture": type(model).__name__,
        "model_type": model.config.model_type,
        "num_params": sum(p.numel() for p in model.parameters()),
        "dtype": "float32",
        "vocab_size": len(tok),
        "trust_remote_code": False,
        **template,
        **summary,
    }


def run(ctx: StageContext) -> dict[str, Any]:
    cfg = ctx.section  # `ingest:`, or the `stages:` entry of an extra base
    info = ingest_path(ctx, cfg) if cfg.source == "path" else ingest_from_config(ctx, cfg)
    from posttrain.models.loading import load_tokenizer

    # The saved tokenizer is the template of record for every later stage: reload it to check it
    # round-trips, and record the template it carries.
    saved = load_tokenizer(ctx.stage.out_dir / "tokenizer")
    info["chat_template_sha256"] = template_sha256(saved)
    ctx.extra_manifest["chat_template"] = saved.chat_template
    ctx.extra_manifest["chat_template_file"] = info["chat_template_file"]
    headline = {"params": info["num_params"], "architecture": info["architecture"]}
    if "warmup_final_loss" in info:
        headline["warmup_loss"] = round(info["warmup_final_loss"], 4)
    info["headline"] = headline
    log.info(
        "ingested %s (%s params, %s)",
        info["architecture"],
        f"{info['num_params']:,}",
        info["dtype"],
    )
    return info


if __name__ == "__main__":
    stage_main(run)
