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
# It installs nothing from the network and changes nothing in the machine's Python: the wheels in WHEELS
# (default: wheels/) are unpacked without an index into a directory of their own that comes first on
# PYTHONPATH, before the machine's packages (its CUDA build of torch, an older transformers).
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS=${1:-wheels}
OUT=${OUT:-/tmp/moestream-gpu-check}
SITE=/tmp/moestream-gpu-site
mkdir -p "$OUT"
if [ -d "$WHEELS" ] && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  python3 -m pip install --no-index --no-deps --quiet --upgrade --target "$SITE" "$WHEELS"/*.whl 2>&1 | tail -3
fi
export PYTHONPATH="$PWD/src:$PWD/tests:$SITE"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  python3 -c "import sys, torch, transformers; print('python', sys.version.split()[0], '| torch', torch.__version__, '| cuda', torch.version.cuda, '| transformers', transformers.__version__, '| gpu', torch.cuda.is_available())"
  python3 -c "import accelerate; print('accelerate', accelerate.__version__)" || echo "accelerate missing: the offload peer will fail"
} 2>&1 | tee "$OUT/versions.txt"
echo "== tests" | tee "$OUT/tests.txt"
timeout 300 python3 -m pytest tests/test_cuda.py tests/test_device_tier.py -q -rs -p no:cacheprovider 2>&1 | tee -a "$OUT/tests.txt"
tests=${PIPESTATUS[0]}
echo "== bench" | tee "$OUT/bench.txt"
timeout 300 python3 benchmarks/gpu_bench.py --workdir /tmp/moestream-gpu-bench --rounds 2 --json "$OUT/bench.json" 2>&1 | grep -v "Loading weights" | tee -a "$OUT/bench.txt"
bench=${PIPESTATUS[0]}
echo "tests exit $tests, bench exit $bench"
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ]
