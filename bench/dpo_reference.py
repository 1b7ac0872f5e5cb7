"""DPO reference: online vs precomputed log-probs, and one shared base vs two model copies.

Part 1 (speed), sizes small and medium. Runs the DPO step of posttrain.stages.dpo as a plain
single-process loop (policy_with_reference on an fp32 base, AdamW on the policy adapter, sigmoid
DPO loss, grad clipping, the same micro-batches of 16 encoded quickstart pairs) in two ways:
  online       the reference forward (torch.no_grad + active_adapter(model, "reference")) every
               step, as the stage does without `precompute_reference`;
  precomputed  reference log-probs of every training pair computed once beforehand
               (`reference_logps`, reported separately as a one-off cost), then looked up.
Prints the median step time of each, online/precomputed, the one-off cost and the break-even
step count (one-off cost / per-step saving). The two modes' steps are interleaved one by one
and each mode keeps its best round, because absolute times on shared CPUs are noisy. Their
losses must agree (same weights, batches and reference values), which is checked.

Part 2 (memory), sizes medium and large. Each configuration in its own subprocess, so peaks
don't mix:
  shared    one base + two LoRA adapters (policy "default", frozen SFT "reference"), as the stage
  separate  base + policy adapter, and a second full base + SFT adapter as the reference
Loads the models from disk and runs a few DPO steps with the reference forward, then reports peak
RSS (getrusage ru_maxrss), peak RSS above the post-import level, and the exact parameter bytes held
(unique tensor storages), with the ratios and the analytic expectation (one base vs two bases),
plus the live RSS (anonymous / file-backed) and PSS after the steps.

Everything heavy runs in child processes; the parent never imports torch, because Linux carries
ru_maxrss across fork+exec and a big parent would mask the children's own peaks.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/dpo_reference.py          # default: 16 steps, 2 rounds
    HF_HUB_OFFLINE=1 .venv/bin/python bench/dpo_reference.py --steps 30 --rounds 3
    HF_HUB_OFFLINE=1 .venv/bin/python bench/dpo_reference.py --threads 1   # on a busy machine
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]

SIZES = {
    "small": {"hidden_size": 128, "num_layers": 4, "num_heads": 4, "intermediate_size": 256},
    "medium": {"hidden_size": 256, "num_layers": 6, "num_heads": 8, "intermediate_size": 688},
    # Memory only by default: big enough that the base stands out of the RSS noise.
    "large": {"hidden_size": 512, "num_layers": 8, "num_heads": 8, "intermediate_size": 1376},
}
MICRO = 16  # pairs per micro-batch (= per optimizer step here; no accumulation)
MAX_LEN, MAX_PROMPT_LEN = 256, 128  # the dpo.data defaults
LORA = {"r": 16, "alpha": 32}
BETA, LR, MAX_GRAD_NORM, SEED = 0.1, 5e-4, 1.0, 0
WARMUP = 2  # steps left out of the medians
MEM_STEPS = 3


def _mb(kib: float) -> float:
    return kib / 1024


def proc_kib(key: str, path: str = "/proc/self/status") -> int:
    """A "Key:  N kB" field of /proc/self/status (VmRSS, VmHWM, RssAnon, RssFile) or of
    /proc/self/smaps_rollup (Pss)."""
    for line in Path(path).read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def rss_now_kib() -> int:
    return proc_kib("VmRSS")


def rss_peak_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux


# ---------------------------------------------------------------------------------------------
# Shared setup: base on disk, SFT-like adapter, encoded pairs


def prepare_size(name: str, folder: Path) -> dict:
    """Tokenizer trained on the synthetic corpus, a from-config base saved once, and an SFT-like
    adapter (LoRA with lora_B perturbed so it differs from the base), saved with save_pretrained."""
    import torch

    from posttrain.data.synthetic import pretrain_corpus, quickstart_sft_rows
    from posttrain.kinds.ingest import FromConfigModel
    from posttrain.models.lora import apply_lora
    from posttrain.models.tiny import build_model, train_tokenizer
    from posttrain.sections.shared import LoraConfig

    folder.mkdir(parents=True, exist_ok=True)
    docs = pretrain_corpus(2000, SEED)
    chats = [r["messages"] for r in quickstart_sft_rows(1000, SEED + 1)]
    tok = train_tokenizer(docs + [m["content"] for c in chats for m in c], 2048)
    torch.manual_seed(SEED)
    cfg = FromConfigModel(**SIZES[name], vocab_size=2048, max_position_embeddings=MAX_LEN)
    model = build_model(cfg, tok)
    base_params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(str(folder / "base"), safe_serialization=True)
    tok.save_pretrained(str(folder / "tokenizer"))
    peft_model = apply_lora(model, LoraConfig(**LORA))
    g = torch.Generator().manual_seed(SEED + 7)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.copy_(0.02 * torch.randn(p.shape, generator=g))
    adapter_params = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    peft_model.save_pretrained(str(folder / "sft"))
    return {"base_params": base_params, "adapter_params": adapter_params}


def load_pairs(folder: Path, n_pairs: int) -> tuple[list[dict], int]:
    from posttrain.data.preference import encode_pairs, quickstart_preference_rows
    from posttrain.models.loading import load_tokenizer

    tok = load_tokenizer(folder / "tokenizer")
    pairs, _ = encode_pairs(tok, quickstart_preference_rows(n_pairs, SEED), MAX_LEN, MAX_PROMPT_LEN)
    return pairs, tok.pad_token_id


def step_batches(pairs: list[dict], pad_id: int, steps: int) -> list[tuple[list[int], dict]]:
    """The same (indices, pair_batch) per step for every run, in the stage's data order."""
    from posttrain.data.batching import step_indices
    from posttrain.models.reward import pair_batch

    out = []
    for step in range(steps):
        ix = step_indices(len(pairs), step, micro=MICRO, accum=1, dp_size=1, rank=0, seed=SEED)[0]
        out.append((ix, pair_batch([pairs[i] for i in ix], pad_id)))
    return out


def load_policy_with_reference(folder: Path):
    from posttrain.models.adapters import policy_with_reference
    from posttrain.models.loading import load_causal_lm

    base = load_causal_lm(folder / "base")
    base.config.use_cache = False
    model = policy_with_reference(base, folder / "sft")
    model.train()
    return model


def dpo_step(model, opt, loss_fn, ix, batch, ref_table=None, ref_model=None) -> tuple[float, float]:
    """One DPO optimizer step, as the stage's loop body. Returns (loss, reference seconds)."""
    import torch

    from posttrain.models.adapters import REFERENCE, active_adapter
    from posttrain.train.forward_logps import pair_logps

    t_ref = time.perf_counter()
    if ref_table is not None:
        rc, rr = ref_table[ix, 0].float(), ref_table[ix, 1].float()
    elif ref_model is not None:  # a separate reference model (memory comparison only)
        with torch.no_grad():
            rc, rr, _, _ = pair_logps(ref_model, batch)
    else:
        with torch.no_grad(), active_adapter(model, REFERENCE):
            rc, rr, _, _ = pair_logps(model, batch)
    t_ref = time.perf_counter() - t_ref
    pc, pr, lc, lr_ = pair_logps(model, batch)
    losses, _, _ = loss_fn(pc, pr, rc, rr, lc, lr_)
    loss = losses.mean()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(
        [p for p in model.parameters() if p.requires_grad], MAX_GRAD_NORM
    )
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item(), t_ref


# ---------------------------------------------------------------------------------------------
# Part 1: step time, online vs precomputed reference


MODES = ("online", "precomputed")


def speed_round(folder: Path, pairs: list[dict], pad_id: int, batches: list, flip: int) -> dict:
    """One round: a fresh model per mode (same base, adapters, optimizer, batches), the one-off
    precompute, then the two modes' steps interleaved one by one, so a burst of load from other
    processes hits both sides alike."""
    import torch

    from posttrain.stages.dpo import reference_logps
    from posttrain.train.preference_losses import preference_loss

    loss_fn = preference_loss("sigmoid", beta=BETA, label_smoothing=0.0)
    run = {}
    for m in MODES:
        model = load_policy_with_reference(folder)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
        run[m] = {"model": model, "opt": opt, "times": [], "ref": [], "losses": []}
    t = time.perf_counter()
    table = reference_logps(
        run["precomputed"]["model"], pairs, pad_id, MICRO, torch.device("cpu"), 0, 1
    )
    precompute_s = time.perf_counter() - t
    for k, (ix, batch) in enumerate(batches):
        for m in MODES if (k + flip) % 2 == 0 else MODES[::-1]:
            r = run[m]
            t = time.perf_counter()
            loss, t_ref = dpo_step(
                r["model"], r["opt"], loss_fn, ix, batch, table if m == "precomputed" else None
            )
            r["times"].append(time.perf_counter() - t)
            r["ref"].append(t_ref)
            r["losses"].append(loss)
    out: dict = {"precompute_s": precompute_s}
    for m, r in run.items():
        out[m] = {
            "median_s": statistics.median(r["times"][WARMUP:]),
            "ref_median_s": statistics.median(r["ref"][WARMUP:]),
            "losses": r["losses"],
        }
    return out


def measure_speed(name: str, folder: Path, steps: int, rounds: int, n_pairs: int) -> dict:
    pairs, pad_id = load_pairs(folder, n_pairs)
    batches = step_batches(pairs, pad_id, steps)
    best: dict[str, dict] = {}
    precompute_s = float("inf")  # the one-off cost keeps its own best round
    loss_diff = 0.0
    for r in range(rounds):
        got = speed_round(folder, pairs, pad_id, batches, flip=r)
        on_l, pre_l = got["online"]["losses"], got["precomputed"]["losses"]
        loss_diff = max([loss_diff] + [abs(a - b) for a, b in zip(on_l, pre_l, strict=True)])
        precompute_s = min(precompute_s, got["precompute_s"])
        for m in MODES:
            if m not in best or got[m]["median_s"] < best[m]["median_s"]:
                best[m] = got[m]
    on, pre = best["online"], best["precomputed"]
    saving = on["median_s"] - pre["median_s"]
    steps_per_epoch = len(pairs) / MICRO
    break_even = precompute_s / saving if saving > 0 else float("inf")
    tokens = sum(int(b["attention_mask"].sum()) for _, b in batches) / len(batches)
    return {
        "size": name,
        "pairs": len(pairs),
        "tokens_per_step": tokens,
        "online_step_s": on["median_s"],
        "online_ref_fwd_s": on["ref_median_s"],
        "precomputed_step_s": pre["median_s"],
        "online_over_precomputed": on["median_s"] / pre["median_s"],
        "precompute_s": precompute_s,
        "precompute_per_batch_s": precompute_s / steps_per_epoch,
        "break_even_steps": break_even,
        "break_even_epochs": break_even / steps_per_epoch,
        "first_loss": on["losses"][0],
        "max_loss_diff": loss_diff,
    }


# ---------------------------------------------------------------------------------------------
# Part 2: memory, one shared base vs two copies (each in its own process)


def storage_bytes(*modules) -> int:
    """Bytes of the unique storages behind every parameter and buffer (tied weights once)."""
    seen: dict[int, int] = {}
    for m in modules:
        for t in list(m.parameters()) + list(m.buffers()):
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def mem_child(config: str, folder: Path, n_pairs: int) -> dict:
    """Runs in its own process: load the configuration, a few DPO steps, report memory."""
    import torch
    from peft import PeftModel

    from posttrain.models.loading import load_causal_lm
    from posttrain.train.preference_losses import preference_loss

    pairs, pad_id = load_pairs(folder, n_pairs)
    batches = step_batches(pairs, pad_id, MEM_STEPS)
    loss_fn = preference_loss("sigmoid", beta=BETA, label_smoothing=0.0)
    after_import = {"rss": rss_now_kib(), "peak": rss_peak_kib()}
    ref_model = None
    if config == "shared":
        model = load_policy_with_reference(folder)
        held = storage_bytes(model)
    else:
        base = load_causal_lm(folder / "base")
        base.config.use_cache = False
        model = PeftModel.from_pretrained(base, str(folder / "sft"), is_trainable=True).train()
        ref_base = load_causal_lm(folder / "base")
        ref_base.config.use_cache = False
        ref_model = PeftModel.from_pretrained(ref_base, str(folder / "sft")).eval()
        for p in ref_model.parameters():
            p.requires_grad_(False)
        held = storage_bytes(model, ref_model)
    after_load = {"rss": rss_now_kib(), "peak": rss_peak_kib()}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses = [dpo_step(model, opt, loss_fn, ix, b, ref_model=ref_model)[0] for ix, b in batches]
    # The end snapshot should show what is live, not activation buffers malloc keeps cached.
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    opt_bytes = sum(
        t.untyped_storage().nbytes()
        for st in opt.state.values()
        for t in st.values()
        if torch.is_tensor(t) and t.dim() > 0
    )
    return {
        "config": config,
        "param_bytes": held,
        "optimizer_bytes": opt_bytes,
        "rss_after_import_kib": after_import["rss"],
        "rss_after_load_kib": after_load["rss"],
        "peak_after_load_kib": after_load["peak"],
        "rss_end_kib": rss_now_kib(),
        "peak_kib": rss_peak_kib(),
        "vm_hwm_kib": proc_kib("VmHWM"),  # the mm's own high-water mark (reset by exec)
        "end_rss_anon_kib": proc_kib("RssAnon"),
        "end_rss_file_kib": proc_kib("RssFile"),
        "end_pss_kib": proc_kib("Pss", "/proc/self/smaps_rollup"),
        "peak_above_import_kib": rss_peak_kib() - after_import["rss"],
        "losses": losses,
    }


def run_child(*argv: str, threads: int | None) -> dict:
    """This script in a fresh process; its last stdout line is JSON. The parent never imports
    torch: Linux keeps ru_maxrss across fork+exec (the child starts at the parent's high-water
    mark), so a big parent would hide the children's own peaks."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    proc = subprocess.run(
        [sys.executable, __file__, *argv], cwd=ROOT, capture_output=True, text=True, env=env
    )
    if proc.returncode:
        sys.exit(f"child {argv[:3]} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure_memory(name: str, folder: Path, info: dict, args: argparse.Namespace) -> dict:
    got = {
        c: run_child(
            "--mem-child", c, str(folder), "--pairs", str(args.pairs), threads=args.threads
        )
        for c in ("shared", "separate")
    }
    sh, se = got["shared"], got["separate"]
    base_b, adapter_b = 4 * info["base_params"], 4 * info["adapter_params"]
    return {
        "size": name,
        "base_bytes": base_b,
        "adapter_bytes": adapter_b,
        "shared_param_bytes": sh["param_bytes"],
        "separate_param_bytes": se["param_bytes"],
        "param_ratio": sh["param_bytes"] / se["param_bytes"],
        "expected_shared_bytes": base_b + 2 * adapter_b,
        "expected_separate_bytes": 2 * base_b + 2 * adapter_b,
        "expected_ratio": (base_b + 2 * adapter_b) / (2 * base_b + 2 * adapter_b),
        "optimizer_bytes": [sh["optimizer_bytes"], se["optimizer_bytes"]],
        "vm_hwm_kib": [sh["vm_hwm_kib"], se["vm_hwm_kib"]],
        "end_rss_kib": [sh["rss_end_kib"], se["rss_end_kib"]],
        "end_rss_file_kib": [sh["end_rss_file_kib"], se["end_rss_file_kib"]],
        "end_rss_anon_kib": [sh["end_rss_anon_kib"], se["end_rss_anon_kib"]],
        "end_pss_kib": [sh["end_pss_kib"], se["end_pss_kib"]],
        "shared_peak_kib": sh["peak_kib"],
        "separate_peak_kib": se["peak_kib"],
        "peak_ratio": sh["peak_kib"] / se["peak_kib"],
        "shared_above_import_kib": sh["peak_above_import_kib"],
        "separate_above_import_kib": se["peak_above_import_kib"],
        "above_import_ratio": sh["peak_above_import_kib"] / se["peak_above_import_kib"],
        "import_rss_kib": [sh["rss_after_import_kib"], se["rss_after_import_kib"]],
        "load_rss_kib": [sh["rss_after_load_kib"], se["rss_after_load_kib"]],
        "load_peak_kib": [sh["peak_after_load_kib"], se["peak_after_load_kib"]],
        "max_loss_diff": max(abs(a - b) for a, b in zip(sh["losses"], se["losses"], strict=True)),
    }


# ---------------------------------------------------------------------------------------------


def report(speed: list[dict], mem: list[dict], args: argparse.Namespace) -> None:
    print(
        f"\nDPO step time, reference online vs precomputed: micro-batch {MICRO} pairs, "
        f"{args.steps} steps, fp32 CPU ({os.cpu_count()} cores, {args.threads} torch threads); "
        f"median of steps {WARMUP + 1}-{args.steps}, the two modes' steps interleaved, "
        f"best of {args.rounds} rounds\n"
    )
    hdr = (
        "size",
        "base params",
        "tokens/step",
        "online s/step",
        "(ref fwd s)",
        "precomputed s/step",
        "online/precomp",
        "one-off precompute s",
        "pairs",
        "break-even steps",
        "(epochs)",
    )
    print(" | ".join(hdr))
    print(" | ".join("---" for _ in hdr))
    for r in speed:
        print(
            f"{r['size']} | {r['base_params']:,} | {r['tokens_per_step']:.0f} | "
            f"{r['online_step_s']:.3f} | {r['online_ref_fwd_s']:.3f} | "
            f"{r['precomputed_step_s']:.3f} | {r['online_over_precomputed']:.2f}x | "
            f"{r['precompute_s']:.2f} | {r['pairs']} | {r['break_even_steps']:.1f} | "
            f"{r['break_even_epochs']:.2f}"
        )
    print(
        "\nbreak-even = one-off precompute / (online - precomputed step time); an epoch is "
        f"pairs/{MICRO} steps. Losses online vs precomputed agree to "
        + ", ".join(f"{r['max_loss_diff']:.1e} ({r['size']})" for r in speed)
        + "; first loss "
        + ", ".join(f"{r['first_loss']:.4f}" for r in speed)
        + " (log 2 = 0.6931: policy = reference at step 0). The precompute runs the same "
        "reference forwards the online mode runs over one epoch, so it breaks even after about "
        "an epoch and pays from the second one on, or at once when a later run hits the stage's "
        "ref_logps cache (another beta, loss or lr)."
    )
    if not mem:
        return
    print(
        f"\nPeak memory, policy + reference: one shared base with two adapters vs two model "
        f"copies; each in its own process, load + {MEM_STEPS} DPO steps with the reference "
        "forward\n"
    )
    hdr = (
        "size",
        "param MB shared",
        "param MB separate",
        "shared/separate",
        "expected",
        "peak RSS MB shared",
        "peak RSS MB separate",
        "shared/separate",
        "peak above imports MB shared",
        "above imports MB separate",
        "shared/separate",
    )
    print(" | ".join(hdr))
    print(" | ".join("---" for _ in hdr))
    for r in mem:
        print(
            f"{r['size']} | {r['shared_param_bytes'] / 2**20:.2f} | "
            f"{r['separate_param_bytes'] / 2**20:.2f} | {r['param_ratio']:.3f} | "
            f"{r['expected_ratio']:.3f} | {_mb(r['shared_peak_kib']):.0f} | "
            f"{_mb(r['separate_peak_kib']):.0f} | {r['peak_ratio']:.3f} | "
            f"{_mb(r['shared_above_import_kib']):.1f} | "
            f"{_mb(r['separate_above_import_kib']):.1f} | {r['above_import_ratio']:.3f}"
        )
    print("\nAnalytic expectation (fp32 bytes; B = base, A = one LoRA adapter):")
    for r in mem:
        b, a = r["base_bytes"] / 2**20, r["adapter_bytes"] / 2**20
        saved_rss = _mb(r["separate_peak_kib"] - r["shared_peak_kib"])
        print(
            f"  {r['size']}: B = {b:.2f} MB, A = {a:.2f} MB; shared B+2A = "
            f"{r['expected_shared_bytes'] / 2**20:.2f} MB, separate 2B+2A = "
            f"{r['expected_separate_bytes'] / 2**20:.2f} MB, ratio {r['expected_ratio']:.3f}; "
            f"the shared base should save B = {b:.2f} MB, peak RSS saved {saved_rss:.1f} MB; "
            f"AdamW state {r['optimizer_bytes'][0] / 2**20:.2f} / "
            f"{r['optimizer_bytes'][1] / 2**20:.2f} MB; losses agree to {r['max_loss_diff']:.1e}"
        )
    print(
        f"\nLive memory after the {MEM_STEPS} steps (gc + malloc_trim; MB; RSS = anonymous + "
        "file-backed; PSS counts a page mapped twice once):\n"
    )
    hdr = (
        "size",
        "RSS shared",
        "(anon / file)",
        "RSS separate",
        "(anon / file)",
        "PSS shared",
        "PSS separate",
        "PSS shared/separate",
    )
    print(" | ".join(hdr))
    print(" | ".join("---" for _ in hdr))
    for r in mem:
        cols = [
            f"{_mb(r['end_rss_kib'][i]):.0f} | {_mb(r['end_rss_anon_kib'][i]):.0f} / "
            f"{_mb(r['end_rss_file_kib'][i]):.0f}"
            for i in (0, 1)
        ]
        pss = r["end_pss_kib"]
        print(
            f"{r['size']} | {cols[0]} | {cols[1]} | {_mb(pss[0]):.0f} | {_mb(pss[1]):.0f} | "
            f"{pss[0] / pss[1]:.3f}"
        )
    hwm = all(
        abs(h - p) < 1024
        for r in mem
        for h, p in zip(
            r["vm_hwm_kib"], (r["shared_peak_kib"], r["separate_peak_kib"]), strict=True
        )
    )
    same = all(
        abs(r[k][0] / r[k][1] - 1) < 0.02 for r in mem for k in ("end_pss_kib", "end_rss_anon_kib")
    )
    print(
        f"\nru_maxrss {'matches' if hwm else 'DIFFERS from'} each child's own VmHWM (to 1 MB). "
        "RSS includes the Python/torch/transformers/peft runtime (post-import level "
        + ", ".join(f"{_mb(min(r['import_rss_kib'])):.0f}" for r in mem)
        + " MB) and the activations of a 16-pair micro-batch, so its ratio sits much nearer 1 "
        "than the parameter ratio at these sizes; 'above imports' subtracts the runtime. The "
        "base weights are read-only mmaps of model.safetensors (transformers 5 loads without "
        "copying fp32): they count in RSS only once touched (RSS right after loading: "
        + ", ".join(f"{_mb(max(r['load_rss_kib'])):.0f}" for r in mem)
        + " MB), and the second base of 'separate' maps the same file pages: RSS counts them "
        "twice, PSS once. "
        + (
            "Here, after the steps, both configurations hold the same anonymous memory and PSS "
            "(to 2%): on CPU the second base is shared page cache, and the peak-RSS saving is "
            "that double count. "
            if same
            else "Here the live anonymous memory or PSS differ by more than 2%: see the table. "
        )
        + "Copies that are materialised (a dtype cast, FSDP2 shards, any accelerator) cost what "
        "the parameter columns say."
    )


def work_child(args: argparse.Namespace, tmp: Path, mem_sizes: list[str]) -> dict:
    """Runs in its own process: build every size's base + SFT adapter, time the speed sizes."""
    import torch

    out: dict = {"threads": torch.get_num_threads(), "info": {}, "speed": []}
    for name in dict.fromkeys(args.sizes + mem_sizes):
        out["info"][name] = prepare_size(name, tmp / name)
        if name in args.sizes:
            res = measure_speed(name, tmp / name, args.steps, args.rounds, args.pairs)
            out["speed"].append({**res, "base_params": out["info"][name]["base_params"]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=16, help="timed DPO steps per mode and round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--pairs", type=int, default=320, help="training pairs (precompute covers all)")
    ap.add_argument("--sizes", nargs="+", default=["small", "medium"], choices=list(SIZES))
    ap.add_argument("--mem-sizes", nargs="*", default=["medium", "large"], choices=list(SIZES))
    ap.add_argument(
        "--threads", type=int, help="OMP_NUM_THREADS for the children (default: torch's)"
    )
    ap.add_argument("--work-child", type=Path, help=argparse.SUPPRESS)  # internal: TMP folder
    ap.add_argument("--mem-child", nargs=2, help=argparse.SUPPRESS)  # internal: CONFIG FOLDER
    args = ap.parse_args()
    mem_sizes = args.mem_sizes
    if args.mem_child:
        print(json.dumps(mem_child(args.mem_child[0], Path(args.mem_child[1]), args.pairs)))
        return
    if args.work_child:
        print(json.dumps(work_child(args, args.work_child, mem_sizes)))
        return
    assert args.steps > WARMUP, f"--steps must exceed the {WARMUP} warm-up steps"
    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        flags = [
            "--steps",
            str(args.steps),
            "--rounds",
            str(args.rounds),
            "--pairs",
            str(args.pairs),
        ]
        flags += ["--sizes", *args.sizes, "--mem-sizes", *mem_sizes]
        work = run_child("--work-child", tmp, *flags, threads=args.threads)
        mem = [
            measure_memory(name, Path(tmp) / name, work["info"][name], args) for name in mem_sizes
        ]
    args.threads = work["threads"]
    report(work["speed"], mem, args)
    print(
        f"\n(total wall {time.perf_counter() - t0:.0f} s; 1-min load average {load0:.1f} at the "
        f"start, {os.getloadavg()[0]:.1f} at the end; above {args.threads} (this run's own threads), "
        "other processes shared the CPUs. With OpenMP threads = cores, a competing process can slow steps many-fold; "
        "--threads 1 is steadier on a busy machine)"
    )
    print(json.dumps({"speed": work["speed"], "memory": mem}))


if __name__ == "__main__":
    main()
