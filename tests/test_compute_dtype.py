"""The compute dtype (load(compute_dtype=...), --compute-dtype): a bf16 model computed in float32 equals
transformers' float32 forward on the same weights, ties stay tied, and "auto" follows the CPU."""

import pytest
import torch
from tiny import TINY
from transformers import AutoModelForCausalLM

import moestream
from moestream.conversion.synthetic import make_model, save_checkpoint
from moestream.core import kernels
from moestream.core.dense import QuantizedLinear
from moestream.errors import UsageError


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    model = make_model("qwen3_moe", seed=9, dtype=torch.bfloat16, **dict(TINY["qwen3_moe"], tie_word_embeddings=True))
    return save_checkpoint(model, tmp_path_factory.mktemp("bf16") / "hf")


def test_fp32_compute_equals_transformers_float32_forward(bf16_checkpoint, tmp_path):
    store = moestream.convert(bf16_checkpoint, tmp_path / "store", "fp32", progress=False)
    streamed, _ = moestream.load(store, "1MiB", compute_dtype="fp32")
    reference = AutoModelForCausalLM.from_pretrained(bf16_checkpoint, dtype=torch.float32).eval()
    ids = torch.randint(0, 250, (2, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected, got = reference(ids).logits, streamed(ids).logits
    assert got.dtype == torch.float32
    assert ((got - expected).norm() / expected.norm()).item() <= 1e-5
    # The tied LM head and embeddings are one float32 tensor, not two copies.
    assert streamed.get_output_embeddings().weight is streamed.get_input_embeddings().weight


def test_fp32_compute_keeps_int4_parameters_for_the_kernel(bf16_checkpoint, tmp_path):
    store = moestream.convert(bf16_checkpoint, tmp_path / "store", dense_dtype="int8", progress=False)
    bf16, _ = moestream.load(store, "1MiB", compute_dtype="bf16")
    fp32, _ = moestream.load(store, "1MiB", compute_dtype="fp32")
    q = fp32.model.layers[0].self_attn.q_proj
    assert isinstance(q, QuantizedLinear) and q.scales.dtype == torch.float32
    assert bf16.model.layers[0].self_attn.q_proj.scales.dtype == torch.bfloat16
    ids = torch.randint(0, 250, (1, 8), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        a, b = bf16(ids).logits.float(), fp32(ids).logits
    assert ((a - b).norm() / b.norm()).item() <= 2e-2  # the same model, bf16 rounding apart


@pytest.mark.parametrize("native, expected", [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_computes_bf16_models_in_float32_only_without_bf16_arithmetic(monkeypatch, native, expected):
    monkeypatch.setattr(kernels, "native_bf16", lambda: native)
    assert kernels.compute_dtype("auto", torch.bfloat16) == expected
    assert kernels.compute_dtype("auto", torch.float32) == torch.float32  # never narrower than stored
    assert kernels.compute_dtype("bf16", torch.float32) == torch.bfloat16


def test_an_unknown_compute_dtype_is_a_usage_error():
    with pytest.raises(UsageError, match="compute dtype must be one of auto, bf16, fp32"):
        kernels.compute_dtype("fp8", torch.bfloat16)
