"""Attention as the model's own attention function: the compiled flash-decoding kernel (decode_attention.h)
for one query position over the KV cache, on a CPU with AVX-512 the compiled flash kernel for a prompt in
float32 or (with AVX-512 BF16) bf16 (prefill_attention.h), transformers' sdpa for everything else.

transformers looks a model's attention function up by `config._attn_implementation` in its
AttentionInterface on every call. `install` registers `attend` there as "moestream" (with sdpa's mask
function) and points the model's config at it, so the model's own code runs the kernel: a lone row,
the batched decode step (its padding mask included) and the fused one-token attention (fused.py, which
then calls the same kernel and so still gives the model's own bits). A prompt runs the prefill kernel: at
4k tokens torch's sdpa took half of a bf16 prefill, at a fraction of what BF16's dot products or the FMA
units do (docs/BENCHMARKS.md, "Prefill attention"). Any call the kernels
do not cover (a sliding window, softcapping, attention sinks, dropout, another device or dtype, an additive
mask) goes to sdpa as before. On the CPU a prompt of a grouped-query model runs torch's sdpa on the key and value heads as they
are (`enable_gqa`): transformers copies them once per query head there first (its `repeat_kv`, which it skips
on CUDA only where no mask is given), and at long context that copy costs more than the attention (a few
tokens over a 12k-token cached prefix at the Qwen3-30B-A3B shape: docs/BENCHMARKS.md, kv-tier-30b-shape,
before and after). The same kernel then runs on the same numbers: its bits are sdpa's (tests/test_attention.py).

The kernels sum in another order than sdpa and compute exp by a polynomial (the prefill kernel in bf16 also
rounds the softmax's weights to bf16, as torch's bf16 flash kernel does), so their output differs from sdpa's in the
last bits (tests/test_attention.py bounds both against float64; `moestream eval --attention sdpa` prices
them). `--attention sdpa` keeps transformers' own.

An 8-bit KV cache (`--kv-cache-dtype int8`, llama.cpp's `-ctk/-ctv q8_0` in spirit) holds each position's
row of a head as int8 codes followed by the bytes of its float32 scale (`pack_int8`): one tensor, so that
whatever cuts, joins or copies a cache's rows (batching, the prefix cache) carries the scales along. The
kernel reads those rows as they are, about half the bytes of bf16; a call it does not cover (a prompt)
gets them widened back for sdpa. Only a model whose attention function is the kernel gets such a cache.
"""

from __future__ import annotations

import inspect
import re

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ...choices import ATTENTION, KV_CACHE_DTYPES
from ...errors import UsageError
from ...native import fused_build

NAME = "moestream"  # its name in transformers' AttentionInterface


# Bytes of the float32 scale that follows an 8-bit row's codes.
SCALE_BYTES = 4


def pack_int8(x: torch.Tensor) -> torch.Tensor:
    """[..., D] float -> [..., D + 4] int8: each row's codes round(x / scale) with scale = absmax / 127, then the
    scale's bytes. A row of zeros (left padding) packs to zeros, which unpack to zeros."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True) / 127.0
    codes = torch.round(x / torch.where(scale > 0, scale, 1.0)).clamp_(-127, 127).to(torch.int8)
    return torch.cat([codes, scale.view(torch.int8)], dim=-1)


def unpack_int8(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The rows `pack_int8` packed, widened back: codes times scale, in `dtype`."""
    scale = packed[..., -SCALE_BYTES:].contiguous().view(torch.float32)
    return (packed[..., :-SCALE_BYTES].float() * scale).to(dtype)


def attend(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None, **kwargs):
    """transformers' attention-function signature: query [B, H, Q, D], key and value [B, KVH, T, D] (or an
    8-bit cache's packed rows) -> ([B, Q, H, D], None). One query position per row runs the kernel;
    anything else runs sdpa."""
    mark_read(module, key, value)
    ext = fused_build.extension()
    if ext is not None and _covered(query, key, value, attention_mask, dropout, kwargs):
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        mask = attention_mask[..., -key.shape[2] :] if attention_mask is not None else None
        return ext.decode_attention(query, key, value, mask, scale).transpose(1, 2), None
    if key.dtype == torch.int8:
        key, value = unpack_int8(key, query.dtype), unpack_int8(value, query.dtype)
    if ext is not None and _prompt_covered(ext, query, key, value, attention_mask, dropout, kwargs):
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        key, value, causal = _causal_keys(module, query, key, value, attention_mask, kwargs.get("is_causal"))
        mask = attention_mask[..., : key.shape[2]] if attention_mask is not None else None
        return ext.prefill_attention(query, key, value, mask, scale, causal), None
    if _grouped_prompt_on_cpu(module, query, key, value, kwargs):
        return _grouped_sdpa(module, query, key, value, attention_mask, dropout, scaling, kwargs.get("is_causal")), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def _grouped_prompt_on_cpu(module, query, key, value, kwargs: dict) -> bool:
    """Whether sdpa may take this call's key and value heads as they are: a grouped-query model's prompt on
    the CPU, with nothing transformers' sdpa function would add (a position bias, softcapping, attention
    weights asked for)."""
    return (
        query.device.type == "cpu"
        and query.shape[2] > 1
        and getattr(module, "num_key_value_groups", 1) > 1
        and key.shape[-1] == value.shape[-1]
        and kwargs.get("position_bias") is None
        and kwargs.get("softcap") is None
        and not kwargs.get("output_attentions", False)
    )


def _grouped_sdpa(module, query, key, value, mask, dropout: float, scaling: float | None, is_causal: bool | None):
    """transformers' sdpa_attention_forward for `_grouped_prompt_on_cpu` calls, with grouped-query heads given
    to torch as they are instead of repeated: causal by sdpa's flag only where no mask is given (then the keys
    are cut to the queries', as transformers does), [B, Q, H, D] out."""
    key, value, is_causal = _causal_keys(module, query, key, value, mask, is_causal)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling, is_causal=is_causal, enable_gqa=True
    )
    return out.transpose(1, 2).contiguous()


def _causal_keys(module, query, key, value, mask, is_causal: bool | None):
    """transformers' sdpa rule for a prompt: causal by the flag (the call's, else the module's) only where no
    mask is given, and then the keys cut to the queries' (a static cache's room beyond them), as its sdpa
    function cuts them -> (key, value, causal)."""
    causal = mask is None and (is_causal if is_causal is not None else getattr(module, "is_causal", True))
    if causal and key.shape[2] > query.shape[2]:
        key, value = key[:, :, : query.shape[2]], value[:, :, : query.shape[2]]
    return key, value, causal


def mark_read(module, key: torch.Tensor, value: torch.Tensor) -> None:
    """Note which keys and values the attention module's call read: `packable_layers` compares them with its
    cache layer's, to find the layers whose cached tensors reach the attention as they are. (Into the
    module's __dict__: nn.Module's __setattr__ costs a microsecond a call.)"""
    module.__dict__[_READ] = (key.data_ptr(), value.data_ptr())


_READ = "_moestream_kv_read"


def packable_layers(model, cache) -> list[int]:
    """The cache layers an 8-bit cache may pack: those whose keys and values the last forward pass handed to
    the model's attention function (or fused step) as they are. A model that transforms them in between (MLA
    widens its latent cache per head) keeps that layer in its dtype: its code could not read packed rows."""
    modules = getattr(model, "_moestream_attention_modules", {})
    found = []
    for index, layer in enumerate(getattr(cache, "layers", ())):
        module = modules.get(index)
        if module is None or not getattr(layer, "is_initialized", False):
            continue
        if module.__dict__.get(_READ) == (layer.keys.data_ptr(), layer.values.data_ptr()):
            found.append(index)
    return found


def _covered(query, key, value, mask, dropout: float, kwargs: dict) -> bool:
    """Whether the kernel computes this call: one query per row on the CPU, keys and values in float32,
    bf16 or packed int8 with their head dimension contiguous, no dropout, no extras (sliding window, softcap, sinks), a
    mask (if any) of one row per sequence."""
    if (
        query.shape[2] != 1
        or query.device.type != "cpu"
        or dropout
        or key.dtype not in (torch.float32, torch.bfloat16, torch.int8)
    ):
        return False
    if value.dtype != key.dtype or key.shape != value.shape or key.stride(-1) != 1 or value.stride(-1) != 1:
        return False
    if key.shape[-1] != query.shape[-1] + (SCALE_BYTES if key.dtype == torch.int8 else 0):
        return False
    if any(kwargs.get(name) is not None for name in ("sliding_window", "softcap", "s_aux", "sinks")):
        return False
    if mask is not None and (mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2] != 1 or mask.shape[-1] < key.shape[2]):
        return False
    return True


def _prompt_covered(ext, query, key, value, mask, dropout: float, kwargs: dict) -> bool:
    """Whether the prefill kernel computes this call: a prompt (more than one query) on a CPU that runs it
    (AVX-512; for bf16 with BF16), query, keys and values all in bf16 or all in float32 with their head dimension
    contiguous and a multiple of 32 up to 256, no dropout, no extras (sliding window, softcap, sinks, a position bias, the weights asked for),
    a mask (if any) of bools [B or 1, 1, Q, T]."""
    if query.shape[2] < 2 or query.device.type != "cpu" or dropout or query.dtype not in (torch.bfloat16, torch.float32):
        return False
    if any(t.dtype != query.dtype or t.stride(-1) != 1 for t in (query, key, value)) or key.shape != value.shape:
        return False
    if not ext.prefill_attention_ready(query.dtype == torch.bfloat16):
        return False
    dim = query.shape[-1]
    if key.shape[-1] != dim or dim % 32 or dim > 256 or query.shape[1] % key.shape[1]:
        return False
    if any(kwargs.get(name) is not None for name in ("sliding_window", "softcap", "s_aux", "sinks", "position_bias")):
        return False
    if kwargs.get("output_attentions", False):
        return False
    if mask is None:
        return True
    return (
        mask.dtype == torch.bool
        and mask.dim() == 4
        and mask.shape[1] == 1
        and mask.shape[2] == query.shape[2]
        and mask.shape[3] >= key.shape[2]
        and mask.shape[0] in (1, query.shape[0])
    )


def install(model, choice: str | None, on_gpu: bool, kv_cache_dtype: str = "auto") -> str:
    """Make the kernel the model's attention function where it can be ("auto"), or keep sdpa ("sdpa");
    returns what was decided, for the fast-paths line. kv_cache_dtype "int8" asks for an 8-bit KV cache
    (`quantizes_kv`), which only the kernel reads: a UsageError says why where it is not the model's."""
    choice = "auto" if choice is None else choice
    if choice not in ATTENTION:
        raise UsageError(f"attention must be one of {', '.join(ATTENTION)}, not {choice!r}")
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise UsageError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, not {kv_cache_dtype!r}")
    note = _install(model, choice, on_gpu)
    if kv_cache_dtype == "int8":
        if not note.startswith(KERNEL):
            raise UsageError(
                f"an 8-bit KV cache is read by moestream's attention kernel only, and this model keeps {note}; "
                "drop --kv-cache-dtype int8 (or --attention sdpa) to run it"
            )
        model._moestream_kv_cache_dtype = "int8"
        model._moestream_attention_modules = {
            m.layer_idx: m
            for m in model.modules()
            if type(m).__name__.endswith("Attention") and isinstance(getattr(m, "layer_idx", None), int)
        }
        note += "; 8-bit KV cache for the layers whose attention reads the cached rows as they are"
    return note


def quantizes_kv(model) -> bool:
    """Whether the model was loaded with an 8-bit KV cache: its caches' full-attention layers whose tensors
    reach the attention as they are (`packable_layers`) are to hold packed rows (generation/kv_layer.py) once
    a forward pass has made them."""
    return getattr(model, "_moestream_kv_cache_dtype", None) == "int8"


KERNEL = "flash-decoding kernel for one query"  # what `install`'s note starts with when the kernels are in


def _install(model, choice: str, on_gpu: bool) -> str:
    if choice == "sdpa":
        return "sdpa, as chosen"
    if on_gpu:
        return "sdpa: the model runs on a GPU"
    if fused_build.extension() is None:
        return "sdpa: no compiled kernels"
    configs = [c for c in _configs(model.config) if getattr(c, "_attn_implementation", None) == "sdpa"]
    if not configs:
        return f"the model's own ({getattr(model.config, '_attn_implementation', None)})"
    classes = {type(m) for m in model.modules()}  # (each class's source read once, not once per layer)
    branching = sorted(cls.__name__ for cls in classes if _branches_on_the_name(cls))
    if branching:  # its code would take another path under another name (e.g. sparse attention's indices)
        return f"sdpa: {', '.join(branching)} choose what to compute by the attention's name"
    AttentionInterface.register(NAME, attend)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    for config in configs:
        config._attn_implementation = NAME
    ext = fused_build.extension()
    if ext.prefill_attention_ready(True):
        return f"{KERNEL}, flash kernel for bf16 and float32 prompts, sdpa for others"
    if ext.prefill_attention_ready(False):
        return f"{KERNEL}, flash kernel for float32 prompts (bf16 ones need AVX-512 BF16), sdpa for others"
    return f"{KERNEL}, sdpa for prompts (their kernel needs AVX-512)"


# `config._attn_implementation == "sdpa"`, `... in ("eager", "sdpa")`, `!= "eager"`: code that decides by the name.
_NAME_TEST = re.compile(r"_attn_implementation\s*(?:==|!=|\bin\b|\bnot\s+in\b)")


def _branches_on_the_name(cls) -> bool:
    """Whether the module's own source (its forward) compares the attention implementation's name: then a
    name other than "sdpa" would change what it computes, not only which function it calls."""
    if not cls.__name__.endswith("Attention"):
        return False
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return True  # unknown: keep sdpa
    return _NAME_TEST.search(source) is not None


def _configs(config) -> list:
    """A config and its sub-configs (a multimodal model's text config holds the attention's choice)."""
    found = [config]
    for name in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, name, None)
        if sub is not None:
            found.extend(_configs(sub))
    return found
