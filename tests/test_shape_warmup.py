"""The server's warm-up (core/shape_warmup.py): every bucketed bf16 matmul shape a model runs is built before
it serves, so forward passes over prompts of many lengths afterwards build none (oneDNN reports each one it
builds: ONEDNN_VERBOSE), where without the warm-up they build dozens."""

import os
import subprocess
import sys

import pytest
import torch
from tiny import TINY

import moestream
from moestream.conversion.synthetic import make_model, save_checkpoint

_AFTER_WARMUP = r"""
import sys
import torch
import moestream
from moestream.core.runtime import warm_matmul_shapes

model, _ = moestream.load(sys.argv[1], "1MiB", compute_dtype="bf16")
if sys.argv[2] == "warm":
    warmed = warm_matmul_shapes(model, 96, 60.0)
    assert warmed.built == warmed.of > 0, warmed
print("MARK", flush=True)
g = torch.Generator().manual_seed(4)
with torch.inference_mode():
    for n in range(1, 97, 5):  # prompts of 20 lengths: their rows and each expert's token counts vary
        model(torch.randint(0, 250, (1, n), generator=g), logits_to_keep=1)  # as generation calls it
"""


def _matmuls_built_after(store, mode: str) -> int:
    env = dict(os.environ, ONEDNN_VERBOSE="profile_create")
    done = subprocess.run([sys.executable, "-c", _AFTER_WARMUP, str(store), mode], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    after = done.stdout.split("MARK", 1)[1]
    return sum(1 for line in after.splitlines() if "create:cache_miss" in line and ",matmul," in line)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="the shapes are oneDNN's")
def test_after_the_warmup_prompts_of_any_length_build_no_matmul(tmp_path):
    model = make_model("qwen3_moe", seed=12, dtype=torch.bfloat16, **TINY["qwen3_moe"])
    store = moestream.convert(save_checkpoint(model, tmp_path / "hf"), tmp_path / "store", "bf16", progress=False)
    cold = _matmuls_built_after(store, "cold")
    if cold == 0:
        pytest.skip("this torch build reports no oneDNN matmul primitives (ONEDNN_VERBOSE)")
    assert _matmuls_built_after(store, "warm") == 0
