"""The fast paths a loaded model runs are decided at load and said, with why the others are off."""

import shutil

import pytest
import torch
from tiny import TINY

import moestream
from moestream.conversion.synthetic import make_model, save_checkpoint
from moestream.core.engine import engine_of
from moestream.core.loading import fast_paths
from moestream.native import fused_build

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler: the fused kernels are not built")

CONFIG = dict(TINY["qwen3_moe"], hidden_size=64, moe_intermediate_size=64, head_dim=16)


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("fast-paths")
    ckpt = save_checkpoint(make_model("qwen3_moe", seed=61, dtype=torch.bfloat16, **CONFIG), root / "hf")
    return {
        dtype: moestream.convert(ckpt, root / dtype, experts_dtype=dtype, dense_dtype="int8", progress=False)
        for dtype in ("int4", "int2", "bf16")
    }


def _paths(model) -> dict:
    return {p["name"]: p for p in moestream.stats(model)["fast_paths"]}


@pytest.mark.parametrize("compute_dtype", ["fp32", "bf16"])
def test_every_cpu_gets_the_one_token_experts_kernel_in_either_compute_dtype(stores, compute_dtype):
    model, _ = moestream.load(stores["int4"], "64MiB", compute_dtype=compute_dtype)
    found = _paths(model)
    layers = len(engine_of(model).layers)
    assert found["experts (one token)"]["on"] == layers == found["experts (one token)"]["of"]
    assert found["int4 records"]["on"] == layers and "repacked where they land" in found["int4 records"]["note"]
    assert found["RMSNorm"]["on"] == found["RMSNorm"]["of"] > 0
    assert found["attention (one token)"]["on"] == found["attention (one token)"]["of"] > 0
    assert fast_paths(model).startswith("fast paths: compute dtype")


def test_the_paths_that_are_off_say_why(stores, monkeypatch):
    model, _ = moestream.load(stores["int2"], "64MiB", compute_dtype="fp32")
    experts = _paths(model)["experts (one token)"]
    assert experts["on"] == 0 and "int2 records" in experts["note"]
    model, _ = moestream.load(stores["bf16"], "64MiB", compute_dtype="fp32")
    assert "float records" in _paths(model)["experts (one token)"]["note"]
    monkeypatch.setattr(fused_build, "extension", lambda: None)  # as without a compiler
    model, _ = moestream.load(stores["int4"], "64MiB", compute_dtype="fp32")
    found = _paths(model)
    assert "off" in found["fused CPU kernels"]["note"] and found["experts (one token)"]["on"] == 0
    assert "torch's own packing function" in found["int4 records"]["note"]  # slower, and said so
    prompt = torch.randint(0, 250, (1, 6), generator=torch.Generator().manual_seed(62))
    with torch.no_grad():
        slow = model.generate(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    monkeypatch.undo()
    fast, _ = moestream.load(stores["int4"], "64MiB", compute_dtype="fp32")
    with torch.no_grad():
        assert torch.equal(slow, fast.generate(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False))


def test_generate_prints_the_fast_paths(stores, capsys):
    from moestream.cli import main

    # said at load, whatever follows (a store without tokenizer files stops there with a clear error)
    main(["generate", str(stores["int4"]), "--memory", "64MiB", "--prompt", "ab", "--max-new-tokens", "2"])
    err = capsys.readouterr().err
    line = next((x for x in err.splitlines() if x.startswith("fast paths: ")), None)
    assert line is not None and "experts (one token) 2/2" in line and "int4 records 2/2" in line, err[-2000:]
