#!/usr/bin/env bash
# The wheels bench/gpu_speed.py needs on a GPU machine whose image has an older stack (torch
# 2.11+cu130 and transformers 5.17, no pydantic): our pinned transformers and peft and what
# posttrain's step and sampler paths import that such an image lacks, at constraints.txt's
# versions, for CPython 3.12 on x86-64, into .whl/ (a CUDA torch wheel is too big to bring: the
# image's torch stays). Run here, where the package index is reachable:
#
#   bash bench/gpu_wheels.sh
#
# then on the GPU machine, from the repository root (docs/benchmarks.md):
#
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#   PYTHONPATH=/tmp/site:$PWD python3 bench/gpu_speed.py --out gpu_speed.json
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
names=(transformers peft pydantic pydantic_core annotated-types typing-inspection
       typing_extensions regex)
pins=()
for n in "${names[@]}"; do
  pin=$(grep -i "^${n}==" constraints.txt) || { echo "no pin for $n in constraints.txt" >&2; exit 1; }
  pins+=("$pin")
done
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do
  platforms+=(--platform "$p")
done
rm -rf .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d .whl "${pins[@]}"
ls .whl
