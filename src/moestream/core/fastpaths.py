"""Which fast paths a loaded model runs, and why the others are off, so a slower path is never silent.

The kernel choices are made in compute/plan.py (the activations; per MoE layer and per quantized linear,
int8 activations or not, what a record needs where it lands, the one-token experts kernel or why none);
each fused kernel's per module, by its agreement check, in fused.py.
`survey` reads what they decided once `load` has made every choice (it resolves the experts kernel for
the model's compute dtype there, rather than at the first token), and `describe` says it in one line,
which `generate`, `chat`, `bench` and `serve` print and `stats()["fast_paths"]` carries.
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import asdict, dataclass

import torch

from ..conversion.skeleton import experts_modules
from ..native import fused_build
from .compute import dense, fused, repack
from .compute.kernels import native_bf16


@dataclass(frozen=True)
class FastPath:
    name: str
    on: int  # modules (or layers) it serves
    of: int  # modules (or layers) it could serve
    note: str = ""  # how it runs, or why it is off where it is off

    def __str__(self) -> str:
        count = f" {self.on}/{self.of}" if self.of else ""
        return f"{self.name}{count}" + (f" ({self.note})" if self.note else "")


def _partial_of(function) -> object:
    return getattr(function, "func", None)


def survey(
    model, engine, routers, compute_dtype: torch.dtype, on_gpu: bool, activations: str = "", attention: str = ""
) -> list[FastPath]:
    """What `load` decided for this model; resolves the one-token experts kernel for `compute_dtype`.
    `activations`: what plan.choose_activations said of the low-bit matmuls' activations; `attention`:
    what attention.install said of the model's attention function."""
    paths = []
    why_not = f"{compute_dtype}".removeprefix("torch.")
    if compute_dtype == torch.float32 and not native_bf16():
        why_not += ": this CPU has no bf16 arithmetic"
    paths.append(FastPath("compute dtype", 0, 0, why_not))
    if activations:
        paths.append(FastPath("low-bit matmuls", 0, 0, activations))
    loops = _loops(model, engine)
    if loops is not None:
        paths.append(loops)
    if attention:
        paths.append(FastPath("attention function", 0, 0, attention))
    ext = None if on_gpu else fused_build.extension()
    if on_gpu:
        paths.append(FastPath("fused CPU kernels", 0, 0, "off: the model runs on a GPU"))
    elif ext is None:
        reason = getattr(fused, "unavailable_reason", lambda: None)() or "MOESTREAM_FUSED=0, or no C++ compiler"
        paths.append(FastPath("fused CPU kernels", 0, 0, f"off: {reason}; the models run their own code"))
    else:
        norms = fused._rms_norms(model)
        paths.append(FastPath("RMSNorm", sum(_partial_of(m.forward) is fused._fused_forward for m in norms), len(norms)))
        modules = {sys.modules.get(type(m).__module__) for m in model.modules()}
        rotary = [getattr(m, "apply_rotary_pos_emb", None) for m in modules if hasattr(m, "apply_rotary_pos_emb")]
        paths.append(FastPath("rotary", sum(_partial_of(f) is fused._fused_rotary for f in rotary), len(rotary)))
        present = [r for r in routers if r is not None]
        paths.append(FastPath("routers", sum(_partial_of(r.forward) is fused._fused_router for r in present), len(present)))
        attention = [m for m in model.modules() if type(m).__name__.endswith("Attention")]
        on = sum(_partial_of(m.forward) is fused._fused_attention for m in attention)
        paths.append(FastPath("attention (one token)", on, len(attention), "" if on == len(attention) else _kept(attention)))
    paths.append(_experts(model, engine, compute_dtype))
    records = _records(engine, on_gpu)
    if records is not None:
        paths.append(records)
    return paths


def _kept(modules) -> str:
    kept = sorted({type(m).__name__ for m in modules if _partial_of(m.forward) is not fused._fused_attention})
    return f"{', '.join(kept)} keep their own forward: a part the kernels do not compute, or their check disagreed"


def _experts(model, engine, compute_dtype: torch.dtype) -> FastPath:
    """The fused one-token experts kernel, per layer, resolved here for the compute dtype, and why each
    plan that has none has none."""
    modules = [module for _, module in experts_modules(model)]
    hidden, _ = dense.embedding_output(model)
    x = torch.zeros(1, hidden, dtype=compute_dtype)
    reasons = [plan.one_token_reason(module, x) for plan, module in zip(engine.plans, modules)]
    off = sorted({reason for reason in reasons if reason is not None})
    note = f"off for {', '.join(off)}: the engine's own path" if off else ""
    return FastPath("experts (one token)", reasons.count(None), len(modules), note)


def _loops(model, engine) -> FastPath | None:
    """The variants of the int8-activation loops, as the plans of the experts layers and quantized linears
    that take int8 activations record them (None: none does)."""
    linears = [m.plan for m in model.modules() if isinstance(m, dense.QuantizedLinear)]
    variants = Counter(plan.isa for plan in engine.plans + linears if plan.isa is not None)
    if not variants:
        return None
    note = ", ".join(f"{name} for {count}" for name, count in variants.most_common())
    return FastPath("int8-activation loops", 0, 0, f"{note} of {len(engine.plans) + len(linears)} experts layers and linears")


def _records(engine, on_gpu: bool) -> FastPath | None:
    """How int4-family records become what their kernel reads, as each layer's plan says (None: the store
    has none): repacked where they land (the plan's preparer), or read as stored."""
    plans = [plan for plan in engine.plans if plan.fmt is not None and plan.fmt.name != "int8"]
    if not plans:
        return None
    if on_gpu:
        return FastPath("int4 records", len(plans), len(plans), "read by the GPU kernels as stored")
    prepared = [plan for plan in plans if plan.preparer is not None]
    if not prepared:
        if all(plan.fmt.portable for plan in plans):
            return FastPath("int4 records", len(plans), len(plans), "read as stored by their kernels")
        return FastPath("int4 records", len(plans), len(plans), "stored in this machine's kernel layout (format 3)")
    fast = sum(all(repack.in_cpp(n, k) for n, k in plan.layer.quantized_matrices) for plan in prepared)
    note = "repacked where they land, in C++"
    if fast < len(prepared):
        note += f"; {len(prepared) - fast} layers by torch's own packing function (several times slower): no compiled kernels"
    return FastPath("int4 records", fast, len(prepared), note)


def describe(paths: list[FastPath]) -> str:
    return "fast paths: " + "; ".join(str(p) for p in paths)


def as_json(paths: list[FastPath]) -> list[dict]:
    return [asdict(p) for p in paths]
