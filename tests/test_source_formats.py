"""Quantized sources convert to what the format defines: FP8 block-scaled (float64 reference of the
definition) and MXFP4 (transformers' own dequantization), and the streamed model runs on those weights."""

import json
import math

import torch
from safetensors.torch import load_file, save_file
from tiny import TINY
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

import moestream
from moestream.conversion.quant import QuantFormat, pack, quantize
from moestream.conversion.store import DTYPES, Store
from moestream.conversion.synthetic import make_model, save_checkpoint


def _records(store) -> dict[tuple[str, int, str], torch.Tensor]:
    """Every tensor of every expert record, read back from the store files."""
    manifest = Store(store).manifest
    out = {}
    for layer in manifest.layers:
        data = (store / layer.file).read_bytes()
        for e, off in enumerate(layer.offsets):
            for t in layer.layout.tensors:
                raw = bytearray(data[off + t.offset : off + t.offset + t.nbytes])
                out[(layer.module, e, t.name)] = torch.frombuffer(raw, dtype=DTYPES[t.dtype]).view(t.shape)
    return out


def _fp8_reference(q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """The format's definition in float64: each 128x128 block of e4m3 values times its block's scale."""
    out = q.to(torch.float64)
    rows, cols = out.shape
    for i in range(math.ceil(rows / 128)):
        for j in range(math.ceil(cols / 128)):
            out[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] *= scale_inv[i, j].double()
    return out


def _quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = w.shape
    scale = torch.empty(math.ceil(rows / 128), math.ceil(cols / 128))
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            block = w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128]
            scale[i, j] = block.abs().max().clamp(min=1e-12) / 448.0
            q[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] = (block / scale[i, j]).to(torch.float8_e4m3fn)
    return q, scale


def _fp8_checkpoint(tmp_path):
    """A Qwen3-MoE checkpoint whose experts and one attention projection are FP8 block-scaled."""
    # Shapes that are not multiples of 128, so partial edge blocks are exercised.
    model = make_model(
        "qwen3_moe", seed=21, **dict(TINY["qwen3_moe"], hidden_size=160, moe_intermediate_size=136, head_dim=40, num_experts=4)
    )
    ckpt = save_checkpoint(model, tmp_path / "hf")
    tensors = load_file(ckpt / "model.safetensors")
    quantized = {}
    for key in list(tensors):
        if ".experts." in key or key.endswith("self_attn.o_proj.weight"):
            q, scale = _quantize_fp8(tensors.pop(key).float())
            tensors[key], tensors[key + "_scale_inv"] = q, scale
            quantized[key] = (q, scale)
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((ckpt / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    (ckpt / "config.json").write_text(json.dumps(config))
    return model, ckpt, quantized


def test_fp8_block_scaled_source(tmp_path):
    model, ckpt, quantized = _fp8_checkpoint(tmp_path)
    store = moestream.convert(ckpt, tmp_path / "store", experts_dtype="fp32", progress=False)
    assert "quantization_config" not in Store(store).manifest.model_config
    records = _records(store)
    for (module, e, name), value in records.items():
        layer = module.rsplit(".experts", 1)[0]
        gate, up, down = (quantized[f"{layer}.experts.{e}.{p}.weight"] for p in ("gate_proj", "up_proj", "down_proj"))
        if name == "gate_up_proj":
            expected = torch.cat([_fp8_reference(*gate), _fp8_reference(*up)])
        else:
            expected = _fp8_reference(*down)
        assert torch.allclose(value.double(), expected, rtol=1e-6, atol=1e-7), (module, e, name)

    # End to end: the streamed model equals transformers' forward on the same dequantized weights.
    reference = model
    with torch.no_grad():
        for key, (q, scale) in quantized.items():
            if ".experts." not in key:
                reference.get_parameter(key).copy_(_fp8_reference(q, scale).float())
        for module_name, e, name in records:
            reference.get_parameter(f"{module_name}.{name}")[e].copy_(records[(module_name, e, name)])
    streamed, _ = moestream.load(store, Store(store).manifest.expert_bytes // 2)
    ids = torch.randint(0, 250, (1, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert (reference(ids).logits - streamed(ids).logits).abs().max() <= 1e-5


def _mxfp4_checkpoint(tmp_path):
    """A gpt-oss checkpoint whose experts are MXFP4 ([E, out, in/32, 16] blocks + E8M0 scales)."""
    config = dict(TINY["gpt_oss"], hidden_size=64, intermediate_size=32, head_dim=16)
    model = make_model("gpt_oss", seed=8, **config)
    ckpt = save_checkpoint(model, tmp_path / "hf")
    tensors = load_file(ckpt / "model.safetensors")
    g = torch.Generator().manual_seed(9)
    packed = {}
    for key in [k for k in tensors if k.endswith("experts.gate_up_proj") or k.endswith("experts.down_proj")]:
        experts, cols, rows = tensors.pop(key).shape  # module layout [E, in, out]; MXFP4 stores [E, out, in/32, 16]
        blocks = torch.randint(0, 256, (experts, rows, cols // 32, 16), dtype=torch.uint8, generator=g)
        scales = torch.randint(120, 131, (experts, rows, cols // 32), dtype=torch.uint8, generator=g)
        tensors[key + "_blocks"], tensors[key + "_scales"] = blocks, scales
        packed[key] = (blocks, scales)
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"],
    }
    (ckpt / "config.json").write_text(json.dumps(cfg))
    return model, ckpt, packed


def test_mxfp4_source_matches_transformers_dequantization(tmp_path):
    model, ckpt, packed = _mxfp4_checkpoint(tmp_path)
    store = moestream.convert(ckpt, tmp_path / "store", experts_dtype="fp32", progress=False)
    records = _records(store)
    for key, (blocks, scales) in packed.items():
        module, name = key.rsplit(".", 1)
        expected = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # transformers' own
        for e in range(blocks.shape[0]):
            assert torch.equal(records[(module, e, name)], expected[e]), (key, e)

    streamed, _ = moestream.load(store, Store(store).manifest.expert_bytes // 2)
    ids = torch.randint(0, 250, (1, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        for (module, e, name), value in records.items():
            model.get_parameter(f"{module}.{name}")[e].copy_(value)
        assert (model(ids).logits - streamed(ids).logits).abs().max() <= 1e-5


def test_quantized_sources_requantize_from_their_decoded_values(tmp_path):
    """FP8 -> int8 and MXFP4 -> int4: each record is exactly the low-bit format of the decoded source
    (float64 definition for FP8, transformers' own dequantization for MXFP4), one expert at a time."""
    _, fp8, quantized = _fp8_checkpoint(tmp_path / "fp8")
    records = _records(moestream.convert(fp8, tmp_path / "fp8.moe", experts_dtype="int8", progress=False))
    fmt = QuantFormat.make("int8")
    for (module, e, name), value in records.items():
        if not name.startswith("down_proj."):
            continue
        q, scale = quantized[f"{module.rsplit('.experts', 1)[0]}.experts.{e}.down_proj.weight"]
        assert torch.equal(value, pack(quantize(_fp8_reference(q, scale).float(), fmt), fmt, "down_proj")[name])

    _, mxfp4, packed = _mxfp4_checkpoint(tmp_path / "mxfp4")
    records = _records(moestream.convert(mxfp4, tmp_path / "mxfp4.moe", experts_dtype="int4", progress=False))
    fmt = QuantFormat.make("int4")
    for key, (blocks, scales) in packed.items():
        module, name = key.rsplit(".", 1)
        decoded = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out], gpt-oss's layout
        for e in range(blocks.shape[0]):
            expected = pack(quantize(decoded[e].t(), fmt), fmt, name)  # quantized as [out, in]
            for part, tensor in expected.items():
                assert torch.equal(records[(module, e, part)], tensor), (key, e, part)
