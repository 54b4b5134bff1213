"""The fused RMSNorm kernel (core/fused.py): its numbers against float64 math and transformers' module,
which classes it takes (checked by behaviour), and when a model falls back to the modules' own forward."""

import shutil

import pytest
import torch
from tiny import TINY, tiny_checkpoint
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

import moestream
from moestream.core import fused

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler: the fused kernels are not built")


@pytest.fixture(scope="module")
def kernel():
    ext = fused.extension()
    assert ext is not None, "a C++ compiler is here, so the extension must build"
    return ext.rms_norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden", [7, 128, 2048])
def test_kernel_matches_float64_math(kernel, dtype, hidden):
    g = torch.Generator().manual_seed(hidden)
    x = (torch.randn(3, 5, hidden, generator=g) * 2).to(dtype)
    w = (torch.rand(hidden, generator=g) + 0.5).to(dtype)
    x64 = x.double()
    exact = w.double() * x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6)
    got = kernel(x, w, 1e-6)
    assert got.dtype == dtype and got.shape == x.shape
    # two roundings to the dtype (the normalized row, then its product with the weight)
    assert torch.allclose(got.double(), exact, rtol=3 * torch.finfo(dtype).eps, atol=1e-6)


def _gemma_like(hidden):
    class OffsetRMSNorm(nn.Module):  # Gemma's formula: (1 + weight)
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(hidden))
            self.eps = 1e-6

        def forward(self, x):
            h = x.float()
            return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight.float())).to(x.dtype)

    return OffsetRMSNorm()


def _single_rounding(hidden, dtype):
    class SingleRoundingRMSNorm(nn.Module):  # gpt-oss's: the weight multiplies in float32, one rounding
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(hidden, dtype=dtype))
            self.variance_epsilon = 1e-6

        def forward(self, x):
            h = x.float()
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
            return (self.weight * h).to(x.dtype)

    return SingleRoundingRMSNorm()


def test_only_classes_that_compute_the_same_take_the_kernel(kernel):
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3_moe", **TINY["qwen3_moe"]))
    norm = model.model.layers[0].input_layernorm
    assert fused.agrees(norm, kernel) and fused.agrees(norm.to(torch.bfloat16), kernel)
    assert not fused.agrees(_gemma_like(64), kernel)
    # a weight of ones would hide the difference; agrees() probes with a random weight
    assert not fused.agrees(_single_rounding(256, torch.bfloat16), kernel)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("fused")
    _, ckpt = tiny_checkpoint("qwen3_moe", root / "hf", seed=21)
    return ckpt, moestream.convert(ckpt, root / "store", experts_dtype="fp32", progress=False)


def test_a_loaded_model_uses_the_kernel_and_equals_transformers(kernel, store):
    ckpt, path = store
    model, _ = moestream.load(path, "1MiB")
    norms = fused._rms_norms(model)
    assert norms and all(getattr(n.forward, "func", None) is fused._fused_forward for n in norms)
    reference = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    ids = torch.randint(0, 250, (2, 11), generator=torch.Generator().manual_seed(22))
    with torch.inference_mode():
        got, expected = model(ids).logits, reference(ids).logits
    assert ((got - expected).norm() / expected.norm()).item() <= 1e-5


def test_other_inputs_fall_back_to_the_modules_own_forward(kernel, store, monkeypatch):
    model, _ = moestream.load(store[1], "1MiB")
    norm = fused._rms_norms(model)[0]
    x = torch.randn(2, norm.weight.shape[0], dtype=torch.float64)
    with torch.no_grad():  # another dtype than the weight's: the module's own math (which promotes)
        assert torch.equal(norm(x), type(norm).forward(norm, x))
    calls = []
    original = type(norm).forward
    monkeypatch.setattr(type(norm), "forward", lambda self, h, *more: calls.append(more) or original(self, h))
    with torch.no_grad():  # a call with more inputs than agrees() checked goes to the module's own forward
        norm(torch.randn(2, norm.weight.shape[0]), "extra")
    assert calls == [("extra",)]
    monkeypatch.undo()
    x = torch.randn(2, norm.weight.shape[0], requires_grad=True)
    y = norm(x)  # autograd recording: the kernel has no backward, so the module's own forward runs
    assert y.grad_fn is not None


def test_moestream_fused_0_leaves_the_modules_alone(monkeypatch, store):
    monkeypatch.setenv("MOESTREAM_FUSED", "0")
    fused.extension.cache_clear()
    try:
        model, _ = moestream.load(store[1], "1MiB")
        assert not any(getattr(n.forward, "func", None) is fused._fused_forward for n in fused._rms_norms(model))
        assert fused.install(model) == 0
    finally:
        monkeypatch.delenv("MOESTREAM_FUSED")
        fused.extension.cache_clear()


def test_a_build_lock_left_by_a_killed_build_does_not_hang_the_next_load(kernel):
    import os
    import time

    from torch.utils import cpp_extension

    lock = os.path.join(cpp_extension._get_build_directory(fused.EXTENSION, verbose=False), "lock")
    with open(lock, "w"):
        pass
    old = time.time() - fused.STALE_LOCK_SECONDS - 60
    os.utime(lock, (old, old))
    fused.extension.cache_clear()
    try:
        assert fused.extension() is not None  # would wait forever on the lock file otherwise
        assert not os.path.exists(lock)
    finally:
        fused.extension.cache_clear()
        if os.path.exists(lock):
            os.remove(lock)
