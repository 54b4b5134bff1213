#!/usr/bin/env bash
# The GPU checks, on a CUDA machine without network access, in under 8 minutes:
#   1. the CUDA tests (tests/test_cuda.py: logits against transformers on the GPU for qwen3_moe, mixtral,
#      deepseek_v3 and gpt_oss below half the experts; greedy tokens across tier budgets; VRAM bounded),
#      and the tier tests (tests/test_device_tier.py);
#   2. benchmarks/gpu_bench.py: decode against transformers + accelerate offload at the same VRAM and RAM,
#      and all experts in VRAM against transformers with the whole model on the GPU.
#
#   benchmarks/gpu_wheels.sh wheels        # here, with the package index: the wheels the GPU machine may lack
#   benchmarks/gpu_check.sh wheels         # there, from the repository root; output also under $OUT
#
# It installs nothing from the network: the machine's own Python (its CUDA build of torch) in a venv that
# sees its packages, plus the wheels in WHEELS (default: wheels/), installed without an index.
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS=${1:-wheels}
OUT=${OUT:-/tmp/moestream-gpu-check}
mkdir -p "$OUT"
VENV=/tmp/moestream-gpu-venv
python3 -m venv --system-site-packages "$VENV" && . "$VENV/bin/activate"
if [ -d "$WHEELS" ] && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  pip install --no-index --no-deps --quiet "$WHEELS"/*.whl 2>&1 | tail -3
fi
export PYTHONPATH="$PWD/src:$PWD/tests"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  python -c "import sys, torch, transformers; print('python', sys.version.split()[0], '| torch', torch.__version__, '| cuda', torch.version.cuda, '| transformers', transformers.__version__, '| gpu', torch.cuda.is_available())"
  python -c "import accelerate; print('accelerate', accelerate.__version__)" || echo "accelerate missing: the offload peer will fail"
} 2>&1 | tee "$OUT/versions.txt"
echo "== tests" | tee "$OUT/tests.txt"
timeout 300 python -m pytest tests/test_cuda.py tests/test_device_tier.py -q -rs -p no:cacheprovider 2>&1 | tee -a "$OUT/tests.txt"
tests=${PIPESTATUS[0]}
echo "== bench" | tee "$OUT/bench.txt"
timeout 300 python benchmarks/gpu_bench.py --workdir /tmp/moestream-gpu-bench --rounds 2 2>&1 | grep -v "Loading weights" | tee -a "$OUT/bench.txt"
bench=${PIPESTATUS[0]}
echo "tests exit $tests, bench exit $bench"
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ]
