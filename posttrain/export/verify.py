"""Check a merged export before anyone ships it: it reloads, it is not the base, it is base+adapter.

Two failures this catches that other tools have shipped: a "merged" export whose weights are
identical to the base (the adapter was never applied, or was untrained: LoRA B starts at zero),
and an export whose logits drift from what the adapter computed during training (a wrong merge
scale, a dropped module, an adapter/base mismatch).

Tolerance for half-precision exports. The export is reloaded upcast to fp32, so arithmetic is
fp32 on both sides and what is left is the rounding of every merged weight to the export dtype.
How far that rounding moves the logits depends on the model (depth, logit scale), so it is
measured rather than guessed: the base's own weights are rounded to the export dtype and the
base's logits recomputed; the largest change is the rounding floor, and

    atol_effective = atol + ROUNDING_MARGIN * rounding_floor        (ROUNDING_MARGIN = 3)

For fp32 exports the floor is 0 and atol applies as given. On models from 2 to 16 layers the
export's deviation was 0.75-1.45x the floor (bf16 and fp16), while an adapter's own effect on
the logits was about two orders of magnitude above the bf16 floor, so the margin leaves room
without hiding a wrong merge. Everything runs on CPU in fp32: a few sequences suffice.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from peft import PeftModel
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from posttrain.models.sharded_load import CheckpointFiles

ROUNDING_MARGIN = 3.0


class ExportVerificationError(RuntimeError):
    """The export is unusable: identical to the base, or not equal to base + adapter."""


def _round_weights_(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Round every floating parameter to `dtype` in place, keeping fp32 storage."""
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                p.copy_(p.to(dtype))


def weight_diff_vs_base(export_dir: Path, base_dir: Path) -> dict[str, Any]:
    """Largest |export - base| over shared floating tensors, one pair in memory at a time; the
    base tensor rounded to the export's dtype first (the rounding alone is not a change)."""
    exp_index = CheckpointFiles.of(export_dir).where
    base_index = CheckpointFiles.of(base_dir).where
    shared = sorted(set(exp_index) & set(base_index))
    if not shared:
        raise ExportVerificationError(
            f"export {export_dir} and base {base_dir} share no tensor names; cannot compare"
        )
    max_diff, export_dtypes = 0.0, set()
    for name in shared:
        with safe_open(str(exp_index[name]), framework="pt") as st:
            e = st.get_tensor(name)
        with safe_open(str(base_index[name]), framework="pt") as st:
            b = st.get_tensor(name)
        if not e.is_floating_point():
            continue
        export_dtypes.add(e.dtype)
        if e.shape != b.shape:
            raise ExportVerificationError(
                f"tensor {name}: export shape {list(e.shape)} != base shape {list(b.shape)}"
            )
        diff = (e.float() - b.to(e.dtype).float()).abs().max().item()
        max_diff = max(max_diff, diff)
    # The lowest-precision dtype present decides the tolerance.
    lowest = (
        max(export_dtypes, key=lambda d: torch.finfo(d).eps) if export_dtypes else torch.float32
    )
    return {
        "max_abs_weight_diff_vs_base": max_diff,
        "export_dtype": lowest,
        "weights_compared": len(shared),
        "tensors_missing_from_export": sorted(set(base_index) - set(exp_index)),
    }


def _logits(model: Any, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=input_ids, use_cache=False).logits.float()  # [B, T, V]


def verify_export(
    export_dir: str | Path,
    base_dir: str | Path,
    adapter_dir: str | Path,
    input_ids: torch.Tensor,
    atol: float,
    trust_remote_code: bool = False,
) -> dict[str, Any]:
    """Compare on input_ids [B, T] (a) the export reloaded without peft, upcast to fp32, (b)
    the fp32 base with the adapter unmerged, (c) the base; loaded one after the other, so the
    peak is one model. Raises ExportVerificationError when the export's weights equal the
    base's, or max |logits(a) - logits(b)| exceeds the (dtype-scaled) tolerance.
    """
    export_dir, base_dir = Path(export_dir), Path(base_dir)
    report: dict[str, Any] = weight_diff_vs_base(export_dir, base_dir)

    exported = AutoModelForCausalLM.from_pretrained(
        str(export_dir), dtype=torch.float32, trust_remote_code=trust_remote_code
    ).eval()
    logits_export = _logits(exported, input_ids)
    del exported

    export_dtype = report.pop("export_dtype")
    base = AutoModelForCausalLM.from_pretrained(
        str(base_dir), dtype=torch.float32, trust_remote_code=trust_remote_code
    )
    with_adapter = PeftModel.from_pretrained(base, str(adapter_dir), is_trainable=False).eval()
    logits_ref = _logits(with_adapter, input_ids)
    with with_adapter.disable_adapter():
        logits_base = _logits(with_adapter, input_ids)
        rounding_floor = 0.0
        if torch.finfo(export_dtype).eps > torch.finfo(torch.float32).eps:
            _round_weights_(base, export_dtype)  # the fp32 base is not needed after this
            rounding_floor = (_logits(with_adapter, input_ids) - logits_base).abs().max().item()
    del with_adapter, base

    report |= {
        "export_dtype": str(export_dtype).removeprefix("torch."),
        "max_abs_logit_diff": (logits_export - logits_ref).abs().max().item(),
        "logits_differ_from_base": (logits_export - logits_base).abs().max().item(),
        # How much the adapter itself changes the logits: 0 means an untrained/empty adapter.
        "adapter_logit_effect": (logits_ref - logits_base).abs().max().item(),
        "rounding_floor": rounding_floor,
        "atol": atol,
        "atol_effective": atol + ROUNDING_MARGIN * rounding_floor,  # see the module docstring
    }
    _refuse_if_wrong(report, export_dir, base_dir)
    report["passed"] = True
    return report


def _refuse_if_wrong(report: dict[str, Any], export_dir: Path, base_dir: Path) -> None:
    """Raise ExportVerificationError when `verify_export`'s figures say the export is wrong."""
    if report["max_abs_weight_diff_vs_base"] == 0.0:
        why = (
            "the adapter itself changes nothing (all-zero LoRA B: was it ever trained?)"
            if report["adapter_logit_effect"] == 0.0
            else "the adapter does change the logits, so the merge did not apply it"
        )
        raise ExportVerificationError(
            f"export {export_dir} has weights identical to the base {base_dir} "
            f"({report['weights_compared']} tensors compared in {report['export_dtype']}): {why}"
        )
    if report["max_abs_logit_diff"] > (tol := report["atol_effective"]):
        raise ExportVerificationError(
            f"export {export_dir} logits differ from base + adapter by "
            f"{report['max_abs_logit_diff']:.3g} > tolerance {tol:.3g} (atol {report['atol']:g} + "
            f"{ROUNDING_MARGIN:g} x {report['export_dtype']} rounding floor "
            f"{report['rounding_floor']:.3g}); the adapter's own effect is "
            f"{report['adapter_logit_effect']:.3g}"
        )
