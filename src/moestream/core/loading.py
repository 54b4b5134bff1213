"""`moestream.load`: assemble a transformers model from a store, with its experts served by an ExpertEngine.

Loading builds the model on the meta device from the stored config, checks that the store's records
hold exactly what each experts module needs, hands every experts module to one ExpertEngine, loads the
resident weights (hashed against the manifest), rebuilds buffers transformers computes at init, and
loads the tokenizer. With device="cuda" the resident weights then move to the GPU and the engine gets
a device tier above its host cache (device_tier.py). The engine (engine.py) then serves every experts
call.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch
from safetensors.torch import load_file

from ..choices import GPU_HEADROOM
from ..conversion.quant import expert_record_specs
from ..conversion.sizes import ModelSizes, routed_top_k
from ..conversion.skeleton import build_skeleton, config_from_dict, expert_parameters, experts_modules, model_dtype
from ..conversion.store import DTYPES, Store, file_checksum
from ..errors import StoreError, UsageError
from ..units import format_bytes, parse_bytes
from . import engine as engine_module
from . import fastpaths
from .compute import attention as attention_module
from .compute import dense, fused, kernels, row_buckets
from .compute.plan import choose_activations, experts_plans, plan_linears
from .devices import CudaDevice, Device
from .engine import IMPLEMENTATION, ExpertEngine
from .routing import CacheAwareRouting
from .runtime import runtime_of
from .supply.expert_supply import ExpertSupply, check_budget
from .supply.policies import DEFAULT_POLICY
from .supply.prefetch import Prefetcher, find_router


def _rebuild_buffers(model) -> None:
    """Buffers left on the meta device (rotary inv_freq, ...) are recomputed the way transformers does
    after from_pretrained: real storage, then the model's own _init_weights for their modules only.
    Loaded tensors are flagged as initialized, which makes transformers' init functions skip them."""
    for t in list(model.parameters()) + list(model.buffers()):
        if not t.is_meta:
            t._is_hf_initialized = True
    for module in model.modules():
        meta = [name for name, b in module.named_buffers(recurse=False) if b is not None and b.is_meta]
        if not meta:
            continue
        for name in meta:
            module._buffers[name] = torch.empty_like(module._buffers[name], device="cpu")
        model._init_weights(module)


def load(
    store: str | os.PathLike,
    memory: str | int = "4GiB",
    device: str | Device = "cpu",
    *,
    gpu_memory: str | int | None = None,
    io_threads: int = 4,
    direct_io: bool = True,
    verify: str = "first",
    policy: str = DEFAULT_POLICY,
    prefetch: str = "auto",
    compute_dtype: str = "auto",
    activations: str | None = None,
    route_to_cached: float = 0.0,
    attention: str | None = None,
    kv_cache_dtype: str = "auto",
):
    """Load a store as a transformers model whose experts stream from disk under a byte budget.

    memory: the expert cache budget ("4GiB", "512MB", or bytes); resident weights come on top of it.
        With a GPU it is the host tier's, in page-locked RAM.
    device: "cpu", or "cuda": resident weights on the GPU, experts cached in two tiers (device_tier.py).
        (A devices.Device object runs the GPU code path on another device: the tests' StandInDevice.)
    gpu_memory: with a GPU, the budget of experts kept in VRAM (default: half of the VRAM free once the
        resident weights are on the GPU).
    verify: when expert records are checked against their checksums: "first" read of each (default),
        "always", or "off".
    policy: the cache's eviction policy, one of policies.POLICIES: "forecast" (the default), "lfu", "lru",
        "arc"; `moestream simulate` compares them on a recorded trace.
    prefetch: speculative reads of the next layer's likely experts: "auto" (default: times decode steps
        with speculation on and off, keeps it only if faster, probes again; prefetch.py), "on" or "off".
        Unless "off", hash-routed layers' experts are read exactly, before the layers run.
    compute_dtype: "auto" (default: the model's dtype, except a bf16 model on a CPU without bf16
        arithmetic computes in float32, its float resident weights then held at twice their stored
        size), "bf16" or "fp32" (kernels.compute_dtype).
    activations: what the CPU's low-bit matmuls take: "auto" (the default, plan.DEFAULT_ACTIVATIONS:
        int8 where the compiled kernels are measured faster on this model's shapes here, else float),
        "int8" (llama.cpp's arithmetic: each activation row quantized to int8, the dot products in
        integers; `moestream eval --activations` prices it) or "float" (the activations as they are:
        torch's kernels).
    route_to_cached: a margin in (0, 1) turns cache-aware routing on (routing.py): in a decode step a
        chosen expert that is not cached gives way to a cached one whose router probability is at least
        (1 - margin) times its own. It changes the model's output; 0 (the default) is off.
    attention: the model's attention: "auto" (the default: the compiled flash-decoding kernel as the
        model's attention function for one query, the compiled prefill kernel for a float32 or bf16 prompt on a
        CPU with AVX-512 (bf16: with BF16), sdpa for other prompts; core/compute/attention.py) or "sdpa" (transformers' own). The
        kernels sum in another order: `moestream eval --attention sdpa` prices them.
    kv_cache_dtype: "auto" (the default: keys and values in the compute dtype) or "int8" (an 8-bit KV
        cache the attention kernel reads: about half the bytes of bf16 per position; `moestream eval
        --kv-cache-dtype int8` prices it). Needs the kernel as the model's attention.
    Returns (model, tokenizer); tokenizer is None when the store has no tokenizer files.
    """
    accelerator = _device(device)
    engine_module.register()
    opened = Store(store)
    manifest = opened.manifest
    config = config_from_dict(manifest.model_config)
    stored = model_dtype(config)
    # On a GPU the model computes in its own dtype unless told otherwise (CPU rules do not apply there).
    on_gpu = isinstance(accelerator, CudaDevice)
    dtype = kernels.compute_dtype(compute_dtype, stored) if not (on_gpu and compute_dtype == "auto") else stored
    model = build_skeleton(config, stored, experts_implementation=IMPLEMENTATION)
    for where, fmt in [(layer.module, layer.quantization) for layer in manifest.layers] + list(manifest.dense.items()):
        kernels.check_packing(fmt, where, on_gpu)
    dense.install(model, manifest.dense)  # resident linears stored quantized (--dense-dtype)
    modules = experts_modules(model)
    if [name for name, _ in modules] != [layer.module for layer in manifest.layers]:
        raise StoreError(
            f"the store's experts layers do not match the model that transformers builds from its config "
            f"({len(manifest.layers)} vs {len(modules)} experts modules); convert it again with this version"
        )
    for layer, (_, module) in zip(manifest.layers, modules):
        _check_record_layout(layer, module)
    int8_activations, activations_note = choose_activations(activations, _quantized_shapes(model, manifest), on_gpu)
    budget = parse_bytes(memory)
    check_budget(opened, budget)  # before seconds of resident weights, not after
    for index, (_, module) in enumerate(modules):
        for pname, _ in expert_parameters(module):
            del module._parameters[pname]  # served from the store, never materialized
        module._moestream_layer = index
    routers = [find_router(model.get_submodule(name.rsplit(".", 1)[0])) if "." in name else None for name, _ in modules]
    state = {}
    for f in manifest.resident_files:
        path = opened.path(f.path)
        # Resident weights are read in full once anyway, so hashing them costs one more pass over memory.
        if verify != "off" and file_checksum(path) != f.checksum:
            raise StoreError(
                f"resident file {f.path} does not match its checksum in the manifest: the store is damaged. "
                "Run `moestream verify` on it, then convert the model again."
            )
        state.update(load_file(path))
    result = model.load_state_dict(state, strict=False, assign=True)
    del state
    model.tie_weights()
    plan_linears(model, int8_activations, cpu_kernels=not on_gpu, dtype=dtype)  # how each quantized linear computes
    if not on_gpu:
        dense.prepare_for_cpu(model)
    dense.align_weights(model)
    dense.set_compute_dtype(model, stored, dtype)
    attention_note = attention_module.install(
        model, attention, on_gpu, kv_cache_dtype
    )  # before fused.install: it reads the choice
    _rebuild_buffers(model)
    if not on_gpu:
        dense.routers_in_float32(routers)
        fused.install(model, routers)  # with real buffers: its checks run the model's rotary embedding
        row_buckets.install(model)  # the resident bf16 and fp16 linears: a bounded set of matmul shapes
    still_meta = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if still_meta:
        raise StoreError(
            f"the store lacks {len(still_meta)} resident tensors, e.g. {still_meta[:5]} "
            f"(missing at load: {result.missing_keys[:5]}); convert the model again"
        )
    model.eval()
    # The device tier's budget is what the GPU has free once the resident weights are on it.
    device_budget = _resident_on_device(model, opened, accelerator, gpu_memory) if accelerator is not None else 0
    plans = experts_plans(
        manifest.layers, not on_gpu, int8_activations, tiered=accelerator is not None, dtype=dtype
    )  # each layer's experts
    prefetcher = Prefetcher(routers, routed_top_k(manifest.model_config), prefetch)
    supply = ExpertSupply(
        opened, budget, preparers=[plan.preparer for plan in plans], prefetcher=prefetcher, io_threads=io_threads, direct_io=direct_io,
        verify=verify, policy=policy, device=accelerator, device_budget=device_budget,
    )  # fmt: skip
    engine = ExpertEngine(opened, supply, plans, prefetcher)
    try:
        for _, module in modules:
            module._moestream_engine = engine
            # The class's forward is transformers' dispatch, which looks the implementation up in the
            # config on every call (a few microseconds per layer and token); the module's own goes straight
            # to the one it would find. A subclass with a forward of its own (Ergo's per-route norms around
            # the decorated projections) keeps it: its call to the dispatch reaches the engine.
            if _is_experts_dispatch(type(module).forward):
                module.forward = functools.partial(engine_module.streaming_experts_forward, module)
        # The embedding sees each forward pass's input ids first: the engine's step start (the prefetcher's
        # clock, hash-routed layers' exact reads) hangs off it, not off the experts calls.
        model.get_input_embeddings().register_forward_pre_hook(engine.embedding_pre_hook)
        if route_to_cached:
            CacheAwareRouting(engine, route_to_cached).install(routers)
        model._moestream_engine = engine
        # Every kernel choice is made by now (the experts kernel is resolved here for the compute dtype).
        engine.fast_paths = fastpaths.survey(model, engine, routers, dtype, on_gpu, activations_note, attention_note)
        tokenizer = load_tokenizer(opened.directory)
    except BaseException:
        engine.close()  # its store files are open: a load that fails must not keep them
        raise
    return model, tokenizer


def _device(device) -> Device | None:
    """The accelerator `device` names (None for the CPU alone)."""
    if device == "cpu":
        return None
    if device == "cuda":
        return CudaDevice()
    if isinstance(device, str):
        raise UsageError(f"device must be 'cpu' or 'cuda', not {device!r}")
    return device


def _resident_on_device(model, store: Store, device: Device, gpu_memory) -> int:
    """Resident weights onto the device; the byte budget of the device tier of the expert cache, checked."""
    sizes = ModelSizes.of_store(store.manifest)
    if isinstance(device, CudaDevice):
        free, total = torch.cuda.mem_get_info(device.device)
        resident = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
        needed = resident + sizes.minimum_budget + GPU_HEADROOM
        if needed > free:
            raise UsageError(
                f"the GPU has {format_bytes(free)} free of {format_bytes(total)}: too little for the resident weights "
                f"({format_bytes(resident)}), the smallest VRAM expert cache ({format_bytes(sizes.minimum_budget)}) and "
                f"{format_bytes(GPU_HEADROOM)} for the KV cache and activations, {format_bytes(needed)} in all; convert with "
                "--dense-dtype int8 (or int4) for fewer resident bytes, or run with --device cpu"
            )
        model.to(device.device)
        free, _ = torch.cuda.mem_get_info(device.device)
        budget = parse_bytes(gpu_memory) if gpu_memory is not None else free // 2
        if budget > free - GPU_HEADROOM:
            most = max(sizes.minimum_budget, free - GPU_HEADROOM)
            raise UsageError(
                f"--gpu-memory {format_bytes(budget)} does not fit: {format_bytes(free)} of VRAM is free with the resident "
                f"weights on the GPU, and {format_bytes(GPU_HEADROOM)} of it is kept for the KV cache and activations; pass "
                f"--gpu-memory {format_bytes(most).replace(' ', '')} or less"
            )
    else:
        if gpu_memory is None:
            raise UsageError("a device other than cuda needs an explicit gpu_memory budget")
        budget = parse_bytes(gpu_memory)
    if budget < sizes.minimum_budget:
        raise UsageError(
            f"--gpu-memory {format_bytes(budget)} cannot hold the {sizes.top_k} experts one token needs in one layer; the "
            f"minimum is {format_bytes(sizes.minimum_budget)}: pass --gpu-memory {format_bytes(sizes.minimum_budget).replace(' ', '')} or more"
        )
    return budget


def _quantized_shapes(model, manifest) -> list[tuple]:
    """(format, N, K) of every distinct quantized matrix shape: the expert records' and the resident linears'."""
    shapes = {(layer.quantization, n, k) for layer in manifest.layers for n, k in layer.quantized_matrices}
    shapes.update((m.fmt, m.out_features, m.in_features) for m in model.modules() if isinstance(m, dense.QuantizedLinear))
    return sorted(shapes, key=lambda shape: (shape[0].name, shape[1], shape[2]))


def _check_record_layout(layer, module) -> None:
    """The records must hold exactly the tensors this module's experts need, in the kernels' layout: a
    store from another version or another machine is refused here rather than computed with."""
    fmt = layer.quantization
    shapes = {name: tuple(p.shape[1:]) for name, p in expert_parameters(module)}
    expected = expert_record_specs(shapes, torch.float32, fmt, module.is_transposed, layer.module)
    found = {t.name: (DTYPES[t.dtype], t.shape) for t in layer.layout.tensors}
    for name, dtype, shape in expected:
        have = found.pop(name, None)
        # Parameters kept as they are may be stored in any float dtype (--experts-dtype); the parts of a
        # quantized matrix ("down_proj.qweight", ...) have the exact dtypes their kernel reads.
        ok = have is not None and have[1] == shape and (have[0] == dtype if "." in name else have[0].is_floating_point)
        if not ok:
            raise StoreError(
                f"{layer.module}: the store's record tensor {name} is {have}, the model needs {dtype} {shape}; "
                "convert the model again with this version"
            )
    if found:
        raise StoreError(f"{layer.module}: the store's records hold tensors the model does not use: {sorted(found)}")


def load_tokenizer(directory: str | os.PathLike):
    """The store's (or checkpoint's) tokenizer, or None when the directory has no tokenizer files."""
    directory = Path(directory)
    if not any((directory / n).is_file() for n in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        return None
    from transformers import AutoTokenizer

    try:
        # trust_remote_code=False explicitly: left unset, transformers would ask on a terminal whether to
        # run code that a store's tokenizer_config.json names.
        return AutoTokenizer.from_pretrained(directory, local_files_only=True, trust_remote_code=False)
    except (ValueError, OSError) as e:
        raise StoreError(
            f"the tokenizer files of {directory} cannot be loaded ({e}). moestream never runs code from a "
            "store; convert from a checkpoint whose tokenizer transformers supports natively."
        ) from None


def fast_paths(model) -> str:
    """One line: which fast paths the model runs, and why the others are off (core/fastpaths.py)."""
    return runtime_of(model).fast_paths()


def stats(model) -> dict:
    """Cache hits, misses, hit rate, bytes read, read/wait seconds, overall and per layer."""
    return runtime_of(model).stats()


def close(model) -> None:
    """Stop the model's reader threads and release its cache; the model cannot run afterwards."""
    runtime_of(model).close()


def _is_experts_dispatch(forward) -> bool:
    """Whether `forward` is the one `@use_experts_implementation` wraps a class's own in (functools.wraps
    leaves the original as `__wrapped__`), not a subclass's override around it."""
    return hasattr(forward, "__wrapped__")
