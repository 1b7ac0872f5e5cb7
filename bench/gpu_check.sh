#!/usr/bin/env bash
# GPU check: SFT and DPO for a few dozen steps on random-init Qwen2.5-0.5B and -1.5B shapes in
# bf16, then GRPO and on-policy distillation (the 0.5B shape, its teacher the 1.5B one); prints
# tokens/s per GPU, MFU, peak allocated and reserved memory and the pre-flight estimate beside
# it, the RL steps' phases (sampled tokens/s), and what NVML read (power, temperature, clocks,
# throttling) idle and in each stage's last health sample. Run from the repository root on a
# machine with an NVIDIA GPU:
#
#   bash bench/gpu_check.sh                 # seq 1024, micro 8 (about 12 minutes on one H200,
#                                           # most of it the stage processes starting)
#   bash bench/gpu_check.sh --rl-steps 0    # SFT and DPO only (about 5 minutes)
#   bash bench/gpu_check.sh --seq 2048      # any bench/gpu_check.py option passes through
#
# Uses .venv if present (the project installed with a CUDA build of torch), else python3.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
"$PY" - <<'PYEOF'
import sys, torch
if not torch.cuda.is_available():
    sys.exit(f"no CUDA device visible to torch {torch.__version__}: this check needs a GPU "
             "(bench/gpu_check.py --cpu-smoke runs the same path shrunk on CPU)")
p = torch.cuda.get_device_properties(0)
print(f"GPU: {p.name}, {p.total_memory / 2**30:.0f} GiB; torch {torch.__version__}, "
      f"CUDA {torch.version.cuda}")
PYEOF
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
# What the stages' health samplers will read (NVML through the CUDA device's PCI bus id,
# InfiniBand, storage reads): two samples 1 s apart, idle. The stages' own last samples, under
# load, follow the results table.
"$PY" -m posttrain.telemetry.health || echo "health readers failed (exit $?): see above"
exec "$PY" bench/gpu_check.py "$@"
