"""GGUF conversion cost at a real shape: time and peak memory of write + read-back check.

Builds a random-init model of Qwen2.5-0.5B's exact shape (24 blocks, 151,936 embedding rows,
tied; bf16 safetensors like a hub checkpoint) once, then converts it in a fresh process per
type, so the peak RSS is the conversion's own (it includes the pages of the memory-mapped file
read back during the check, which the kernel can drop).

    .venv/bin/python bench/gguf_convert.py /tmp/gguf-bench f16 q8_0
"""

from __future__ import annotations

import resource
import subprocess
import sys
import time
from pathlib import Path


def build(root: Path, layers: int) -> None:
    import torch

    from posttrain.data.synthetic import pretrain_corpus
    from posttrain.kinds.ingest import FromConfigModel
    from posttrain.models.tiny import build_model, fill_vocabulary, train_tokenizer

    cfg = FromConfigModel(shape="qwen2.5-0.5b", num_layers=layers)
    tok = fill_vocabulary(train_tokenizer(pretrain_corpus(300, 0), 1000), cfg.vocab_size)
    build_model(cfg, tok).to(torch.bfloat16).save_pretrained(str(root / "model"))
    tok.save_pretrained(str(root / "model"))


def convert(root: Path, gguf_type: str) -> None:
    from posttrain.export.gguf import plan_gguf, write_gguf
    from posttrain.export.gguf_verify import verify_gguf

    def rss() -> float:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # GiB (Linux: KiB)

    t0 = time.perf_counter()
    plan = plan_gguf(root / "model", gguf_type, "bench")
    path = write_gguf(plan, root / f"bench-{gguf_type}.gguf")
    t1, after_write = time.perf_counter(), rss()
    check = verify_gguf(path, plan)
    t2 = time.perf_counter()
    print(
        f"{gguf_type}: {path.stat().st_size / 2**20:.0f} MiB, write {t1 - t0:.1f} s, "
        f"check {t2 - t1:.1f} s, peak RSS {after_write:.2f} GiB after write, {rss():.2f} GiB "
        f"after check; max |error| {check['max_abs_weight_error']}"
    )


if __name__ == "__main__":
    if sys.argv[1] == "--convert":
        convert(Path(sys.argv[2]), sys.argv[3])
        sys.exit()
    root = Path(sys.argv[1])
    if not (root / "model" / "config.json").exists():
        build(root, layers=24)
    for gguf_type in sys.argv[2:] or ["f16", "q8_0"]:
        subprocess.run([sys.executable, __file__, "--convert", str(root), gguf_type], check=True)
