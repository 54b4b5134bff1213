"""Byte arithmetic of a model, from its store or from its config alone: what stays resident, what
streams, what a token can cost, what a budget buys (`inspect`, `plan`, `bench`, `demo`).

Also the one place where a model config's MoE fields are read, under every family's names (routed_top_k,
routed_experts): a dict (a store manifest's model_config, a config.json) or a transformers PretrainedConfig.

Two sizes of an expert record are kept apart everywhere: its payload bytes (the tensor bytes it holds) and
its stride bytes (as stored, 4 KiB-aligned: what one read and one cache slot cost).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import torch

from ..errors import UsageError
from .quant import DEFAULT_GROUP_SIZE, QuantFormat, dense_formats, expert_record_specs, group_for
from .store import Manifest, RecordLayout

BITS = (16, 8, 6, 4, 3, 2)  # `plan --bits`: bf16 experts, int8, int6, int4, int3, int2

# Family names of the number of routed experts one token uses per MoE layer, first match wins.
# hunyuan_v1_moe and longcat_flash say moe_topk (hunyuan's may be a per-layer list), dbrx moe_top_k,
# ernie4_5_moe moe_k, bailing_hybrid and kimi_linear num_experts_per_token, gemma4 top_k_experts; most
# families num_experts_per_tok.
TOP_K_FIELDS = ("num_experts_per_tok", "num_experts_per_token", "top_k_experts", "moe_topk", "moe_top_k", "moe_k")
# Family names of the number of routed experts per MoE layer (shared experts are not counted).
EXPERTS_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def _text_config(config: Any) -> Any:
    """The language model's part of a (possibly multimodal) config."""
    if isinstance(config, Mapping):
        text = config.get("text_config")
        return text if isinstance(text, Mapping) else config
    return getattr(config, "get_text_config", lambda: config)()


def _field(config: Any, names: tuple[str, ...]) -> Any:
    config = _text_config(config)
    for name in names:
        value = config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)
        if value:
            return value
    return None


def _largest(value: Any) -> int | None:
    if isinstance(value, (list, tuple)):  # a per-layer value: the largest layer sizes what a token can need
        value = max((int(v) for v in value if v), default=None)
    return int(value) if value else None


def routed_top_k(config: Any) -> int:
    """Routed experts one token uses in one MoE layer (1 when the config does not say), for a dict or a
    transformers PretrainedConfig of any family; a per-layer list gives its largest entry."""
    return _largest(_field(config, TOP_K_FIELDS)) or 1


def routed_experts(config: Any) -> int | None:
    """Routed experts per MoE layer under the family's name, or None when the config does not say."""
    return _largest(_field(config, EXPERTS_FIELDS))


# Layer types whose KV cache grows with every position, and ones bounded by a window; other types (linear
# attention, Mamba, convolutions) keep a fixed state and add nothing per position.
FULL_ATTENTION_TYPES = ("full_attention", "attention", "global_attention")
SLIDING_TYPES = ("sliding_attention", "local_attention", "chunked_attention")
# What an 8-bit KV cache adds to each row of a head: its float32 scale (core/compute/attention.py, pack_int8).
INT8_ROW_BYTES = 4


@dataclass(frozen=True)
class KVSizes:
    """A decoding sequence's KV cache by the config: per position of context, the key and value elements
    its growing layers add (`elements`) in `rows` rows of a head, and the sliding-window layers' elements per
    position, which stop growing at `window` - 1 positions. `packable`: an 8-bit cache packs the growing
    layers' rows (not MLA's latent cache, which the model widens before its attention reads it)."""

    elements: int
    rows: int
    sliding_elements: int = 0
    window: int = 0
    packable: bool = True

    def nbytes(self, positions: int, element_bytes: int = 2, int8: bool = False) -> int:
        """Bytes after `positions` positions, elements of `element_bytes` (2: bf16), the growing layers'
        rows packed with `int8` (sliding windows stay in the dtype)."""
        growing = self.elements + INT8_ROW_BYTES * self.rows if int8 and self.packable else self.elements * element_bytes
        # (a sliding-window layer keeps its last window - 1 positions: the new one makes the window)
        return positions * growing + min(positions, self.window - 1) * self.sliding_elements * element_bytes

    @staticmethod
    def of_config(config: Any) -> "KVSizes | None":
        """From a config dict or PretrainedConfig: grouped-query attention (num_key_value_heads x head_dim,
        per layer type) and multi-head latent attention (transformers caches the latent, kv_lora_rank, and
        the rotary key, qk_rope_head_dim, once per layer); None where the config says neither, or has layer
        types this does not know."""
        config = _text_config(config)

        def get(name: str) -> Any:
            return config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)

        layers, heads = get("num_hidden_layers"), get("num_attention_heads")
        if not isinstance(layers, int) or not isinstance(heads, int) or heads <= 0:
            return None
        latent = get("kv_lora_rank")
        if latent:
            per_layer, rows = latent + (get("qk_rope_head_dim") or 0), 2
        else:
            kv_heads = get("num_key_value_heads") or heads
            head_dim = get("head_dim") or (get("hidden_size") or 0) // heads
            per_layer, rows = 2 * kv_heads * head_dim, 2 * kv_heads
        if per_layer <= 0:
            return None
        types = get("layer_types") or ["full_attention"] * layers
        full = sum(t in FULL_ATTENTION_TYPES for t in types)
        sliding = sum(t in SLIDING_TYPES for t in types)
        known = full + sliding + sum("linear" in t or "mamba" in t or t == "conv" for t in types)
        window = get("sliding_window") or get("attention_chunk_size") or 0
        if known != len(types) or (sliding and not window):
            return None
        return KVSizes(full * per_layer, full * rows, sliding * per_layer, int(window), packable=not latent)


@dataclass(frozen=True)
class ModelSizes:
    """The bytes of a model as moestream stores and streams it, from a store's manifest (`of_store`) or
    from a config alone (`of_config`, what `plan` prints before anything is downloaded); the two agree
    to the byte on the experts (tests/test_plan.py).

    Per MoE layer: the payload of one record (the tensor bytes it holds) and its stride (as stored, 4 KiB
    aligned). A read and a cache slot cost the stride; every slot is as large as the largest stride."""

    resident_bytes: int  # a store: its resident files as stored; a config: the tensor bytes of those weights
    layer_payload_bytes: tuple[int, ...]  # one record's tensor bytes, per MoE layer
    layer_stride_bytes: tuple[int, ...]  # one record as stored (4 KiB aligned), per MoE layer
    layer_experts: tuple[int, ...]  # routed experts, per MoE layer
    top_k: int  # routed experts one token uses per layer (routed_top_k)
    model_type: str = ""
    # Known from a config only (of_config):
    dtype: str = ""  # resident weights' dtype
    expert_format: str = ""  # the experts' storage format, as `inspect` names it
    weights_per_expert: int = 0  # matrix elements of one expert (largest layer)
    bits: int = 0
    embedding_bytes: int = 0  # the input embedding, when it is not tied to the LM head: one row read per token

    @staticmethod
    def of_store(manifest: Manifest) -> "ModelSizes":
        config = manifest.model_config
        return ModelSizes(
            resident_bytes=manifest.resident_bytes,
            layer_payload_bytes=tuple(layer.layout.nbytes for layer in manifest.layers),
            layer_stride_bytes=tuple(layer.layout.stride for layer in manifest.layers),
            layer_experts=tuple(layer.num_experts for layer in manifest.layers),
            top_k=routed_top_k(config),
            model_type=str(config.get("model_type") or ""),
        )

    @staticmethod
    def of_config(config, bits: int = 16, group_size: int | None = None, dense_dtype: str = "float") -> "ModelSizes":
        """Exact sizes from a transformers config: the model built on the meta device (no memory), each
        record laid out by the converter's own code at the format `bits` gives (expert_format), and the
        resident linears quantized as `convert --dense-dtype` would."""
        from .skeleton import build_skeleton, dense_linears, expert_parameters, experts_modules, model_dtype

        fmt, float_dtype, name = expert_format(bits, group_for(f"int{bits}", group_size))
        dtype = model_dtype(config)
        model = build_skeleton(config, dtype)
        expert_names, strides, payloads, counts, weights = set(), [], [], [], 0
        for mname, module in experts_modules(model):
            params = expert_parameters(module)
            expert_names |= {f"{mname}.{p}" for p, _ in params}
            shapes = {p: tuple(t.shape[1:]) for p, t in params}
            # Biases (and every parameter of a float layer) keep a float dtype: the checkpoint's, as convert does.
            layout = RecordLayout.pack(expert_record_specs(shapes, float_dtype or dtype, fmt, module.is_transposed, mname))
            strides.append(layout.stride)
            payloads.append(layout.nbytes)
            counts.append(module.num_experts)
            weights = max(weights, sum(int(np.prod(s)) for s in shapes.values() if len(s) == 2))
        tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
        linears = dense_linears(model)
        dense = dense_formats(
            [(n, m.out_features, m.in_features, head) for n, m, head in linears],
            dense_dtype,
            group_for(dense_dtype, group_size),
            group_for("int6", group_size),
        )
        resident = sum(
            t.numel() * t.element_size()
            for n, t in model.state_dict().items()
            if n not in expert_names and n not in tied and n.removesuffix(".weight") not in dense
        )
        for linear_name, m, _ in linears:
            if linear_name in dense:
                specs = dense[linear_name].record_specs(linear_name, m.out_features, m.in_features)
                resident += sum(dtype.itemsize * int(np.prod(shape)) for _, dtype, shape in specs)
        embedding = model.get_input_embeddings().weight
        output = model.get_output_embeddings()
        untied = output is None or output.weight is not embedding
        return ModelSizes(
            resident_bytes=resident,
            layer_payload_bytes=tuple(payloads),
            layer_stride_bytes=tuple(strides),
            layer_experts=tuple(counts),
            top_k=routed_top_k(config),
            model_type=config.model_type,
            dtype=str(dtype).removeprefix("torch."),
            expert_format=name,
            weights_per_expert=weights,
            bits=bits,
            embedding_bytes=embedding.numel() * embedding.element_size() if untied else 0,
        )

    @property
    def moe_layers(self) -> int:
        return len(self.layer_stride_bytes)

    @property
    def experts(self) -> int:
        """(layer, expert) records."""
        return sum(self.layer_experts)

    @property
    def experts_per_layer(self) -> int:
        return max(self.layer_experts)

    @property
    def expert_payload_bytes(self) -> int:
        """Tensor bytes of every expert record (the manifest's expert_bytes)."""
        return sum(b * e for b, e in zip(self.layer_payload_bytes, self.layer_experts))

    @property
    def expert_stride_bytes(self) -> int:
        """Every expert record as stored: the expert files' size."""
        return sum(b * e for b, e in zip(self.layer_stride_bytes, self.layer_experts))

    @property
    def stride_bytes(self) -> int:
        """One cache slot and the most one read costs: the largest record as stored."""
        return max(self.layer_stride_bytes)

    @property
    def experts_per_token(self) -> int:
        """Expert reads a token makes when nothing is cached."""
        return self.top_k * self.moe_layers

    @property
    def worst_case_bytes_per_token(self) -> int:
        """Every routed expert of every layer missing the cache."""
        return self.experts_per_token * self.stride_bytes

    @property
    def minimum_budget(self) -> int:
        """The smallest cache: what one token needs in one layer."""
        return self.top_k * self.stride_bytes

    @property
    def all_experts_budget(self) -> int:
        """The cache budget that holds every expert (one slot each)."""
        return self.experts * self.stride_bytes

    @property
    def nominal_bytes_per_expert(self) -> float:
        """The paper arithmetic: weights x bits / 8, without scales, biases or alignment (of_config only)."""
        return self.weights_per_expert * self.bits / 8

    def cache_slots(self, budget: int) -> int:
        return max(0, budget) // self.stride_bytes

    def cached_fraction(self, budget: int) -> float:
        return min(1.0, self.cache_slots(budget) / self.experts)


def expert_format(bits: int, group_size: int = DEFAULT_GROUP_SIZE) -> tuple[QuantFormat | None, torch.dtype | None, str]:
    """--bits -> (quantized format or None, float dtype or None, name as `inspect` shows it)."""
    if bits not in BITS:
        raise UsageError(
            f"--bits must be one of {', '.join(map(str, BITS))} (16: bf16 experts, 8: int8, 6/4/3/2: int6/int4/int3/int2)"
        )
    if bits == 16:
        return None, torch.bfloat16, "bfloat16"
    fmt = QuantFormat.make(f"int{bits}", group_size)
    return fmt, None, fmt.name if bits == 8 else f"{fmt.name}-g{group_size}"
