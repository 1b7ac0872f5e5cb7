"""export: merge the LoRA adapter into the base, save a plain transformers checkpoint, prove it.

Writes model/ (safetensors, tokenizer with the pipeline's chat template, README.md model card with
the whole lineage and file hashes) and verification.json; with `export.gguf`, also
gguf/<run>-<type>.gguf for llama.cpp, each read back and checked (posttrain/export/gguf.py). The
stage fails, and so leaves no manifest, when the export reloads differently from base+adapter,
is identical to the base, or a GGUF does not read back as written.

`run` takes the steps in that order (merge and save, verify, GGUF, model card: the card goes
last because it lists the hashes of every other file in model/), one function each; the pieces
that do not need the stage's context are in `posttrain/export/`.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import torch

from posttrain import jsonsafe
from posttrain.data.chat import encode_chat
from posttrain.data.sft_data import saved_split
from posttrain.export.gguf import check_convertible, plan_gguf, write_gguf
from posttrain.export.gguf_verify import verify_gguf
from posttrain.export.merge import merge_adapter, save_export
from posttrain.export.model_card import model_card
from posttrain.export.verify import verify_export
from posttrain.models.loading import DTYPES, load_tokenizer
from posttrain.runtime.context import StageContext
from posttrain.runtime.diskspace import (
    DiskFull,
    ensure_free,
    free_bytes,
    full_disk_error,
    model_bytes,
    required_bytes,
)
from posttrain.stages.common import stage_main
from posttrain.store.artifacts import sha256_file

log = logging.getLogger("posttrain.export")


def base_dtype(ingest_summary: dict[str, Any]) -> str:
    """The base checkpoint's stored precision as a recipe precision name."""
    stored = str(ingest_summary.get("dtype", "")).lower()
    if "bf16" in stored or "bfloat16" in stored:
        return "bf16"
    if "f16" in stored.replace("bf16", "") or "float16" in stored:
        return "fp16"
    return "fp32"


def _verify_inputs(ctx: StageContext, tok: Any) -> torch.Tensor:
    """[n <= 4, T] token ids from held-out conversations (training rows when none were held out), or
    the shipped policy's own rows when no stage of its lineage trained on conversations: any
    text checks that merged and unmerged weights agree. Cut to a common length (no padding)."""
    conversations = ctx.has_role("heldout")
    folder = ctx.role_dir("heldout" if conversations else "policy")
    rows = (saved_split(folder, "eval") or saved_split(folder, "train"))[:4]
    if conversations:
        seqs = [encode_chat(tok, r["messages"], 512, tools=r.get("tools")) for r in rows]
        ids = [s["input_ids"] for s in seqs if s]
    else:
        ids = [tok(json.dumps(r), add_special_tokens=False)["input_ids"][:256] for r in rows]
    width = min(len(i) for i in ids)
    return torch.tensor([i[:width] for i in ids])


def _save_with_room(merged: Any, tok: Any, out: Any) -> None:
    """save_export after checking the disk has room; a save that fills it anyway removes its
    partial folder. Both raise DiskFull."""
    what = f"the exported model ({out.name}/)"
    expected = model_bytes(merged)
    ensure_free(out.parent, expected, what)
    try:
        save_export(merged, tok, out)
    except OSError as exc:
        if (err := full_disk_error(exc)) is None:
            raise
        shutil.rmtree(out, ignore_errors=True)
        raise DiskFull(
            what,
            out.parent,
            required_bytes(expected),
            free_bytes(out.parent),
            f"; the disk filled while writing it ({err.strerror}): the partial {out.name}/ was "
            "removed",
        ) from exc


def _write_ggufs(ctx: StageContext, model_dir: Path, types: list[str]) -> dict[str, Any]:
    """One verified GGUF per type under `<export>/gguf/`: type -> {file, sha256, bytes, check}."""
    out: dict[str, Any] = {}
    for gguf_type in types:
        plan = plan_gguf(model_dir, gguf_type, ctx.recipe.run.name)
        path = ctx.stage.out_dir / "gguf" / f"{ctx.recipe.run.name}-{gguf_type}.gguf"
        ensure_free(ctx.stage.out_dir, plan.nbytes, f"the {gguf_type} GGUF ({path.name})")
        write_gguf(plan, path)
        check = verify_gguf(path, plan)
        log.info(
            "gguf %s: %d tensors, %s, max |weight error| %s",
            path.name,
            check["tensors"],
            f"{path.stat().st_size / 2**20:.1f} MiB",
            {k: f"{v:.2e}" for k, v in check["max_abs_weight_error"].items()},
        )
        out[gguf_type] = {
            "file": str(path.relative_to(ctx.stage.out_dir)),
            "sha256": sha256_file(path),
            "bytes": path.stat().st_size,
            "verification": check | {"path": path.name},
        }
    return out


def _verify(
    ctx: StageContext, out: Path, base_dir: str, adapter_dir: Path, tok: Any, trust: bool
) -> dict[str, Any]:
    """`verify_export` of the saved model, written to verification.json; raises when wrong."""
    report = verify_export(
        out,
        base_dir,
        adapter_dir,
        _verify_inputs(ctx, tok),
        ctx.recipe.export.logits_atol,
        trust_remote_code=trust,
    )
    (ctx.stage.out_dir / "verification.json").write_text(
        jsonsafe.dumps(report, indent=2, default=str)
    )
    log.info(
        "export verified: max |logit diff| vs base+adapter %.2e (allowed %.2e); "
        "max |weight diff| vs base %.3e",
        report["max_abs_logit_diff"],
        report["atol_effective"],
        report["max_abs_weight_diff_vs_base"],
    )
    return report


def _lineage(ctx: StageContext) -> list[dict[str, Any]]:
    """Every stage the export descends from, with its fingerprint and parents, then export."""
    refs = ctx.parents
    lineage = [
        {"stage": n, "fingerprint": r.fingerprint, "parents": r.parents} for n, r in refs.items()
    ]
    parents = [r.fingerprint for r in refs.values()]
    return [*lineage, {"stage": "export", "fingerprint": ctx.stage.fingerprint, "parents": parents}]


def _card_metrics(ctx: StageContext, report: dict[str, Any]) -> dict[str, Any]:
    """The card's metrics: held-out loss, evaluate's headline, the export's verification."""
    metrics: dict[str, Any] = {}
    if ctx.has_role("heldout"):
        sft = ctx.role_manifest("heldout")["summary"]
        metrics[ctx.stage.roles["heldout"]] = {
            "eval_loss_start": sft["eval_loss_start"],
            "eval_loss_final": sft["eval_loss_final"],
            "steps": sft["total_steps"],
        }
    # `evaluate: null`: the run measured nothing, and the card says so by leaving it out.
    ev = ctx.role_manifest("evaluation")["summary"] if ctx.has_role("evaluation") else {}
    return metrics | {
        "evaluate": ev.get("headline", {}),
        "export_verification": {
            k: report[k]
            for k in ("max_abs_logit_diff", "atol_effective", "max_abs_weight_diff_vs_base")
        },
    }


def _base_info(ctx: StageContext) -> dict[str, Any]:
    """The card's base model (with hub id and commit for a hub base: the card's `base_model`)."""
    ingest = ctx.role_manifest("base")["summary"]
    info = {
        "name": ingest["architecture"],
        "source": ingest["model_dir"],
        "params": ingest["num_params"],
        "fingerprint": ctx.role_ref("base").fingerprint,
    }
    if "hub_repo" in ingest:
        info["hub_id"] = ingest["hub_repo"]
        info["commit_sha"] = ingest["commit_sha"]
    return info


def _recipe_sections(ctx: StageContext) -> dict[str, Any]:
    """The recipe sections of the shipped policy's base, every stage it descends from (base
    first) and export."""
    graph = ctx.recipe.graph()
    lineage_names = list(reversed(graph.lineage(ctx.stage.roles["policy"])))
    base = ctx.stage.roles["base"]
    sections = {base: graph.bases[base].section.model_dump(mode="json")}
    sections |= {n: graph.get(n).section.model_dump(mode="json") for n in lineage_names}
    sections["export"] = ctx.recipe.export.model_dump(mode="json")
    return sections


def _policy_path(ctx: StageContext) -> list[tuple[str, str]]:
    """(stage name, kind) of the base and of every stage the shipped policy descends from."""
    graph = ctx.recipe.graph()
    line = reversed(graph.lineage(ctx.stage.roles["policy"]))
    return [(ctx.stage.roles["base"], "ingest"), *((n, graph.get(n).kind.name) for n in line)]


def _write_model_card(
    ctx: StageContext, out: Path, report: dict[str, Any], ggufs: dict[str, Any]
) -> dict[str, str]:
    """model/README.md, written last in model/: it lists the sha256 of every other file there,
    which this returns (path relative to model/ -> sha256)."""
    files = {str(p.relative_to(out)): sha256_file(p) for p in sorted(out.rglob("*")) if p.is_file()}
    card = model_card(
        ctx.recipe.run.name,
        _base_info(ctx),
        _lineage(ctx),
        files,
        _card_metrics(ctx, report),
        _recipe_sections(ctx),
        _policy_path(ctx),
        ctx.has_role("evaluation"),
        gguf_files={v["file"]: v["sha256"] for v in ggufs.values()},
    )
    (out / "README.md").write_text(card)
    return files


def run(ctx: StageContext) -> dict[str, Any]:
    cfg = ctx.recipe.export
    ingest = ctx.role_manifest("base")["summary"]
    base_dir = ingest["model_dir"]
    # The policy to ship: export.policy, else the graph's final policy (the planner's role).
    policy = ctx.stage.roles["policy"]
    adapter_dir = ctx.role_dir("policy") / "adapter"
    dtype_name = base_dtype(ingest) if cfg.dtype == "auto" else cfg.dtype
    trust = bool(ingest.get("trust_remote_code", False))

    if cfg.gguf:  # refuse an unconvertible family now, before the merge writes anything
        check_convertible(base_dir, ctx.role_dir("base") / "tokenizer")
    tok = load_tokenizer(ctx.role_dir("base") / "tokenizer")
    out = ctx.stage.out_dir / "model"
    # Merged in fp32, cast to the export dtype last; the merged model is freed once saved.
    _save_with_room(merge_adapter(base_dir, adapter_dir, DTYPES[dtype_name], trust), tok, out)
    report = _verify(ctx, out, base_dir, adapter_dir, tok, trust)
    ggufs = _write_ggufs(ctx, out, cfg.gguf) if cfg.gguf else {}
    files = _write_model_card(ctx, out, report, ggufs)
    return {
        "export_dir": str(out),
        "policy": policy,
        "adapter_dir": str(adapter_dir),
        "dtype": dtype_name,
        "verification": report,
        "files": files,
        "gguf": ggufs,
        "headline": {
            "dtype": dtype_name,
            "logit_diff": report["max_abs_logit_diff"],
            "weight_delta": report["max_abs_weight_diff_vs_base"],
        },
    }


if __name__ == "__main__":
    stage_main(run)
