"""Resident linear layers stored quantized (convert --dense-dtype): the module against the format's float64
definition, and whole models against transformers' forward on the dequantized weights."""

import json

import pytest
import torch
from tiny import TINY
from transformers import AutoModelForCausalLM

import moestream
from moestream.conversion.quant import QuantFormat, pack, quantize, reference_dequantize, torch_int4_packing
from moestream.conversion.skeleton import expert_parameters, experts_modules
from moestream.conversion.store import MANIFEST, Store
from moestream.conversion.synthetic import make_model, save_checkpoint
from moestream.core.compute import kernels
from moestream.core.compute.dense import QuantizedLinear, align_weights, prepare_for_cpu
from moestream.core.compute.kernels import int8_activations_reference
from moestream.core.compute.plan import plan_linears
from moestream.errors import StoreError, UsageError
from moestream.native import fused_build


@pytest.mark.parametrize("int8_activations", [False, True])
@pytest.mark.parametrize("name,group", [("int8", None), ("int6", 64), ("int4", 32), ("int4", 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_linear_matches_the_float64_definition(name, group, dtype, int8_activations):
    fmt = QuantFormat.make(name, group or 32)
    g = torch.Generator().manual_seed(11)
    w = torch.randn(96, 256, generator=g) * 0.02
    bias = torch.randn(96, generator=g)
    q = quantize(w, fmt)
    layer = QuantizedLinear(256, 96, torch.nn.Parameter(bias.to(dtype)), fmt)
    layer.load_state_dict({k.removeprefix("w."): v for k, v in pack(q, fmt, "w").items()} | {"bias": bias.to(dtype)}, assign=True)
    packed = {k: v.clone() for k, v in layer.state_dict().items()}
    plan_linears(layer, int8_activations, cpu_kernels=True, dtype=dtype)  # as load() does on the CPU
    prepare_for_cpu(layer)
    assert layer.plan.int8_activations == int8_activations
    x = torch.randn(2, 5, 256, generator=g)
    expected = x.double() @ reference_dequantize(q, fmt).T + bias.double()
    got = layer(x.to(dtype))
    assert got.shape == (2, 5, 96) and got.dtype == dtype
    relative = ((got.double() - expected).norm() / expected.norm()).item()
    # bf16 activations keep 8 bits of mantissa; fp32 int8 is exact up to float32 rounding; int8 activations
    # round each input to 1/254 of its block's largest.
    assert relative <= (1e-5 if dtype == torch.float32 and name == "int8" and not int8_activations else 1e-2), relative
    if int8_activations:  # exactly the kernels' arithmetic, up to float32 sums (and bf16's rounding of the output)
        x2 = x.to(dtype).reshape(10, 256)
        exact = int8_activations_reference(x2, packed["qweight"], packed[fmt.params], fmt) + bias.to(dtype).double()
        tolerance = 1e-5 if dtype == torch.float32 else 4e-3
        assert ((got.reshape(10, 96).double() - exact).abs().max() / exact.abs().max()).item() <= tolerance


def _dequantized_reference(ckpt, formats: dict[str, QuantFormat]):
    """transformers' own model and forward, with each quantized linear's weight replaced by its float64 definition."""
    model = AutoModelForCausalLM.from_pretrained(ckpt).eval()
    with torch.no_grad():
        for name, fmt in formats.items():
            weight = model.get_submodule(name).weight
            weight.copy_(reference_dequantize(quantize(weight, fmt), fmt).to(weight.dtype))
    return model


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "gpt_oss", "deepseek_v4"])
def test_int8_dense_model_equals_transformers_on_dequantized_weights(family, tmp_path):
    ckpt = save_checkpoint(make_model(family, seed=4, **TINY[family]), tmp_path / "hf")
    store = moestream.convert(ckpt, tmp_path / "store", dense_dtype="int8", progress=False)
    formats = Store(store).manifest.dense
    # Attention (and deepseek's dense first layer and shared expert) quantized; the untied LM head at int8.
    assert any(n.endswith(("self_attn.o_proj", "self_attn.o_b_proj")) for n in formats)
    assert formats["lm_head"] == QuantFormat.make("int8")
    if family == "deepseek_v3":
        assert any(".shared_experts." in n for n in formats) and any(n.startswith("model.layers.0.mlp.") for n in formats)
    if family == "deepseek_v4":  # its grouped output projection is an nn.Linear subclass with its own forward
        assert not any(n.endswith("o_a_proj") for n in formats)
    streamed, _ = moestream.load(store, Store(store).manifest.max_record_stride * 2)  # two experts: evicts all the time
    assert all(isinstance(streamed.get_submodule(n), QuantizedLinear) for n in formats)
    reference = _dequantized_reference(ckpt, formats)
    ids = torch.randint(0, 250, (2, 11), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        expected, got = reference(ids).logits, streamed(ids).logits
    relative = ((got - expected).norm() / expected.norm()).item()
    assert relative <= 1e-4, relative


def test_int4_dense_falls_back_to_int8_where_the_int4_kernel_cannot_take_the_shape(tmp_path):
    # hidden 96 is not a multiple of the 64-input groups: those projections go int8; o_proj (128 inputs) int4.
    config = dict(TINY["qwen3_moe"], hidden_size=96, head_dim=32, num_attention_heads=4, num_key_value_heads=2)
    ckpt = save_checkpoint(make_model("qwen3_moe", seed=5, **config), tmp_path / "hf")
    store = moestream.convert(ckpt, tmp_path / "store", dense_dtype="int4", group_size=64, progress=False)
    formats = Store(store).manifest.dense
    assert formats["model.layers.0.self_attn.q_proj"].name == "int8"
    assert formats["model.layers.0.self_attn.o_proj"] == QuantFormat.make("int4", 64)
    assert formats["lm_head"] == QuantFormat.make("int8")  # the LM head never below 8 bits
    reference = _dequantized_reference(ckpt, formats)
    streamed, _ = moestream.load(store, "64MiB")
    ids = torch.randint(0, 250, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected, got = reference(ids).logits, streamed(ids).logits
    # The int4 kernel takes bf16 activations (8 bits of mantissa); everything else runs in float32.
    assert ((got - expected).norm() / expected.norm()).item() <= 2e-2


@pytest.mark.parametrize("activations", ["float", "int8"])
def test_an_int6_model_and_head_equal_transformers_on_dequantized_weights(tmp_path, activations):
    """int6 experts and dense layers, the LM head int6 too (a GGUF's Q6_K head at its bits), in groups of 64
    by default; int8 activations run the kernels, float ones dequantize each matrix per call."""
    config = dict(TINY["qwen3_moe"], hidden_size=128, moe_intermediate_size=128, head_dim=32, vocab_size=256)  # rows in 16s
    model = make_model("qwen3_moe", seed=9, **config)
    ckpt = save_checkpoint(model, tmp_path / "hf")
    store = moestream.convert(ckpt, tmp_path / "store", "int6", dense_dtype="int6", progress=False)
    manifest = Store(store).manifest
    six = QuantFormat.make("int6", 64)
    assert manifest.dense["lm_head"] == six and manifest.dense["model.layers.0.self_attn.q_proj"] == six
    assert all(layer.quantization == six for layer in manifest.layers)
    reference = _dequantized_reference(ckpt, manifest.dense)
    with torch.no_grad():  # the experts' matrices too
        for _, module in experts_modules(reference):
            for _, param in expert_parameters(module):
                for e in range(param.shape[0] if param.dim() == 3 else 0):
                    param[e] = reference_dequantize(quantize(param[e], six), six).to(param.dtype)
    streamed, _ = moestream.load(store, "64MiB", activations=activations)
    ids = torch.randint(0, 250, (2, 11), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected, got = reference(ids).logits, streamed(ids).logits
    relative = ((got - expected).norm() / expected.norm()).item()
    assert relative <= (1e-4 if activations == "float" else 2e-2), relative
    if activations == "int8" and fused_build.extension() is not None:
        # one token at a time: the fused experts and attention kernels take int6 (int8 activations)
        paths = {p["name"]: p for p in moestream.stats(streamed)["fast_paths"]}
        for name in ("experts (one token)", "attention (one token)"):
            assert paths[name]["on"] == paths[name]["of"] > 0, paths[name]
        with torch.no_grad():
            past = streamed(ids[:1, :5], use_cache=True).past_key_values
            for t in range(5, 11):
                out = streamed(ids[:1, t : t + 1], past_key_values=past, use_cache=True)
                past, step = out.past_key_values, out.logits[0, -1]
                assert ((step - got[0, t]).norm() / got[0, t].norm()).item() <= 1e-3, t


def test_tokens_never_depend_on_the_budget_with_quantized_dense_layers(tmp_path):
    config = dict(TINY["qwen3_moe"], hidden_size=128, moe_intermediate_size=128, head_dim=32)  # int4 experts' shapes
    ckpt = save_checkpoint(make_model("qwen3_moe", seed=6, **config), tmp_path / "hf")
    store = moestream.convert(ckpt, tmp_path / "store", "int4", dense_dtype="int8", progress=False)
    manifest = Store(store).manifest
    prompt = torch.randint(0, 250, (1, 9), generator=torch.Generator().manual_seed(8))
    outputs = []
    for budget in (manifest.max_record_stride * 2, manifest.expert_bytes + 2**20):
        model, _ = moestream.load(store, budget)
        with torch.no_grad():
            outputs.append(model.generate(prompt, max_new_tokens=20, min_new_tokens=20, do_sample=False))
    assert torch.equal(outputs[0], outputs[1])


def test_dense_layers_packed_for_other_cpu_kernels_are_refused(tmp_path):
    ckpt = save_checkpoint(make_model("qwen3_moe", seed=7, **TINY["qwen3_moe"]), tmp_path / "hf")
    store = moestream.convert(ckpt, tmp_path / "store", dense_dtype="int4", progress=False)
    manifest = json.loads((store / MANIFEST).read_text())
    name = next(n for n, f in manifest["dense_quantization"].items() if f["format"] == "int4")
    manifest["dense_quantization"][name]["packing"] = "torch-cpu-some-other-isa"
    (store / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(StoreError, match=f"{name}.*packing 'torch-cpu-some-other-isa' is not one of nibbles"):
        moestream.load(store, "64MiB")
    manifest["format_version"] = 3  # a version 3 store packed for another CPU's kernels: upgrade it
    other = "torch-cpu-avx512" if "avx2" in torch_int4_packing() else "torch-cpu-avx2"
    for fmt in manifest["dense_quantization"].values():
        if fmt["format"] == "int4":
            fmt["packing"] = other
    (store / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(StoreError, match=f"are in torch's {other} layout.*moestream upgrade"):
        moestream.load(store, "64MiB")


def test_a_store_quantizing_a_module_the_model_lacks_is_refused(tmp_path):
    ckpt = save_checkpoint(make_model("qwen3_moe", seed=7, **TINY["qwen3_moe"]), tmp_path / "hf")
    store = moestream.convert(ckpt, tmp_path / "store", dense_dtype="int8", progress=False)
    manifest = json.loads((store / MANIFEST).read_text())
    manifest["dense_quantization"]["model.layers.0.input_layernorm"] = {"format": "int8", "group_size": None, "packing": None}
    (store / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(StoreError, match="input_layernorm, which is not a plain linear layer"):
        moestream.load(store, "64MiB")


def test_an_unknown_dense_dtype_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match="unknown dense dtype 'int3'.*float, int8, int6, int4"):
        moestream.convert(tmp_path, tmp_path / "store", dense_dtype="int3")


@pytest.mark.parametrize("inputs", [72, 33, 136])
def test_the_int8_kernel_is_right_for_inputs_that_are_not_a_multiple_of_16(inputs):
    # torch's bf16 int8 kernel gets these wrong (or crashes); kernels.py routes them through float32.
    fmt = QuantFormat.make("int8")
    g = torch.Generator().manual_seed(inputs)
    w = torch.randn(64, inputs, generator=g) * 0.02
    q = quantize(w, fmt)
    layer = QuantizedLinear(inputs, 64, None, fmt)
    layer.load_state_dict({k.removeprefix("w."): v for k, v in pack(q, fmt, "w").items()}, assign=True)
    plan_linears(layer, int8_activations=False, cpu_kernels=True, dtype=torch.bfloat16)
    assert layer.plan.matmul.func is kernels._int8_in_float32  # chosen once, at load, from K
    x = torch.randn(3, inputs, generator=g).bfloat16()
    expected = x.double() @ reference_dequantize(q, fmt).T
    relative = ((layer(x).double() - expected).norm() / expected.norm()).item()
    assert relative <= 1e-2, relative


def test_a_tied_lm_head_stays_as_the_embeddings(tmp_path):
    model = make_model("qwen3_moe", seed=8, **dict(TINY["qwen3_moe"], tie_word_embeddings=True))
    store = moestream.convert(save_checkpoint(model, tmp_path / "hf"), tmp_path / "store", dense_dtype="int8", progress=False)
    assert "lm_head" not in Store(store).manifest.dense
    loaded, _ = moestream.load(store, "1MiB")
    assert loaded.get_output_embeddings().weight is loaded.get_input_embeddings().weight


def test_quantized_weights_get_aligned_memory():
    # safetensors places tensors at file offsets; the bf16 int8 kernel crashed on a weight 8 bytes off.
    fmt = QuantFormat.make("int8")
    g = torch.Generator().manual_seed(12)
    q = quantize(torch.randn(64, 256, generator=g), fmt)
    packed = pack(q, fmt, "w")
    backing = torch.empty(64 * 256 + 8, dtype=torch.int8)
    misaligned = backing[8:].view(64, 256)
    misaligned.copy_(packed["w.qweight"])
    layer = QuantizedLinear(256, 64, None, fmt)
    layer.load_state_dict({"qweight": misaligned, "scales": packed["w.scales"]}, assign=True)
    assert layer.qweight.data_ptr() % 64 != 0
    container = torch.nn.Sequential(layer)
    plan_linears(container, int8_activations=False, cpu_kernels=True, dtype=torch.bfloat16)
    align_weights(container)
    assert layer.qweight.data_ptr() % 64 == 0 and torch.equal(layer.qweight, packed["w.qweight"])
    x = torch.randn(3, 256, generator=g).bfloat16()
    expected = x.double() @ reference_dequantize(q, fmt).T
    assert ((layer(x).double() - expected).norm() / expected.norm()).item() <= 1e-2
