"""Fused CPU kernels for the small ops that dominate a decode step: RMSNorm, rotary, routers, experts,
attention.

Why: a one-token decode step on the CPU runs hundreds of tiny ops, each costing 5-30 us of dispatch
and cache misses whatever its size. transformers' RMSNorm is eight of them (cast, pow, mean, add,
rsqrt, mul, cast, mul) and runs two to four times per layer; one fused kernel does the same arithmetic
in one call (docs/DECISIONS.md, "Fused RMSNorm"). transformers itself swaps RMSNorm forwards for
kernels (`use_kernel_forward_from_hub("RMSNorm")`), which here would need the network; so the kernel is
compiled from native/fused_kernels.cpp by native/fused_build.py, once per source and torch build (about 30 s,
then cached), and used only where it computes what the module computes.

Which modules: every module whose class is named *RMSNorm with a 1-D `weight` and a float epsilon. A
class's formula is not read from its source but checked by behaviour (`agrees`): on random rows and a
random weight its forward and the kernel must agree within one unit in the last place on at most 0.1%
of a 16-bit result's elements (float32: within a few units, its sums run in another order), so a variant
(Gemma's 1 + weight, gpt-oss's single rounding in bf16) keeps its own forward.

Rotary: a modeling module's `apply_rotary_pos_emb` (x * cos + rotate_half(x) * sin, sixteen small ops per
layer) is replaced, in that module, by one kernel call when the kernel gives the same bits as the
function on random inputs in bf16, float16 and float32 (`rotary_agrees`; an interleaved or partial
variant keeps its own). Other shapes and arguments go to the original function.

Routers: a softmax top-k router's forward (linear, softmax, top-k, normalization, cast) as the same
torch ops called from C++, for a router whose forward it reproduces bit for bit (`router_variant`).

Experts: `experts_decode` runs one token through a layer's cached quantized experts (int4 or int8) with
torch's own kernels and its silu and mul called from C++, for an experts module whose gate agrees with
the kernel's (`experts_kernel`); each layer's plan holds it for one-token calls (plan.py, `ExpertsPlan`). The router and
experts kernels call torch's own ops and the rotary one rounds as they do, so all three give the model's
own bits; what they save is the Python and dispatch between the ops (docs/DECISIONS.md, "Fused rotary, routers and experts").

Attention: a Llama-family attention module's one-token step (q/k/v projections, optional q/k RMSNorms
over each head or the whole projection, rotary; the cache's own update; sdpa and the output projection)
as two C++ calls around the cache update, with the same kernels in the same order, for a module whose
forward it reproduces bit for bit on random states and cached positions (`attention_plan`,
`attention_agrees`). Its Python (six submodule calls, views, the attention interface's lookup and
checks) cost as much as its kernels at the fixture's width. Prompts, masks, batches and other caches
take the module's own forward.

Every check runs at load, on what the module will meet: the attention's on the model's own rotary
embedding (a partial rotary, whose width the kernel does not take, keeps the module's own forward) and
with the keywords its decoder layer passes (`decoder_keywords`: one call of the model, stopped as the
first attention is entered); the rotary's for the head sizes and counts of the model's config; the norms'
and routers' on probes whose every parameter and buffer is random (a bias zero at init hides nothing).
At call time each fused forward tests, in one guard, that the call is of the kind checked (one token or a
prompt, a batch, a mask, the width, dtype, layout and keywords); anything else goes to the module's own
code, and a check that fails, or raises, leaves the module as it was: a fast path never breaks a model.

Without a C++ compiler, or with MOESTREAM_FUSED=0, nothing changes (one line says so: `unavailable_reason`).
"""

from __future__ import annotations

import copy
import functools
import inspect
import sys

import torch
from torch import nn
from transformers import DynamicCache

from ...native import fused_build
from . import attention, dense, kernels, row_buckets


def unavailable_reason() -> str | None:
    """None when the fused kernels are available, else why they are off (MOESTREAM_FUSED=0, no compiler,
    a failed build), as one line for a user."""
    if fused_build.extension() is not None:
        return None
    return fused_build.unavailable_reason() or "the fused kernels are turned off in this process"


def _epsilon(module: nn.Module) -> float | None:
    for name in ("variance_epsilon", "eps"):
        value = getattr(module, name, None)
        if isinstance(value, float):
            return value
    return None


def _rms_norms(model: nn.Module) -> list[nn.Module]:
    return [
        m
        for m in model.modules()
        if type(m).__name__.endswith("RMSNorm")
        and isinstance(getattr(m, "weight", None), torch.Tensor)
        and m.weight.dim() == 1
        and _epsilon(m) is not None
    ]


def agrees(module: nn.Module, kernel, rows: int = 64) -> bool:
    """Whether `kernel` computes what `module`'s class computes, in the module's weight dtype, on random
    rows and a random weight (a copy: a weight of ones would hide where a variant puts it). Required: the
    same dtype and shape, and values within one unit in the last place (float32: a few, its sums run in
    another order) on at most 0.1% of the elements of a 16-bit result."""
    g = torch.Generator().manual_seed(0)
    dtype, hidden = module.weight.dtype, module.weight.shape[0]
    probe = copy.deepcopy(module)
    _randomize(probe, g)  # a bias or offset the kernel does not add may be zero at init
    probe.weight = nn.Parameter((torch.rand(hidden, generator=g) + 0.5).to(dtype), requires_grad=False)
    x = (torch.randn(rows, hidden, generator=g) * 3).to(dtype)
    try:
        with torch.no_grad():
            expected = type(module).forward(probe, x)
            got = kernel(x, probe.weight, _epsilon(module))
    except Exception:  # a forward that takes other inputs: the module keeps it
        return False
    return isinstance(expected, torch.Tensor) and _close(got, expected)


def _randomize(probe: nn.Module, g: torch.Generator) -> None:
    """Random values in every float parameter and buffer of `probe` (a copy), so that an agreement check
    sees each of them: a zero or a one at init would hide a term the kernel does not compute."""
    with torch.no_grad():
        for tensor in [*probe.parameters(), *probe.buffers()]:
            if tensor.is_floating_point() and tensor.device.type != "meta":
                tensor.copy_(torch.randn(tensor.shape, generator=g).to(tensor.dtype))


def _close(got: torch.Tensor, expected: torch.Tensor) -> bool:
    """The same dtype and shape, and values within one unit in the last place (float32: a few, its sums and
    exponentials may run another way) on at most 0.1% of the elements of a 16-bit result."""
    dtype = expected.dtype
    if got.dtype != dtype or got.shape != expected.shape:
        return False
    units = 8 if dtype == torch.float32 else 1
    diff = (got.float() - expected.float()).abs()
    if not bool((diff <= units * torch.finfo(dtype).eps * expected.float().abs() + torch.finfo(dtype).tiny).all()):
        return False
    return dtype == torch.float32 or (diff > 0).float().mean().item() <= 1e-3


def install(model: nn.Module, routers=()) -> int:
    """Give each RMSNorm module whose class agrees with the kernel (`agrees`) the fused forward, the
    model's modeling modules the fused rotary (`install_rotary`), its `routers` the fused router where
    it agrees (`install_routers`) and its attention modules the fused one-token step (`install_attention`);
    returns how many norms. The norm's forward falls back to the module's own for inputs the kernel does
    not take (another dtype than the weight's, a device other than the CPU, more arguments than the one
    checked, or with autograd recording). Called with the model's weights and buffers real: the attention's
    check runs the model's own rotary embedding, and one call of the model finds what its layers pass."""
    ext = fused_build.extension()
    if ext is None:
        return 0
    dtype = dense.embedding_output(model)[1]
    install_rotary(model, ext.rotary, dtype)
    install_routers(routers, ext.softmax_topk_router)
    norms = _rms_norms(model)
    verdict: dict[tuple, bool] = {}
    installed = 0
    for module in norms:
        key = (type(module), module.weight.dtype, module.weight.shape[0], _settings(module))
        if key not in verdict:
            verdict[key] = agrees(module, ext.rms_norm)
        if verdict[key]:
            module.forward = functools.partial(_fused_forward, module, ext.rms_norm, _epsilon(module))
            installed += 1
    install_attention(model, ext, dtype)  # after the norms: it runs theirs
    return installed


def _settings(module: nn.Module) -> tuple:
    """A module's plain attributes (flags, sizes, names): instances of one class that differ in them get a
    check of their own."""
    plain = (bool, int, float, str, type(None))
    return tuple(sorted((k, v) for k, v in vars(module).items() if not k.startswith("_") and isinstance(v, plain)))


def _kernel_takes(weight: torch.Tensor, x: torch.Tensor, args: tuple, kwargs: dict) -> bool:
    """Whether a module's fused forward may run its kernel on this call: the one input that was checked,
    in the weight's dtype, on the CPU, and no autograd recording (the kernels have no backward)."""
    differentiating = torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad)
    return not args and not kwargs and x.dtype == weight.dtype and x.device.type == "cpu" and not differentiating


def _fused_forward(module: nn.Module, kernel, eps: float, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    if hidden_states.shape[-1:] == module.weight.shape and _kernel_takes(module.weight, hidden_states, args, kwargs):
        return kernel(hidden_states, module.weight, eps)  # rows of the width checked
    return type(module).forward(module, hidden_states, *args, **kwargs)


# -- rotary ------------------------------------------------------------------------------------------------


def rotary_agrees(function, kernel, dtypes=(torch.bfloat16, torch.float16, torch.float32), head_dim=32, heads=(4, 2)) -> bool:
    """Whether `kernel(q, k, cos, sin)` gives the same bits as `function` (a modeling module's
    apply_rotary_pos_emb) on random queries and keys laid out as attention lays them out (heads
    transposed out of the projection's rows) and random angles over the whole head, in each of `dtypes`,
    for `head_dim` and (query, key) `heads`."""
    g = torch.Generator().manual_seed(0)
    for dtype in dtypes:
        q = torch.randn(2, 3, heads[0], head_dim, generator=g).to(dtype).transpose(1, 2)
        k = torch.randn(2, 3, heads[1], head_dim, generator=g).to(dtype).transpose(1, 2)
        cos, sin = (torch.randn(2, 3, head_dim, generator=g).to(dtype) for _ in range(2))
        try:
            with torch.no_grad():
                expected, got = function(q, k, cos, sin), kernel(q, k, cos, sin)
        except Exception:  # another layout or signature (gpt-oss rotates with half-width cos and sin)
            return False
        if not (isinstance(expected, tuple) and len(expected) == len(got) == 2):
            return False
        if not all(e.dtype == r.dtype and e.shape == r.shape and torch.equal(e, r) for e, r in zip(expected, got)):
            return False
    return True


def rotary_kinds(model: nn.Module, dtype: torch.dtype) -> set[tuple]:
    """The (dtype, head size, query heads, key heads) of the rotary calls the model's attention makes, from
    its config (a partial rotary's narrower calls are not among them: they keep the original function)."""
    kinds = set()
    for config in {id(m.config): m.config for m in model.modules() if hasattr(m, "config")}.values():
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads, kv_heads = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
        hidden = getattr(config, "hidden_size", None)
        head_dim = getattr(config, "head_dim", None) or (hidden // heads if isinstance(hidden, int) and heads else None)
        if all(isinstance(v, int) and v > 0 for v in (heads, head_dim)):
            kinds.add((dtype, head_dim, heads, kv_heads if isinstance(kv_heads, int) and kv_heads > 0 else heads))
    return kinds


def install_rotary(model: nn.Module, kernel, dtype: torch.dtype) -> int:
    """Replace `apply_rotary_pos_emb` in each modeling module that defines the model's classes, where the
    kernel agrees with it (`rotary_agrees`); returns how many modules. The check runs here, for the kinds
    of call the model makes (`rotary_kinds`); the replacement serves every model of that module in this
    process, each load adding its own kinds, and hands any call of a kind not checked to the original."""
    replaced, kinds = 0, rotary_kinds(model, dtype)
    for name in sorted({type(m).__module__ for m in model.modules()}):
        module = sys.modules.get(name)
        function = getattr(module, "apply_rotary_pos_emb", None)
        if function is None:
            continue
        ours = isinstance(function, functools.partial) and function.func is _fused_rotary
        if ours:
            original, verdicts = function.args[0], function.args[2]
        elif isinstance(function, functools.partial) or not rotary_agrees(function, kernel):
            continue
        else:
            original, verdicts = function, {}
        for kind in kinds - verdicts.keys():
            dtype_, head_dim, heads, kv_heads = kind
            verdicts[kind] = rotary_agrees(original, kernel, (dtype_,), head_dim, (heads, kv_heads))
        if not ours:
            module.apply_rotary_pos_emb = functools.partial(_fused_rotary, original, kernel, verdicts)
        replaced += 1
    return replaced


def _fused_rotary(original, kernel, verdicts: dict, *args, **kwargs):
    """The kernel for the call `rotary_agrees` checks: (q, k, cos, sin) by position, cos and sin over the
    whole head, in the layout it checked, of a kind (dtype, head size, head counts) checked at load
    (`verdicts`); any other call (keywords, unsqueeze_dim, queries alone, a partial rotary, another shape,
    a kind not checked or whose check disagreed) goes to `original`."""
    if len(args) != 4 or kwargs or not all(isinstance(t, torch.Tensor) for t in args):
        return original(*args, **kwargs)
    q, k, cos, sin = args
    if (
        verdicts.get((q.dtype, q.shape[-1], q.shape[1], k.shape[1]) if q.dim() == 4 else None)
        and q.device.type == "cpu"
        and k.dim() == 4
        and cos.dim() == 3
        and q.dtype == k.dtype == cos.dtype == sin.dtype
        and cos.shape == sin.shape
        and cos.shape[0] in (1, q.shape[0])
        and q.shape[0] == k.shape[0]
        and cos.shape[1] == q.shape[2] == k.shape[2]
        and cos.shape[2] == q.shape[3] == k.shape[3]
        and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad))
    ):
        return tuple(kernel(q, k, cos, sin))
    return original(*args)


# -- routers -------------------------------------------------------------------------------------------------


def router_variant(router: nn.Module, kernel) -> tuple[bool, bool] | None:
    """Which (normalize, cast) of the kernel gives the bits of `router`'s forward on random rows, with
    random values in every float parameter and buffer of a copy (a bias or score correction the kernel
    does not add may be zero at init), or None: another formula (DeepSeek's sigmoid groups, gpt-oss's top-k
    before the softmax, a bias) keeps its own. The rows are [tokens, hidden], the layout `_fused_router`
    takes."""
    weight, k = getattr(router, "weight", None), getattr(router, "top_k", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not isinstance(k, int):
        return None
    g = torch.Generator().manual_seed(0)
    probe = copy.deepcopy(router).eval()
    _randomize(probe, g)
    x = torch.randn(7, weight.shape[1], generator=g).to(weight.dtype)
    try:
        with torch.no_grad():
            expected = type(router).forward(probe, x)
    except Exception:
        return None
    if not isinstance(expected, tuple) or len(expected) != 3:
        return None
    for variant in ((True, True), (True, False), (False, True), (False, False)):
        try:
            got = kernel(x, probe.weight, k, *variant)
        except Exception:  # a top-k beyond the experts, a weight the kernel does not take
            return None
        if all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got, expected)):
            return variant
    return None


def install_routers(routers, kernel) -> int:
    """Give each router whose forward the kernel reproduces (`router_variant`) the fused forward; returns
    how many. The forward falls back to the router's own for another input layout, dtype or device, or with
    autograd recording. Routers that differ in their plain attributes (`_settings`) are checked apart."""
    verdict: dict[tuple, tuple[bool, bool] | None] = {}
    installed = 0
    for router in routers:
        if router is None or router.training or not isinstance(getattr(router, "weight", None), torch.Tensor):
            continue
        key = (type(router), router.weight.dtype, router.weight.shape, _settings(router))
        if key not in verdict:
            verdict[key] = router_variant(router, kernel)
        if verdict[key] is not None:
            router.forward = functools.partial(_fused_router, router, kernel, *verdict[key], router.forward)
            installed += 1
    return installed


def _fused_router(router: nn.Module, kernel, normalize: bool, cast: bool, fallback, hidden_states: torch.Tensor, *args, **kwargs):
    x = dense.float32_input(router, hidden_states)  # the cast of the forward this one replaces (`fallback`)
    if x.dim() == 2 and x.shape[1] == router.weight.shape[1] and _kernel_takes(router.weight, x, args, kwargs):
        return tuple(kernel(x, router.weight, router.top_k, normalize, cast))  # [tokens, hidden], as checked
    return fallback(hidden_states, *args, **kwargs)


# -- the experts' one-token path ----------------------------------------------------------------------------


def gate_agrees(module: nn.Module, kernel, width: int, dtype: torch.dtype) -> bool:
    """Whether `kernel` (silu_gate: torch's silu and mul) computes `module`'s gate (`_apply_gate`) on random
    rows of a first matmul's output of `width` columns in `dtype`: transformers' default gate with a SiLU
    does, a clamped (gpt-oss) or other activation does not."""
    g = torch.Generator().manual_seed(0)
    h = (torch.randn(16, width, generator=g) * 3).to(dtype)
    with torch.no_grad():
        return _close(kernel(h), module._apply_gate(h))


_GATE_VERDICTS: dict[tuple, bool] = {}  # (class, activation class, width, dtype) -> gate_agrees


def experts_call(module, layer, dtype: torch.dtype, int8_activations: bool) -> tuple | None:
    """`experts_decode` with its arguments for one token through a layer's experts, whose format its plan
    admitted (plan.compiled_format): the record tensors' names it takes, its bits, group size, the kernels
    kernels.matmul_kernel chooses for its two matrices at `dtype` as the C++ names them (int8 activations:
    the records are as stored; int8 in bf16 at widths torch's kernel gets wrong in float32; int4 with float32
    activations through bf16: the numbers of the engine's own path) and a table format's values (else
    None); or None without the extension or where the module's gate differs from the kernel's
    (`experts_kernel`)."""
    fmt = layer.quantization
    first = "gate_up_proj" if module.has_gate else "up_proj"
    shapes = {t.name: t.shape for t in layer.layout.tensors}
    width = shapes[f"{first}.qweight"][0]  # the first matrix's rows: gate and up stacked
    kernel = experts_kernel(module, width, dtype)
    if kernel is None:
        return None
    table = kernels.table_values(fmt.name) if fmt.table is not None else None
    names = (f"{first}.qweight", f"{first}.{fmt.params}", "down_proj.qweight", f"down_proj.{fmt.params}")
    chosen = [
        kernels.compiled_kernel(kernels.matmul_kernel(fmt, int8_activations, False, dtype, shapes[name][1] * 8 // fmt.bits))
        for name in (names[0], names[2])
    ]
    return kernel, names, fmt.bits, fmt.group_size or 0, *chosen, table


def experts_kernel(module: nn.Module, width: int, dtype: torch.dtype):
    """`experts_decode` for this experts module at a first-matmul width and activation dtype, or None:
    without the extension, or where its gate differs from the kernel's (a clamped or biased variant)."""
    ext = fused_build.extension()
    if ext is None or not module.has_gate or module.has_bias or module.is_transposed or module.has_post_expert_norm:
        return None
    key = (type(module), type(getattr(module, "act_fn", None)), width, dtype)
    if key not in _GATE_VERDICTS:
        _GATE_VERDICTS[key] = gate_agrees(module, ext.silu_gate, width, dtype)
    return ext.experts_decode if _GATE_VERDICTS[key] else None


# -- one token's attention ------------------------------------------------------------------------------------


_NO_TABLE = torch.empty(0, dtype=torch.int8)  # what the attention kernels take for "not a table format"


def _projection(linear: nn.Module) -> tuple | None:
    """(weight, params, bits, group, the kernel its plan chose as the C++ names it, a table format's values or
    _NO_TABLE) of a bias-free resident linear as the kernel takes it, or None where its plan says the C++ does
    not compute it."""
    if isinstance(linear, dense.QuantizedLinear) and linear.bias is None:
        fmt, plan = linear.fmt, linear.plan
        if plan.compiled is None:
            return None
        table = kernels.table_values(fmt.name) if fmt.table is not None else _NO_TABLE
        return linear.qweight, getattr(linear, fmt.params), fmt.bits, fmt.group_size or 0, plan.compiled, table
    if type(linear) in (nn.Linear, row_buckets.BucketedLinear) and linear.bias is None:
        return linear.weight, linear.weight, 0, 0, kernels.FLOAT_WEIGHT, _NO_TABLE
    return None


def _norm(module: nn.Module, head_dim: int, width: int) -> tuple | None:
    """(weight, eps, per head) of an attention's q or k norm that runs the fused kernel; (None, 0.0, True)
    without one; None for any other norm."""
    if module is None:
        return None, 0.0, True
    forward = getattr(module, "forward", None)
    if getattr(forward, "func", None) is not _fused_forward or module.weight.shape[0] not in (head_dim, width):
        return None
    return module.weight, _epsilon(module), module.weight.shape[0] == head_dim


def attention_plan(module: nn.Module, ext) -> tuple | None:
    """The fused one-token attention's two kernels with this module's weights bound, or None where its
    parts are not the ones they run: four bias-free projections, q/k norms that run the fused kernel (or
    none), sdpa without a sliding window or clipping, and a head size sdpa groups heads for itself."""
    names = ("q_proj", "k_proj", "v_proj", "o_proj")
    if not all(isinstance(getattr(module, n, None), nn.Module) for n in names):
        return None
    config, head_dim = getattr(module, "config", None), getattr(module, "head_dim", None)
    scale, layer = getattr(module, "scaling", None), getattr(module, "layer_idx", None)
    if not isinstance(head_dim, int) or not isinstance(scale, float) or not isinstance(layer, int) or head_dim > 256:
        return None
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in ("sdpa", attention.NAME) or getattr(config, "clip_qkv", None) is not None:
        return None
    if getattr(module, "sliding_window", None) is not None:
        return None
    projections = [_projection(getattr(module, n)) for n in names]
    if None in projections:  # before reading their widths: another linear class may not say them
        return None
    norms = [
        _norm(getattr(module, n, None), head_dim, getattr(module, p).out_features)
        for n, p in (("q_norm", "q_proj"), ("k_norm", "k_proj"))
    ]
    if None in norms or norms[0][2] != norms[1][2]:
        return None
    (qn, q_eps, per_head), (kn, k_eps, _) = norms
    grouped = getattr(module, "num_key_value_groups", 1) > 1
    qkv = functools.partial(
        ext.attention_decode_qkv,
        *[list(parts) for parts in zip(*projections[:3])],
        qn, kn, q_eps, k_eps, per_head, head_dim,
    )  # fmt: skip
    out = functools.partial(ext.attention_decode_out, *projections[3], scale, grouped, implementation == attention.NAME)
    return qkv, out


def attention_agrees(module: nn.Module, forward, own, dtype: torch.dtype, rotary=None, keywords=None) -> bool:
    """Whether `forward` gives the bits of the module's own forward (`own`) on one token in `dtype` after 1
    and 9 random cached positions: its output and the keys and values it caches, for random hidden
    states at two scales, called as a decoder layer calls it in a decode step: with `keywords` (by default
    the position ids and use_cache; position ids are set to the token's position). The rotary embedding
    is the model's own where `rotary` gives it (`_rotary_of`: position -> (cos, sin), so a partial rotary
    is what the check sees), else random angles over the whole head."""
    g = torch.Generator().manual_seed(0)
    width, head_dim = module.q_proj.in_features, module.head_dim
    kv_heads = module.k_proj.out_features // head_dim
    keywords = {"position_ids": None, "use_cache": True} if keywords is None else dict(keywords)
    for history, scale in ((1, 1.0), (9, 30.0)):
        x = (torch.randn(1, 1, width, generator=g) * scale).to(dtype)
        angles = torch.rand(1, 1, head_dim // 2, generator=g) * 100
        cos, sin = (torch.cat([f(angles)] * 2, dim=-1).to(dtype) for f in (torch.cos, torch.sin))
        keys, values = (torch.randn(1, kv_heads, history, head_dim, generator=g).to(dtype) for _ in range(2))
        caches = DynamicCache(), DynamicCache()
        for cache in caches:  # the layers before this one's empty, as update() makes them
            cache.update(keys, values, module.layer_idx)
        if "position_ids" in keywords:
            keywords["position_ids"] = torch.tensor([[history]])
        try:
            if rotary is not None:
                cos, sin = rotary(history)
            with torch.no_grad():
                expected = own(x, (cos, sin), None, cache=caches[0], **keywords)
                got = forward(x, (cos, sin), None, cache=caches[1], **keywords)
        except Exception:  # another signature or another cache method: the module keeps its own forward
            return False
        if not (torch.equal(expected[0], got[0]) and expected[0].dtype == got[0].dtype and expected[0].shape == got[0].shape):
            return False
        cached = [(c.layers[module.layer_idx].keys, c.layers[module.layer_idx].values) for c in caches]
        if not all(torch.equal(a, b) for a, b in zip(*cached)):
            return False
    return True


def _rotary_module(model: nn.Module) -> nn.Module | None:
    """The model's one rotary embedding module, or None."""
    rotaries = [m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")]
    return rotaries[0] if len(rotaries) == 1 else None


def _rotary_of(rotary: nn.Module | None, module: nn.Module, dtype: torch.dtype):
    """position -> (cos, sin) for one token, as the model's forward gives `module` its position embeddings:
    the model's rotary embedding module (`_rotary_module`), with the module's layer type where it takes one.
    None where there is none or it cannot be called so: the check then uses random angles over the whole
    head, and the call-time guard still sends any other width to the module's own forward."""
    if rotary is None:
        return None
    keywords = {}
    try:
        takes = inspect.signature(rotary.forward).parameters
    except (TypeError, ValueError):
        return None
    if "layer_type" in takes:
        types, layer = getattr(getattr(module, "config", None), "layer_types", None), module.layer_idx
        if not isinstance(types, (list, tuple)) or layer >= len(types):
            return None
        keywords["layer_type"] = types[layer]
    x = torch.zeros(1, 1, module.q_proj.in_features, dtype=dtype)  # what the rotary reads of the hidden states

    def embed(position: int):
        with torch.no_grad():
            return rotary(x, torch.tensor([[position]]), **keywords)

    try:
        cos, sin = embed(0)
    except Exception:
        return None
    if not (isinstance(cos, torch.Tensor) and isinstance(sin, torch.Tensor) and cos.dim() == 3 and cos.shape[:2] == (1, 1)):
        return None
    return embed


class _AttentionStep:
    """What one module's fused one-token attention runs with: its kernels (`attention_plan`), and the dtype,
    rotary width and kind of call (`_call_kind`: the keywords its decoder layer passes) its check saw."""

    __slots__ = ("module", "dtype", "width", "kind", "qkv", "out")

    def __init__(self, module, dtype, width, kind, qkv, out):
        self.module, self.dtype, self.width, self.kind, self.qkv, self.out = module, dtype, width, kind, qkv, out


class _Entered(Exception):
    """Raised by `decoder_keywords`' hook to stop the model's forward as its first attention is entered."""


def decoder_keywords(model: nn.Module, modules: list[nn.Module]) -> dict | None:
    """The keywords the model's decoder layers pass their attention `modules` in a one-token step (they vary
    by family and transformers version: the check must see the call the modules will meet), from one call
    of the model on one token stopped as the first of them is entered: no layer runs, no expert is read.
    None where the model cannot be called so."""
    found = {}

    def entered(_module, args, kwargs):
        found.update(kwargs)
        raise _Entered

    cache_name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    handles = [module.register_forward_pre_hook(entered, with_kwargs=True) for module in modules]
    try:
        with torch.no_grad():
            model(input_ids=torch.zeros(1, 1, dtype=torch.long), use_cache=True, **{cache_name: DynamicCache()})
        return None  # (no attention module was called)
    except _Entered:
        pass
    except Exception:
        return None
    finally:
        for handle in handles:
            handle.remove()
    for name in ("hidden_states", "position_embeddings", "attention_mask", "cache", "past_key_values"):
        found.pop(name, None)  # (the arguments the step reads itself)
    return found


def install_attention(model: nn.Module, ext, dtype: torch.dtype) -> int:
    """Give each attention module whose one-token step the fused kernels reproduce bit for bit
    (`attention_plan`, `attention_agrees` on the model's own rotary embedding, called with the keywords the
    decoder layers pass: `decoder_keywords`) the fused forward; returns how many. The forward takes the
    kernels only for the rotary width, dtype and keywords the check saw."""
    installed, rotary = 0, _rotary_module(model)
    modules = [m for m in model.modules() if type(m).__name__.endswith("Attention") and not m.training]
    keywords = decoder_keywords(model, modules) if modules else None
    kind = _call_kind(keywords) if keywords is not None else None
    if kind is None:
        return 0
    for module in modules:
        try:
            plan = attention_plan(module, ext)
            if plan is None:
                continue
            embed = _rotary_of(rotary, module, dtype)
            width = embed(0)[0].shape[-1] if embed is not None else module.head_dim
            step = _AttentionStep(module, dtype, width, kind, *plan)
            forward = functools.partial(_fused_attention, step, module.forward)
            agreed = attention_agrees(module, forward, module.forward, dtype, embed, keywords)
        except Exception:  # a module the plan misread: it keeps its own forward rather than failing the load
            continue
        if agreed:
            module.forward = forward
            installed += 1
    return installed


def _call_kind(keywords: dict) -> frozenset | None:
    """The keywords of a call as a check stands for them: names with their values (position ids by name
    only: the check sets its own), or None where a value is a tensor or object a check cannot stand for."""
    kind = []
    for name, value in keywords.items():
        if name == "position_ids":
            kind.append((name, "ids"))
        elif value is None or isinstance(value, (bool, int, float, str)):
            kind.append((name, value))
        else:
            return None
    return frozenset(kind)


def _fused_attention(
    step: _AttentionStep, fallback, hidden_states, position_embeddings=None, attention_mask=None, cache=None, *args, **kwargs
):
    """One token of one sequence without a mask, on the CPU, in the dtype checked, with transformers'
    dynamic cache, a rotary embedding of the width checked and the keywords checked (all chosen at load,
    `install_attention`): two kernel calls around the cache's own update (growing layers and the prefix
    cache keep working). Anything else (a prompt, a batch, a mask, another cache or call) goes to the
    module's own forward."""
    if (
        hidden_states.shape[0] != 1
        or hidden_states.shape[1] != 1
        or attention_mask is not None
        or args
        or type(cache) is not DynamicCache
        or hidden_states.dtype != step.dtype
        or hidden_states.device.type != "cpu"
        or (torch.is_grad_enabled() and hidden_states.requires_grad)
        or not _rotary_takes(position_embeddings, step.width, step.dtype)
        or _call_kind(kwargs) != step.kind
    ):
        return fallback(hidden_states, position_embeddings, attention_mask, cache, *args, **kwargs)
    q, k, v = step.qkv(hidden_states.reshape(1, -1).contiguous(), *position_embeddings)  # the kernel takes one row
    k, v = cache.update(k, v, step.module.layer_idx, kwargs=kwargs)  # as the module's own forward calls it
    attention.mark_read(step.module, k, v)  # (the keys and values went to the attention as they are)
    return step.out(q, k, v), None


def _rotary_takes(position_embeddings, width: int, dtype: torch.dtype) -> bool:
    """Whether (cos, sin) are one token's, [1, 1, width] in `dtype`: what `attention_agrees` checked."""
    if not isinstance(position_embeddings, tuple) or len(position_embeddings) != 2:
        return False
    cos, sin = position_embeddings
    shape = (1, 1, width)
    return (
        isinstance(cos, torch.Tensor)
        and isinstance(sin, torch.Tensor)
        and cos.shape == shape == sin.shape
        and cos.dtype == dtype == sin.dtype
        and cos.device.type == "cpu" == sin.device.type
    )
