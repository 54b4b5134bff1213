"""`moestream inspect`: the sizes of a store and what a memory budget buys (also printed after `convert`)."""

from __future__ import annotations

import os

from ..units import format_bytes


def print_inspect(store: str | os.PathLike, budget: int | None, gpu_budget: int | None = None) -> int:
    from ..conversion.sizes import ModelSizes
    from ..conversion.store import Store

    s = Store(store)
    sizes = ModelSizes.of_store(s.manifest)
    cfg = s.manifest.model_config
    rows = [
        ("model type", cfg.get("model_type")),
        ("experts dtype", s.manifest.experts_dtype),
        ("dense dtype", _describe_dense(s.manifest)),
        ("format", _describe_format(s.manifest)),
        ("resident bytes", format_bytes(sizes.resident_bytes)),
        (
            "expert bytes",
            f"{format_bytes(sizes.expert_payload_bytes)} in {sizes.experts} records "
            f"({sizes.moe_layers} layers x {sizes.experts_per_layer})",
        ),
        ("bytes per expert", f"{format_bytes(sizes.stride_bytes)} (as stored, 4 KiB aligned)"),
        ("experts per token", f"{sizes.experts_per_token} ({sizes.top_k} per layer)"),
        ("worst-case read per token", format_bytes(sizes.worst_case_bytes_per_token)),
        ("minimum --memory", format_bytes(sizes.minimum_budget)),
    ]
    rows += _gguf_rows(s.manifest)
    rows += _kv_rows(cfg)
    budgets = [budget] if budget is not None else [b for b in (2**28, 2**30, 2**32, 2**34) if b >= sizes.minimum_budget]
    for b in budgets:
        rows.append(
            (
                f"--memory {format_bytes(b)}",
                f"caches {sizes.cache_slots(b)} experts ({sizes.cached_fraction(b):.1%}); "
                f"process holds ~{format_bytes(sizes.resident_bytes + min(b, sizes.all_experts_budget))} of weights",
            )
        )
    if gpu_budget is not None:
        host = budget if budget is not None else 2**32
        rows += [
            (
                "with --device cuda, VRAM",
                f"{format_bytes(sizes.resident_bytes)} resident + {format_bytes(gpu_budget)} of experts "
                f"({sizes.cache_slots(gpu_budget)}, {sizes.cached_fraction(gpu_budget):.1%}) = "
                f"{format_bytes(sizes.resident_bytes + gpu_budget)}, plus the KV cache and activations",
            ),
            (
                "with --device cuda, RAM",
                f"{format_bytes(host)} of page-locked expert cache (--memory; {sizes.cache_slots(host)} experts, "
                f"{sizes.cached_fraction(host):.1%}), plus the runtime",
            ),
            ("minimum --gpu-memory", format_bytes(sizes.minimum_budget)),
        ]
    width = max(len(r[0]) for r in rows)
    print(f"{s.directory}")
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    return 0


def _kv_rows(config: dict) -> list[tuple[str, str]]:
    """A decoding sequence's KV cache at a few context lengths, in bf16 and as an 8-bit cache
    (`--kv-cache-dtype int8`): memory on top of the weights, and what each decode step reads."""
    from .sizes import KVSizes

    kv = KVSizes.of_config(config)
    if kv is None:
        return [("KV cache", "not estimated for this model's attention")]
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    dtype = str(text.get("dtype") or text.get("torch_dtype") or config.get("dtype") or "float32")
    name, width = {"bfloat16": ("bf16", 2), "float16": ("fp16", 2)}.get(dtype, ("fp32", 4))
    limit = text.get("max_position_embeddings") or 0
    contexts = [n for n in (4096, 32768) if not limit or n <= limit] + ([limit] if limit and limit not in (4096, 32768) else [])

    def both(n: int) -> str:
        if not kv.packable:
            return f"{format_bytes(kv.nbytes(n, width))} in {name} (a latent cache: --kv-cache-dtype int8 does not pack it)"
        return (
            f"{format_bytes(kv.nbytes(n, width))} in {name}, {format_bytes(kv.nbytes(n, int8=True))} with --kv-cache-dtype int8"
        )

    return [("KV cache per position", both(1))] + [(f"KV cache at {n} positions", f"{both(n)} (per sequence)") for n in contexts]


def _describe_format(manifest) -> str:
    """The store format, and for a version 3 store whether this machine's kernels read its int4 bytes."""
    from .quant import torch_int4_packing

    packings = {f.packing for f in [layer.quantization for layer in manifest.layers] + list(manifest.dense.values()) if f}
    legacy = sorted(p for p in packings if p not in (None, "nibbles"))
    if not legacy:
        return f"version {manifest.format_version}: runs on any machine"
    here = "runs here" if legacy == [torch_int4_packing()] else "refused here"
    return (
        f"version {manifest.format_version}, int4 bytes in torch's {', '.join(legacy)} layout: {here}; "
        "`moestream upgrade` makes it run on any machine"
    )


def _gguf_rows(manifest) -> list[tuple[str, str]]:
    """A store converted from a GGUF file: each MoE layer's source block types and the format it is stored
    in (consecutive layers alike on one row), and the other tensors' types."""
    types = manifest.source.get("gguf_types")
    if not isinstance(types, dict):
        return []
    rows: list[tuple[str, str]] = []
    runs: list[tuple[int, int, str]] = []  # (first layer, last layer, description)
    for layer in manifest.layers:
        index = _layer_index(layer.module)
        found = types.get("experts", {}).get(str(index), {})
        source = ", ".join(f"{proj} {kind}" for proj, kind in sorted(found.items())) or "not recorded"
        fmt = layer.quantization
        stored = (fmt.name + (f"-g{fmt.group_size}" if fmt.group_size else "")) if fmt else layer.layout.tensors[0].dtype
        text = f"GGUF {source} -> stored {stored}"
        if runs and runs[-1][2] == text and runs[-1][1] == index - 1:
            runs[-1] = (runs[-1][0], index, text)
        else:
            runs.append((index, index, text))
    for first, last, text in runs:
        rows.append((f"layer {first}" if first == last else f"layers {first}-{last}", text))
    resident = types.get("resident", {})
    if resident:
        rows.append(("other tensors (GGUF)", ", ".join(f"{kind} x{count}" for kind, count in resident.items())))
    return rows


def _layer_index(module: str) -> int | None:
    parts = module.split(".")
    return next((int(p) for p in parts if p.isdigit()), None)


def _describe_dense(manifest) -> str:
    """Which resident linear layers are quantized (convert --dense-dtype), e.g. "int8 x 12, float x 2", and
    the token embedding where a GGUF's was kept quantized."""
    if not manifest.dense:
        return "float (as the model)"

    def name(f) -> str:
        return f"{f.name}-g{f.group_size}" if f.group_size else f.name

    embeddings = {m: f for m, f in manifest.dense.items() if m.endswith("embed_tokens")}
    names = [name(f) for m, f in manifest.dense.items() if m not in embeddings]
    counts = ", ".join(f"{n} x{names.count(n)}" for n in dict.fromkeys(names))
    if embeddings:
        kept = ", ".join(name(f) for f in embeddings.values())
        return f"{counts} linear layers, the token embedding {kept} (routers, norms and a tied LM head as the model)"
    return f"{counts} linear layers (routers, norms, embeddings and a tied LM head as the model)"
