#!/usr/bin/env bash
# Download, here (with the package index), the wheels benchmarks/gpu_check.sh installs on a GPU machine
# that has no network: the versions this environment runs of transformers and of the packages it and the
# checks need beyond torch, the pure-Python ones as they are, the compiled ones for the GPU machine's
# Python (PYTHON_VERSION, default 3.11, manylinux x86_64). The directory (default wheels/, ignored by git)
# travels with the checkout; keep it under 64 MiB.
set -euo pipefail
DIR=${1:-wheels}
PY=${PYTHON_VERSION:-3.11}
mkdir -p "$DIR"
version() { python -c "import importlib.metadata as m; print(m.version('$1'))"; }
pure="transformers huggingface_hub accelerate pytest pluggy iniconfig packaging"
compiled="tokenizers safetensors xxhash"
pip download --quiet --no-deps -d "$DIR" $(for p in $pure; do echo "$p==$(version $p)"; done)
pip download --quiet --no-deps --only-binary=:all: --python-version "$PY" --platform manylinux2014_x86_64 -d "$DIR" \
  $(for p in $compiled; do echo "$p==$(version $p)"; done)
du -sh "$DIR"
ls "$DIR"
