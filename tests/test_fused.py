"""The fused RMSNorm kernel (core/compute/fused.py): its numbers against float64 math and transformers' module,
which classes it takes (checked by behaviour), and when a model falls back to the modules' own forward."""

import functools
import shutil

import pytest
import torch
from tiny import TINY, tiny_checkpoint
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

import moestream
from moestream.conversion.store import Store
from moestream.conversion.synthetic import make_model, save_checkpoint
from moestream.core.compute import fused
from moestream.native import fused_build

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler: the fused kernels are not built")


@pytest.fixture(scope="module")
def kernel():
    ext = fused_build.extension()
    assert ext is not None, "a C++ compiler is here, so the extension must build"
    return ext.rms_norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden", [7, 128, 2048])
def test_kernel_matches_float64_math(kernel, dtype, hidden):
    g = torch.Generator().manual_seed(hidden)
    x = (torch.randn(3, 5, hidden, generator=g) * 2).to(dtype)
    w = (torch.rand(hidden, generator=g) + 0.5).to(dtype)
    x64 = x.double()
    exact = w.double() * x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6)
    got = kernel(x, w, 1e-6)
    assert got.dtype == dtype and got.shape == x.shape
    # two roundings to the dtype (the normalized row, then its product with the weight)
    assert torch.allclose(got.double(), exact, rtol=3 * torch.finfo(dtype).eps, atol=1e-6)


def _gemma_like(hidden):
    class OffsetRMSNorm(nn.Module):  # Gemma's formula: (1 + weight)
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(hidden))
            self.eps = 1e-6

        def forward(self, x):
            h = x.float()
            return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight.float())).to(x.dtype)

    return OffsetRMSNorm()


def _single_rounding(hidden, dtype):
    class SingleRoundingRMSNorm(nn.Module):  # gpt-oss's: the weight multiplies in float32, one rounding
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(hidden, dtype=dtype))
            self.variance_epsilon = 1e-6

        def forward(self, x):
            h = x.float()
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
            return (self.weight * h).to(x.dtype)

    return SingleRoundingRMSNorm()


def test_only_classes_that_compute_the_same_take_the_kernel(kernel):
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3_moe", **TINY["qwen3_moe"]))
    norm = model.model.layers[0].input_layernorm
    assert fused.agrees(norm, kernel) and fused.agrees(norm.to(torch.bfloat16), kernel)
    assert not fused.agrees(_gemma_like(64), kernel)
    # a weight of ones would hide the difference; agrees() probes with a random weight
    assert not fused.agrees(_single_rounding(256, torch.bfloat16), kernel)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [2048, 4096, 7168])
def test_real_widths_take_the_kernel(kernel, dtype, hidden):
    # Qwen3-30B-A3B, Mixtral, DeepSeek-V3 widths: a float32 running sum of thousands of squares misses
    # torch's cascaded mean by tens of units in the last place, and the check then refused every norm
    norm = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3_moe", **TINY["qwen3_moe"])).model.norm
    real = type(norm)(hidden, eps=1e-6).to(dtype)
    assert fused.agrees(real, kernel)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("fused")
    _, ckpt = tiny_checkpoint("qwen3_moe", root / "hf", seed=21)
    return ckpt, moestream.convert(ckpt, root / "store", experts_dtype="fp32", progress=False)


def test_a_loaded_model_uses_the_kernel_and_equals_transformers(kernel, store):
    ckpt, path = store
    model, _ = moestream.load(path, "1MiB")
    norms = fused._rms_norms(model)
    assert norms and all(getattr(n.forward, "func", None) is fused._fused_forward for n in norms)
    reference = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    ids = torch.randint(0, 250, (2, 11), generator=torch.Generator().manual_seed(22))
    with torch.inference_mode():
        got, expected = model(ids).logits, reference(ids).logits
    assert ((got - expected).norm() / expected.norm()).item() <= 1e-5


def test_other_inputs_fall_back_to_the_modules_own_forward(kernel, store, monkeypatch):
    model, _ = moestream.load(store[1], "1MiB")
    norm = fused._rms_norms(model)[0]
    x = torch.randn(2, norm.weight.shape[0], dtype=torch.float64)
    with torch.no_grad():  # another dtype than the weight's: the module's own math (which promotes)
        assert torch.equal(norm(x), type(norm).forward(norm, x))
    calls = []
    original = type(norm).forward
    monkeypatch.setattr(type(norm), "forward", lambda self, h, *more: calls.append(more) or original(self, h))
    with torch.no_grad():  # a call with more inputs than agrees() checked goes to the module's own forward
        norm(torch.randn(2, norm.weight.shape[0]), "extra")
    assert calls == [("extra",)]
    monkeypatch.undo()
    x = torch.randn(2, norm.weight.shape[0], requires_grad=True)
    y = norm(x)  # autograd recording: the kernel has no backward, so the module's own forward runs
    assert y.grad_fn is not None


def test_moestream_fused_0_leaves_the_modules_alone(monkeypatch, store):
    monkeypatch.setenv("MOESTREAM_FUSED", "0")
    fused_build.extension.cache_clear()
    try:
        model, _ = moestream.load(store[1], "1MiB")
        assert not any(getattr(n.forward, "func", None) is fused._fused_forward for n in fused._rms_norms(model))
        assert fused.install(model) == 0
    finally:
        monkeypatch.delenv("MOESTREAM_FUSED")
        fused_build.extension.cache_clear()


# -- rotary ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ext():
    built = fused_build.extension()
    assert built is not None
    return built


def _original_rotary(module):
    function = module.apply_rotary_pos_emb
    return function.args[0] if isinstance(function, functools.partial) else function


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rotary_kernel_matches_float64_math(ext, dtype):
    g = torch.Generator().manual_seed(41)
    q = torch.randn(2, 5, 4, 16, generator=g).to(dtype).transpose(1, 2)  # [B, heads, S, D], as attention has it
    k = torch.randn(2, 5, 2, 16, generator=g).to(dtype).transpose(1, 2)
    angles = torch.rand(1, 5, 8, generator=g, dtype=torch.float64) * 6
    cos, sin = (torch.cat([f(angles), f(angles)], dim=-1).to(dtype) for f in (torch.cos, torch.sin))
    for x, got in zip((q, k), ext.rotary(q, k, cos, sin)):
        x64, c, s = x.double(), cos.double()[:, None], sin.double()[:, None]
        rotated = torch.cat([-x64[..., 8:], x64[..., :8]], dim=-1)
        exact = x64 * c + rotated * s
        # each product and the sum rounded once to the dtype
        bound = 3 * torch.finfo(dtype).eps * ((x64 * c).abs() + (rotated * s).abs()) + 1e-30
        assert got.dtype == dtype and got.shape == x.shape
        assert bool(((got.double() - exact).abs() <= bound).all())


def test_rotary_agrees_with_the_standard_formula_only(ext):
    from transformers.models.deepseek_v3 import modeling_deepseek_v3
    from transformers.models.gpt_oss import modeling_gpt_oss
    from transformers.models.mixtral import modeling_mixtral
    from transformers.models.qwen3_moe import modeling_qwen3_moe

    for module in (modeling_qwen3_moe, modeling_mixtral, modeling_deepseek_v3):
        assert fused.rotary_agrees(_original_rotary(module), ext.rotary), module.__name__
    # DeepSeek's interleaved pairs and gpt-oss's half-width cos/sin are other formulas
    assert not fused.rotary_agrees(modeling_deepseek_v3.apply_rotary_pos_emb_interleave, ext.rotary)
    assert not fused.rotary_agrees(_original_rotary(modeling_gpt_oss), ext.rotary)


def test_a_loaded_model_rotates_with_the_kernel_and_equals_transformers_own(ext, store, monkeypatch):
    from transformers.models.qwen3_moe import modeling_qwen3_moe

    ckpt, path = store
    model, _ = moestream.load(path, "1MiB")
    function = modeling_qwen3_moe.apply_rotary_pos_emb
    assert isinstance(function, functools.partial) and function.func is fused._fused_rotary
    ids = torch.randint(0, 250, (2, 9), generator=torch.Generator().manual_seed(42))
    with torch.inference_mode():
        got = model(ids).logits
        monkeypatch.setattr(modeling_qwen3_moe, "apply_rotary_pos_emb", function.args[0])  # transformers' own
        expected = model(ids).logits
    assert torch.equal(got, expected)
    # other arguments go to the original function
    q, k = torch.randn(1, 3, 2, 8), torch.randn(1, 3, 2, 8)
    cos, sin = torch.randn(1, 3, 8), torch.randn(1, 3, 8)
    for a, b in zip(function(q, k, cos, sin, unsqueeze_dim=2), function.args[0](q, k, cos, sin, unsqueeze_dim=2)):
        assert torch.equal(a, b)


def test_the_rotary_is_checked_at_load_for_the_models_kinds_only(ext, store, monkeypatch):
    """The load checks the kinds of call the model's config makes; a call of another kind (here a head size
    of 12) goes to the original function, and nothing is checked at call time."""
    from transformers.models.qwen3_moe import modeling_qwen3_moe

    ckpt, path = store
    model, _ = moestream.load(path, "1MiB", compute_dtype="fp32")
    function = modeling_qwen3_moe.apply_rotary_pos_emb
    verdicts = function.args[2]
    config = model.config
    assert verdicts[(torch.float32, config.head_dim, config.num_attention_heads, config.num_key_value_heads)] is True
    checked = dict(verdicts)
    calls = []
    monkeypatch.setattr(fused, "rotary_agrees", lambda *args, **kwargs: calls.append(args) or True)
    g = torch.Generator().manual_seed(50)
    q, k = torch.randn(1, 2, 3, 12, generator=g), torch.randn(1, 1, 3, 12, generator=g)
    cos, sin = torch.randn(1, 3, 12, generator=g), torch.randn(1, 3, 12, generator=g)
    for a, b in zip(function(q, k, cos, sin), function.args[0](q, k, cos, sin)):
        assert torch.equal(a, b)
    assert not calls and verdicts == checked


# -- the one-token experts kernel -------------------------------------------------------------------------


@pytest.mark.parametrize("int8_activations", [False, True])
@pytest.mark.parametrize("name", ["int4", "int8", "mxfp4", "iq4nl"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])  # float32: CPUs without bf16 arithmetic
def test_experts_kernel_matches_float64_math_and_the_engines_own_path(ext, name, dtype, int8_activations):
    from moestream.conversion import quant
    from moestream.core.compute.kernels import cpu_record, expert_linear, table_values

    if name in quant.TABLES and not int8_activations:
        pytest.skip("a table format's one-token kernel takes int8 activations (plan.compiled_format)")

    g = torch.Generator().manual_seed(43)
    hidden, inner, n = 64, 128, 3
    fmt = quant.QuantFormat.make(name, 32)
    x = torch.randn(1, hidden, generator=g).to(dtype)
    records, exact = [], []
    for _ in range(n):
        q1 = quant.quantize(torch.randn(2 * inner, hidden, generator=g) / 8, fmt)
        q2 = quant.quantize(torch.randn(hidden, inner, generator=g) / 8, fmt)
        record = {**quant.pack(q1, fmt, "gate_up_proj"), **quant.pack(q2, fmt, "down_proj")}
        records.append(record if int8_activations else cpu_record(record, fmt))  # int8 activations: as stored
        h = quant.reference_dequantize(q1, fmt) @ x.double()[0]
        a = torch.nn.functional.silu(h[:inner]) * h[inner:]
        exact.append(quant.reference_dequantize(q2, fmt) @ a)
    p = fmt.params
    table = table_values(name) if fmt.table is not None else None
    chosen = [_chosen(fmt, int8_activations, dtype, k) for k in (hidden, inner)]  # the plan's kernels
    got = ext.experts_decode(
        x,
        [r["gate_up_proj.qweight"] for r in records],
        [r[f"gate_up_proj.{p}"] for r in records],
        [r["down_proj.qweight"] for r in records],
        [r[f"down_proj.{p}"] for r in records],
        fmt.bits,
        fmt.group_size or 0,
        *chosen,
        None,
        table,
    )
    assert got.shape == (n, hidden) and got.dtype == dtype
    for j, r in enumerate(records):
        error = (got[j].double() - exact[j]).norm() / exact[j].norm()
        # bf16 activations (the float int4 kernel takes no other), rounded after each op; or int8 activations
        assert error.item() < (2e-2 if int8_activations else 1e-2)
        h = expert_linear(x, r, "gate_up_proj", fmt, False, int8_activations)
        gate, up = h.chunk(2, dim=-1)
        own = expert_linear(torch.nn.functional.silu(gate) * up, r, "down_proj", fmt, False, int8_activations)
        assert torch.equal(got[j : j + 1], own)  # the same kernels and ops, without the Python between them
    weights = torch.rand(n, 1, generator=g)  # float32, as the routers give them on the CPU
    summed = ext.experts_decode(
        x, *(list(args) for args in zip(*[_matrices(r, fmt) for r in records])), fmt.bits, fmt.group_size or 0,
        *chosen, weights, table,
    )  # fmt: skip
    assert torch.equal(summed, got.clone().mul_(weights).view(1, n, -1).sum(dim=1))  # as the engine sums them


def _chosen(fmt, int8_activations, dtype, k):
    """The kernel the plan chooses for a matrix of K inputs, by the code the C++ takes."""
    from moestream.core.compute import kernels

    return kernels.compiled_kernel(kernels.matmul_kernel(fmt, int8_activations, False, dtype, k))


def _matrices(record, fmt):
    p = fmt.params
    return record["gate_up_proj.qweight"], record[f"gate_up_proj.{p}"], record["down_proj.qweight"], record[f"down_proj.{p}"]


@pytest.fixture(scope="module")
def int4_store(tmp_path_factory):
    root = tmp_path_factory.mktemp("fused-experts")
    model = make_model("qwen3_moe", seed=44, dtype=torch.bfloat16, **dict(TINY["qwen3_moe"], moe_intermediate_size=64))
    return moestream.convert(save_checkpoint(model, root / "hf"), root / "store", experts_dtype="int4", progress=False)


def _decode_step_logits(path, budget, compute_dtype):
    model, _ = moestream.load(path, budget, prefetch="off", compute_dtype=compute_dtype)
    prompt = torch.randint(0, 250, (1, 7), generator=torch.Generator().manual_seed(45))
    with torch.inference_mode():
        out = model(prompt, use_cache=True)
        step = model(out.logits[:, -1:].argmax(-1), cache=out.past_key_values)
    return step.logits, model


@pytest.mark.parametrize("compute_dtype", ["bf16", "fp32"])  # pinned: "auto" differs between CPUs
def test_one_token_calls_take_the_experts_kernel_and_budgets_do_not_change_its_numbers(
    ext, int4_store, monkeypatch, compute_dtype
):
    from moestream.core.engine import engine_of

    manifest = Store(int4_store).manifest
    slot, top_k = manifest.max_record_stride, manifest.model_config["num_experts_per_tok"]
    everything = sum(layer.num_experts for layer in manifest.layers) * slot
    full, model = _decode_step_logits(int4_store, everything, compute_dtype)
    kernels = [found for plan in engine_of(model).plans for found in plan.one_token.values()]
    assert kernels and all(found is not None and found[0] is ext.experts_decode for found in kernels)
    # the minimum budget: misses computed one by one as their reads land, hits together
    small, model = _decode_step_logits(int4_store, top_k * slot, compute_dtype)
    assert moestream.stats(model)["evictions"] > 0
    assert torch.equal(small, full)
    # the engine's own path (the module's gate, one op at a time) computes the same bits
    monkeypatch.setattr(fused, "experts_kernel", lambda *args: None)
    own, model = _decode_step_logits(int4_store, everything, compute_dtype)
    assert all(found is None for plan in engine_of(model).plans for found in plan.one_token.values())
    assert torch.equal(full, own)


@pytest.mark.parametrize("compute_dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("activations", ["int8", "float"])
def test_a_prompt_takes_the_prefill_experts_kernel_with_the_engines_own_bits(
    ext, int4_store, monkeypatch, compute_dtype, activations
):
    """Many tokens through a layer's experts: `experts_prefill` (each expert on its rows in C++, the experts
    spread over the threads) gives the logits of the engine's own loop, bit for bit, whatever the budget
    hands over together."""
    from moestream.core.compute import plan

    manifest = Store(int4_store).manifest
    slot, top_k = manifest.max_record_stride, manifest.model_config["num_experts_per_tok"]
    everything = sum(layer.num_experts for layer in manifest.layers) * slot
    used = []
    original = plan.ExpertsPlan.prefill_kernel
    monkeypatch.setattr(plan.ExpertsPlan, "prefill_kernel", lambda self, *a: used.append(original(self, *a)) or used[-1])

    def prompt_logits(budget):
        model, _ = moestream.load(int4_store, budget, prefetch="off", compute_dtype=compute_dtype, activations=activations)
        prompt = torch.randint(0, 250, (2, 40), generator=torch.Generator().manual_seed(46))  # a batch of two prompts
        with torch.inference_mode():
            return model(prompt).logits

    full = prompt_logits(everything)
    assert used and all(found is not None and found[0] is ext.experts_prefill for found in used)
    small = prompt_logits(top_k * slot)  # misses computed as their reads land, a few experts at a time
    assert torch.equal(small, full)
    monkeypatch.setattr(fused, "experts_kernel", lambda *args: None)  # the engine's own loop, op by op
    used.clear()
    own = prompt_logits(everything)
    assert used and all(found is None for found in used)
    assert torch.equal(own, full)


# -- routers ----------------------------------------------------------------------------------------------


def _router(family, **overrides):
    from moestream.core.supply.prefetch import find_router

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **dict(TINY[family], **overrides)))
    layer = model.model.layers[-1]
    return find_router(layer.mlp if hasattr(layer, "mlp") else layer.block_sparse_moe)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_router_kernel_reproduces_softmax_routers_only(ext, dtype):
    kernel = ext.softmax_topk_router
    assert fused.router_variant(_router("qwen3_moe", norm_topk_prob=True).to(dtype), kernel) == (True, True)
    assert fused.router_variant(_router("qwen3_moe", norm_topk_prob=False).to(dtype), kernel) == (False, True)
    assert fused.router_variant(_router("olmoe", norm_topk_prob=False).to(dtype), kernel) == (False, True)
    mixtral = fused.router_variant(_router("mixtral").to(dtype), kernel)  # its weights stay float32
    assert mixtral == ((True, True) if dtype == torch.float32 else (True, False))
    # sigmoid scores with groups and a bias, and top-k before the softmax: other formulas
    assert fused.router_variant(_router("deepseek_v3").to(dtype), kernel) is None
    assert fused.router_variant(_router("gpt_oss").to(dtype), kernel) is None


def test_a_loaded_models_routers_use_the_kernel_with_the_same_bits(ext, store):
    from moestream.core.supply.prefetch import find_router

    model, _ = moestream.load(store[1], "1MiB")
    routers = [find_router(layer.mlp) for layer in model.model.layers]
    assert all(getattr(r.forward, "func", None) is fused._fused_router for r in routers)
    x = torch.randn(5, routers[0].weight.shape[1], generator=torch.Generator().manual_seed(46))
    with torch.no_grad():
        for a, b in zip(routers[0](x), type(routers[0]).forward(routers[0], x)):
            assert torch.equal(a, b)
        x64 = x.double()  # another dtype than the weight's: the router's own forward (which raises here or promotes)
        with pytest.raises(RuntimeError):
            type(routers[0]).forward(routers[0], x64)
        with pytest.raises(RuntimeError):
            routers[0](x64)


# -- one token's attention --------------------------------------------------------------------------------


def _attention_modules(model):
    return [m for m in model.modules() if type(m).__name__.endswith("Attention")]


def _store_of(family, root, dense_dtype, **overrides):
    model = make_model(family, seed=47, dtype=torch.bfloat16, **dict(TINY[family], **overrides))
    return moestream.convert(save_checkpoint(model, root / "hf"), root / "store", dense_dtype=dense_dtype, progress=False)


def _decode_logits(model, steps=6):
    """A 7-token prompt, then `steps` greedy one-token steps through transformers' dynamic cache."""
    from moestream.generation.generate import Forward

    forward = Forward(model)
    ids = torch.randint(0, 250, (1, 7), generator=torch.Generator().manual_seed(48))
    out = []
    with torch.inference_mode():
        for _ in range(steps + 1):
            logits = forward(ids)[:, -1]
            out.append(logits)
            ids = logits.argmax(-1, keepdim=True)
    return out


@pytest.mark.parametrize(
    "family, dense_dtype, compute_dtype",
    [("qwen3_moe", "int8", "bf16"), ("qwen3_moe", "float", "fp32"), ("mixtral", "int8", "fp32"), ("olmoe", "int4", "bf16")],
)
def test_one_token_attention_takes_the_fused_step_with_the_modules_own_bits(ext, tmp_path, family, dense_dtype, compute_dtype):
    """Per-head q/k norms (Qwen3-MoE), none (Mixtral), norms over the whole projection (OLMoE); int8, int4
    and float projections; bf16 and float32 pinned (`auto` differs between CPUs): every attention module
    takes the fused step, and decoding gives the bits of the modules' own forwards."""
    model, _ = moestream.load(_store_of(family, tmp_path, dense_dtype), "64MiB", prefetch="off", compute_dtype=compute_dtype)
    attention = _attention_modules(model)
    assert attention and all(getattr(m.forward, "func", None) is fused._fused_attention for m in attention)
    owns = [m.forward.args[-1] for m in attention]
    fallbacks = _count_fallbacks(attention)
    fast = _decode_logits(model)
    assert len(fallbacks) == len(attention)  # the prompt only: the keywords checked at load are those decoding passes
    for m, own in zip(attention, owns):
        m.forward = own  # the module's own forward
    own = _decode_logits(model)
    assert all(torch.equal(a, b) for a, b in zip(fast, own))


def _count_fallbacks(attention) -> list:
    """Make each fused attention module's fallback (its own forward) note the shape of each call it takes."""
    calls = []
    for m in attention:
        own = m.forward.args[-1]
        m.forward = functools.partial(
            m.forward.func, *m.forward.args[:-1], lambda *a, own=own, **k: calls.append(a[0].shape) or own(*a, **k)
        )
    return calls


def test_table_format_projections_take_the_fused_steps_with_the_modules_own_bits(ext, tmp_path):
    """A GGUF's IQ4_NL attention projections and experts (stored iq4nl, with int8 activations) take the fused
    one-token attention and experts steps, and decoding gives the bits of the modules' own forwards."""
    from gguf import GGMLQuantizationType as Q
    from test_gguf_convert import TYPES, WIDE, write_gguf

    from moestream.conversion.store import Store

    leaves = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
    write_gguf(make_model("qwen3_moe", seed=23, **WIDE), tmp_path / "m.gguf", types={**TYPES, **dict.fromkeys(leaves, Q.IQ4_NL)})
    store = moestream.convert(tmp_path / "m.gguf", tmp_path / "store", progress=False)
    manifest = Store(store).manifest
    assert manifest.experts_dtype == "iq4nl-g32"
    assert {f.name for name, f in manifest.dense.items() if ".self_attn." in name} == {"iq4nl"}
    model, _ = moestream.load(store, "64MiB", prefetch="off", compute_dtype="bf16", activations="int8")
    attention = _attention_modules(model)
    assert attention and all(getattr(m.forward, "func", None) is fused._fused_attention for m in attention)
    experts = [p for p in model._moestream_engine.fast_paths if p.name == "experts (one token)"]
    assert experts and experts[0].on == experts[0].of > 0
    fast = _decode_logits(model)
    for m in attention:
        m.forward = m.forward.args[-1]  # the module's own forward
    own = _decode_logits(model)
    assert all(torch.equal(a, b) for a, b in zip(fast, own))


def test_the_fused_attention_leaves_prompts_masks_and_batches_to_the_modules_own(ext, tmp_path):
    model, _ = moestream.load(_store_of("qwen3_moe", tmp_path, "int8"), "64MiB", prefetch="off", compute_dtype="bf16")
    calls = _count_fallbacks(_attention_modules(model))
    _decode_logits(model, steps=3)
    layers = len(model.model.layers)
    assert calls == [torch.Size([1, 7, 32])] * layers  # the prompt only: the one-token steps took the kernels
    calls.clear()
    ids = torch.randint(0, 250, (2, 5), generator=torch.Generator().manual_seed(49))
    with torch.inference_mode():
        out = model(ids, attention_mask=torch.ones(2, 5, dtype=torch.long), use_cache=True)
        model(ids[:, :1], cache=out.past_key_values, attention_mask=torch.ones(2, 6, dtype=torch.long))
    assert [s[0] for s in calls] == [2] * (2 * layers)  # two rows: the module's own forward


def test_only_attention_the_kernels_reproduce_takes_them(ext, tmp_path):
    # MLA (DeepSeek-V3) has no q/k/v projections, Qwen2-MoE's have biases, gpt-oss adds sinks and sliding
    # layers; OLMoE clipping q/k/v is not what the kernels compute
    cases = (("deepseek_v3", {}), ("qwen2_moe", {}), ("gpt_oss", {}), ("olmoe", {"clip_qkv": 0.5}))
    for family, overrides in cases:
        model, _ = moestream.load(_store_of(family, tmp_path / family, "int8", **overrides), "64MiB", prefetch="off")
        assert not any(getattr(m.forward, "func", None) is fused._fused_attention for m in _attention_modules(model))
    # the check itself fails on a forward whose numbers differ in the last place of one element
    model, _ = moestream.load(_store_of("qwen3_moe", tmp_path / "qwen3", "int8"), "64MiB", prefetch="off")
    m = _attention_modules(model)[0]
    fast, own = m.forward, m.forward.args[-1]

    def off_by_one(*args, **kwargs):
        out, weights = own(*args, **kwargs)
        out = out.clone()
        out.view(-1)[3] = torch.nextafter(out.view(-1)[3], torch.tensor(float("inf"), dtype=out.dtype))
        return out, weights

    dtype = model.get_input_embeddings().weight.dtype
    assert fused.attention_agrees(m, fast, own, dtype)
    assert not fused.attention_agrees(m, fast, off_by_one, dtype)


def test_experts_kernel_runs_int8_at_widths_torchs_bf16_kernel_gets_wrong_as_the_engine_does(ext):
    """int8 records with bf16 activations whose widths are not multiples of 16: torch's bf16 int8 kernel is wrong
    there, so both the kernel (its one dispatch, `project`) and kernels.py's `_int8` compute in float32: the
    same bits, and close to float64 math."""
    from moestream.conversion import quant
    from moestream.core.compute.kernels import expert_linear

    g = torch.Generator().manual_seed(47)
    hidden, inner, n = 40, 24, 2
    fmt = quant.QuantFormat.make("int8")
    x = torch.randn(1, hidden, generator=g).to(torch.bfloat16)
    records, exact = [], []
    for _ in range(n):
        q1 = quant.quantize(torch.randn(2 * inner, hidden, generator=g) / 8, fmt)
        q2 = quant.quantize(torch.randn(hidden, inner, generator=g) / 8, fmt)
        records.append({**quant.pack(q1, fmt, "gate_up_proj"), **quant.pack(q2, fmt, "down_proj")})
        h = quant.reference_dequantize(q1, fmt) @ x.double()[0]
        exact.append(quant.reference_dequantize(q2, fmt) @ (torch.nn.functional.silu(h[:inner]) * h[inner:]))
    got = ext.experts_decode(
        x, *(list(args) for args in zip(*[_matrices(r, fmt) for r in records])), 8, 0,
        *(_chosen(fmt, False, torch.bfloat16, k) for k in (hidden, inner)), None, None,
    )  # fmt: skip
    assert _chosen(fmt, False, torch.bfloat16, hidden) == 3  # (the plan's choice: in float32)
    for j, r in enumerate(records):
        assert ((got[j].double() - exact[j]).norm() / exact[j].norm()).item() < 1e-2
        gate, up = expert_linear(x, r, "gate_up_proj", fmt, False).chunk(2, dim=-1)
        own = expert_linear(torch.nn.functional.silu(gate) * up, r, "down_proj", fmt, False)
        assert torch.equal(got[j : j + 1], own)
