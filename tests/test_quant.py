"""Low-bit expert formats: each format against its float64 definition, each kernel against that
definition, and whole quantized models against transformers' forward on the dequantized weights."""

import json

import pytest
import torch
from tiny import TINY
from transformers import AutoModelForCausalLM

import moestream
from moestream.conversion.quant import (
    TABLES,
    QuantFormat,
    compress_int4_bytes,
    expand_int4_bytes,
    legacy_codes,
    pack,
    pack_nibbles,
    pack_six,
    quantize,
    reference_dequantize,
    torch_int4_packing,
    unpack_nibbles,
    unpack_six,
)
from moestream.conversion.skeleton import expert_parameters, experts_modules
from moestream.conversion.store import Store
from moestream.conversion.synthetic import make_model, save_checkpoint
from moestream.core.compute import repack
from moestream.core.compute.kernels import cpu_record, expert_linear
from moestream.errors import StoreError, UsageError

FORMATS = [
    ("int8", None),
    ("int6", 32),
    ("int6", 64),
    ("int4", 32),
    ("int4", 64),
    ("int4", 128),
    ("int3", 32),
    ("int2", 32),
    ("int2", 64),
]


@pytest.mark.parametrize("shape", [(16, 32), (48, 64), (96, 256), (256, 128), (80, 192)])
def test_portable_int4_bytes_become_this_machines_kernel_layout(shape):
    """The repack (C++ and its fallback) gives torch's own packing of the same codes, for full blocks of
    rows, a tail of 16, and inputs that take the vectorized path (K a multiple of 64) or not."""
    n, k = shape
    codes = torch.randint(0, 16, (n, k), generator=torch.Generator().manual_seed(n + k), dtype=torch.uint8)
    expected = torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
    assert torch.equal(repack.kernel_layout(pack_nibbles(codes)), expected)
    assert torch.equal(unpack_nibbles(pack_nibbles(codes)), codes)
    assert torch.equal(legacy_codes(expected, torch_int4_packing()), codes)  # version 3 bytes read back


def _weights(n, k, seed):
    """Fresh random weights with the outliers real checkpoints have: a few large values per row."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.02
    w[torch.rand(n, k, generator=g) < 0.01] *= 8
    return w


@pytest.mark.parametrize("name,group", FORMATS)
def test_quantization_error_is_within_half_a_step(name, group):
    fmt = QuantFormat.make(name, group or 32)
    for seed, (n, k) in enumerate([(64, 128), (48, 256), (16, 384)]):
        w = _weights(n, k, seed)
        q = quantize(w, fmt)
        error = (reference_dequantize(q, fmt) - w.double()).abs()
        step = q.scales.double()
        step = step[:, None] if name == "int8" else step.repeat_interleave(fmt.group_size, dim=1)
        # Half a quantization step, plus the rounding of the stored zero (bf16).
        offset_rounding = 0 if q.offsets is None else q.offsets.double().abs().repeat_interleave(fmt.group_size, dim=1) * 2**-7
        assert (error <= 0.5 * step + offset_rounding + 1e-7).all()
        assert int(q.codes.min()) >= (-127 if name == "int8" else 0) and int(q.codes.max()) <= (
            127 if name == "int8" else 2**fmt.bits - 1
        )


@pytest.mark.parametrize("bits", [2, 3])
def test_dense_int2_int3_bytes_expand_to_the_int4_bytes(bits):
    codes = torch.randint(0, 2**bits, (48, 256), generator=torch.Generator().manual_seed(bits), dtype=torch.int32)
    for int4_bytes in (pack_nibbles(codes), torch._convert_weight_to_int4pack_for_cpu(codes, 1)):  # any nibble order
        dense = compress_int4_bytes(int4_bytes, bits)
        assert dense.shape == (48, 256 * bits // 8) and dense.dtype == torch.uint8
        assert torch.equal(expand_int4_bytes(dense, bits), int4_bytes)


def test_int6_bytes_hold_each_codes_low_nibble_and_top_bits_where_the_kernels_read_them():
    codes = torch.randint(0, 64, (24, 320), generator=torch.Generator().manual_seed(6), dtype=torch.uint8)
    stored = pack_six(codes)
    assert stored.shape == (24, 320 * 3 // 4) and stored.dtype == torch.uint8
    assert torch.equal(unpack_six(stored), codes)
    assert torch.equal(unpack_nibbles(stored[:, :160].contiguous()), codes & 15)  # the low bits: int4's bytes
    tops = stored[:, 160 + 16 : 160 + 32].long()  # the top bits of the second 64 inputs
    # byte u: the tops of inputs 2u, 2u + 1 (bits 0-3), then of inputs 32 + 2u, 33 + 2u (bits 4-7)
    for u, shift, first in ((0, 0, 0), (5, 0, 10), (3, 4, 38), (15, 4, 62)):
        assert torch.equal((tops[:, u] >> shift) & 3, codes[:, 64 + first].long() >> 4)
        assert torch.equal((tops[:, u] >> (shift + 2)) & 3, codes[:, 65 + first].long() >> 4)
    with pytest.raises(UsageError, match="int6 stores them in 64s"):
        QuantFormat.make("int6", 32).check_shape(16, 96, "w")


def test_table_formats_take_the_nearest_table_value():
    """mxfp4 and iq4nl from floats (the kernels' tests make their records so): per group of 32 the scale
    maps the largest |w| onto the table's largest |value|, the zero is 0, and each weight takes the table
    value nearest w / s."""
    for name, table in TABLES.items():
        fmt = QuantFormat.make(name)
        assert (fmt.group_size, fmt.bits, fmt.table) == (32, 4, table)
        w = _weights(48, 256, 11)
        q = quantize(w, fmt)
        assert not q.offsets.any() and int(q.codes.max()) <= 15
        values = torch.tensor(table, dtype=torch.float64)
        scaled = w.double().view(48, 8, 32) / q.scales.double()[..., None]
        taken = values[q.codes.long()].view(48, 8, 32)
        best = (scaled[..., None] - values).abs().amin(-1)
        assert ((scaled - taken).abs() <= best + 1e-9).all()
        assert torch.equal(reference_dequantize(q, fmt), (taken * q.scales.double()[..., None]).view(48, 256))


@pytest.mark.parametrize("name,group", FORMATS + [("mxfp4", 32), ("iq4nl", 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_match_the_float64_definition(name, group, dtype):
    fmt = QuantFormat.make(name, group or 32)
    w = _weights(96, 256, 7)
    q = quantize(w, fmt)
    reference_w = reference_dequantize(q, fmt)
    record = cpu_record(pack(q, fmt, "down_proj"), fmt)  # as the engine makes it where a record lands
    for batch in (1, 32):
        x = torch.randn(batch, 256, generator=torch.Generator().manual_seed(batch))
        expected = x.double() @ reference_w.T
        got = expert_linear(x.to(dtype), record, "down_proj", fmt, transposed=False)
        assert got.dtype == dtype and got.shape == (batch, 96)
        relative = ((got.double() - expected).norm() / expected.norm()).item()
        assert relative <= 1e-2, f"{name} g{group} {dtype} batch {batch}: relative error {relative}"


# -- whole models ----------------------------------------------------------------------------------------

# Dimensions that every format accepts (inputs a multiple of 128, outputs of 16).
QUANT_TINY = {
    "qwen3_moe": dict(TINY["qwen3_moe"], hidden_size=128, moe_intermediate_size=128, head_dim=32, num_experts=8),
    "gpt_oss": dict(TINY["gpt_oss"], hidden_size=128, intermediate_size=128, head_dim=32),  # [K, N] experts, biases
}


@pytest.fixture(scope="module", params=sorted(QUANT_TINY))
def checkpoint(request, tmp_path_factory):
    family = request.param
    model = make_model(family, seed=3, **QUANT_TINY[family])
    return family, save_checkpoint(model, tmp_path_factory.mktemp(family) / "hf")


def _dequantized_reference(ckpt, fmt):
    """transformers' own model and forward, with every expert matrix replaced by its float64 definition."""
    model = AutoModelForCausalLM.from_pretrained(ckpt).eval()
    with torch.no_grad():
        for _, module in experts_modules(model):
            for _name, param in expert_parameters(module):
                if param.dim() != 3:
                    continue
                for e in range(param.shape[0]):
                    w = param[e].t() if module.is_transposed else param[e]
                    deq = reference_dequantize(quantize(w, fmt), fmt).to(param.dtype)
                    param[e] = deq.t() if module.is_transposed else deq
    return model


@pytest.mark.parametrize("name", ["int8", "int6", "int4", "int2"])
def test_quantized_model_equals_transformers_on_dequantized_weights(checkpoint, tmp_path, name):
    family, ckpt = checkpoint
    fmt = QuantFormat.make(name, 64 if name == "int6" else 32)  # convert's default group sizes
    store = moestream.convert(ckpt, tmp_path / "store", name, progress=False)
    streamed, _ = moestream.load(store, Store(store).manifest.max_record_stride * 2)  # two experts: evicts all the time
    reference = _dequantized_reference(ckpt, fmt)
    ids = torch.randint(0, 250, (2, 13), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected, got = reference(ids).logits, streamed(ids).logits
    relative = ((got - expected).norm() / expected.norm()).item()
    # int4/int2 run the int4 kernel in bf16 (activations rounded to 8 bits of mantissa); int8 in fp32.
    assert relative <= (1e-4 if name == "int8" else 2e-2), relative
    assert moestream.stats(streamed)["evictions"] > 0


def test_streaming_never_changes_an_int4_models_tokens(checkpoint, tmp_path):
    _, ckpt = checkpoint
    store = moestream.convert(ckpt, tmp_path / "store", "int4", progress=False)
    manifest = Store(store).manifest
    prompt = torch.randint(0, 250, (1, 9), generator=torch.Generator().manual_seed(8))
    outputs = []
    for budget in (manifest.max_record_stride * 2, manifest.expert_bytes + 2**20):
        model, _ = moestream.load(store, budget)
        with torch.no_grad():
            outputs.append(model.generate(prompt, max_new_tokens=24, min_new_tokens=24, do_sample=False))
    assert torch.equal(outputs[0], outputs[1])


def test_int4_record_size_is_near_four_and_a_half_bits(checkpoint, tmp_path):
    _, ckpt = checkpoint
    for group, bits in ((32, 5.0), (64, 4.5)):
        store = moestream.convert(ckpt, tmp_path / f"g{group}", "int4", group_size=group, progress=False)
        layer = Store(store).manifest.layers[0]
        matrices = [t for t in layer.layout.tensors if t.name.endswith(".qweight")]
        weights = sum(t.shape[0] * t.shape[1] * 2 for t in matrices)  # two int4 codes per byte
        per_weight = 8 * sum(t.nbytes for t in layer.layout.tensors if "_bias" not in t.name) / weights
        assert per_weight == pytest.approx(bits) and abs(per_weight - 4.5) / 4.5 <= 0.15


def test_mixed_recipe_is_recorded_per_layer(tmp_path):
    config = dict(QUANT_TINY["qwen3_moe"], num_hidden_layers=4)
    ckpt = save_checkpoint(make_model("qwen3_moe", seed=1, **config), tmp_path / "hf")
    store = moestream.convert(ckpt, tmp_path / "store", "int4", layer_dtypes=["0-1=int2", "-1=int8"], progress=False)
    manifest = Store(store).manifest
    assert [layer.quantization.name for layer in manifest.layers] == ["int2", "int2", "int4", "int8"]
    assert manifest.experts_dtype == "mixed: int2-g32 x2, int4-g32 x1, int8 x1"
    model, _ = moestream.load(store, "1MiB")
    with torch.no_grad():
        assert torch.isfinite(model(torch.randint(0, 250, (1, 5))).logits).all()


def test_a_store_naming_an_unknown_packing_is_refused(checkpoint, tmp_path):
    _, ckpt = checkpoint
    store = moestream.convert(ckpt, tmp_path / "store", "int4", progress=False)
    raw = json.loads((store / "manifest.json").read_text())
    for layer in raw["experts"]["layers"]:
        layer["quantization"]["packing"] = "torch-cpu-some-other-isa"
    (store / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(StoreError, match="packing 'torch-cpu-some-other-isa' is not one of nibbles"):
        moestream.load(store, "1MiB")


def test_bad_recipes_are_clear_errors(checkpoint, tmp_path):
    _, ckpt = checkpoint
    with pytest.raises(UsageError, match="unknown experts dtype 'int5'"):
        moestream.convert(ckpt, tmp_path / "a", "int4", layer_dtypes=["0=int5"], progress=False)
    with pytest.raises(UsageError, match="MoE layers 0..1"):
        moestream.convert(ckpt, tmp_path / "b", "int4", layer_dtypes=["7=int2"], progress=False)
    with pytest.raises(UsageError, match="expected LAYER=DTYPE"):
        moestream.convert(ckpt, tmp_path / "c", "int4", layer_dtypes=["zero:int2"], progress=False)
    with pytest.raises(UsageError, match="group size 48"):
        moestream.convert(ckpt, tmp_path / "d", "int4", group_size=48, progress=False)
    assert not list(tmp_path.iterdir())
