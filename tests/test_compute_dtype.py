"""The compute dtype (load(compute_dtype=...), --compute-dtype): a bf16 model computed in float32 equals
transformers' float32 forward on the same weights, ties stay tied, and "auto" follows the CPU."""

import pytest
import torch
from tiny import TINY
from transformers import AutoModelForCausalLM

import moestream
from moestream.conversion.synthetic import make_model, save_checkpoint
from moestream.core.compute import kernels
from moestream.core.compute.dense import QuantizedLinear
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


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3"])
def test_bf16_models_route_in_float32_on_the_cpu(family, tmp_path):
    """Routers hold a float32 copy of their weights and take float32 input (dense.routers_in_float32): each
    one's logits equal float64 math on its input, and the model stays within bf16 rounding of
    transformers' own bf16 forward on the same weights."""
    checkpoint = save_checkpoint(make_model(family, seed=5, dtype=torch.bfloat16, **TINY[family]), tmp_path / "hf")
    store = moestream.convert(checkpoint, tmp_path / "store", progress=False)
    streamed, _ = moestream.load(store, "1MiB", compute_dtype="bf16")
    reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).eval()
    seen = []
    for name, module in streamed.named_modules():
        if "Router" in type(module).__name__:
            stored = reference.get_submodule(name).weight
            assert module.weight.dtype == torch.float32  # transformers keeps DeepSeek-V3's so, the others in bf16
            assert torch.equal(module.weight, stored.float())  # an exact copy, not a requantized one
            assert not module._forward_pre_hooks  # the cast is in its forward: a hook slows every call
            module.register_forward_hook(lambda m, args, out: seen.append((m, args[0], out[0])))
    ids = torch.randint(0, 250, (2, 9), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        got, expected = streamed(ids).logits.float(), reference(ids).logits.float()
    assert len(seen) == len(streamed.model.layers) - (1 if family == "deepseek_v3" else 0)  # its first layer is dense
    for router, x, logits in seen:
        assert logits.dtype == torch.float32  # (DeepSeek-V3's router casts its input itself)
        bias = getattr(router, "bias", None)
        exact = torch.nn.functional.linear(
            x.double().reshape(-1, x.shape[-1]), router.weight.double(), None if bias is None else bias.double()
        )
        assert torch.allclose(logits.double(), exact, rtol=1e-5, atol=1e-5)
    assert ((got - expected).norm() / expected.norm()).item() <= 3e-2  # bf16 rounding apart
