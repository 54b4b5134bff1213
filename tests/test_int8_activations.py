"""The int8-activation kernels (native/lowbit_dot.h): against the float64 reference of exactly their arithmetic
(kernels.int8_activations_reference), with each variant of the loops this CPU has (AVX-512 VNNI, AVX2, the
portable loops), and a whole model run with them against the same model with float activations."""

import pytest
import torch

import moestream
from moestream.conversion.quant import QuantFormat, pack, quantize, reference_dequantize
from moestream.conversion.store import Store
from moestream.conversion.synthetic import make_model, save_checkpoint
from moestream.core import loading
from moestream.core.compute import fused, kernels, plan
from moestream.core.engine import engine_of
from moestream.errors import UsageError
from moestream.native import fused_build


@pytest.fixture(scope="module")
def ext():
    extension = fused_build.extension()
    if extension is None:
        pytest.skip(f"no compiled kernels: {fused.unavailable_reason()}")
    return extension


ISAS = ["portable", "avx2", "avx512-vnni"]  # from the plainest


def _variants(ext) -> list[str]:
    """The loops' variants this CPU runs: the portable one and every SIMD one up to its best."""
    previous = ext.lowbit_isa(ISAS[-1])
    best = ext.lowbit_isa(previous)
    return ISAS[: ISAS.index(best) + 1]


@pytest.fixture(params=ISAS)
def loop(request, ext):
    """Each test once with each variant of the loops this CPU has (the others are skipped)."""
    if request.param not in _variants(ext):
        pytest.skip(f"this CPU has no {request.param}")
    previous = ext.lowbit_isa(request.param)
    assert ext.lowbit_isa("") == request.param
    yield request.param
    ext.lowbit_isa(previous)


def _matrix(fmt: QuantFormat, n: int, k: int, g: torch.Generator):
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g)  # rows of different scales
    q = quantize(w, fmt)
    record = pack(q, fmt, "w")
    return q, record["w.qweight"], record[f"w.{fmt.params}"]


def _activations(m: int, k: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(m, k, generator=g) * torch.exp(torch.randn(m, k // 32, 1, generator=g)).repeat_interleave(32, 1).view(m, k)
    x[0, 32:64] = 0  # a block of zeros: its scale is 0, its codes 0
    return x.to(dtype)


FORMATS = [("int4", 32), ("int4", 64), ("int4", 128), ("int3", 64), ("int2", 32), ("int6", 32), ("int6", 64), ("int6", 128), ("int8", None),
           ("mxfp4", 32), ("iq4nl", 32)]  # fmt: skip


@pytest.mark.parametrize("name,group", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n,k", [(1, 8, 64), (3, 24, 128), (4, 16, 256), (9, 136, 384), (21, 40, 256)])  # 21: the blocked loops
def test_kernels_compute_exactly_the_defined_arithmetic(loop, name, group, dtype, m, n, k):
    fmt = QuantFormat.make(name, group or 32)
    if group and k % group:
        pytest.skip("K is not a multiple of the group")
    g = torch.Generator().manual_seed(m * 1000 + n * 10 + k)
    q, qweight, params = _matrix(fmt, n, k, g)
    x = _activations(m, k, dtype, g)
    assert plan.int8_activations_fit(fmt, n, k)
    got = kernels.quantized_matmul(x, qweight, params, fmt, int8_activations=True)
    assert got.shape == (m, n) and got.dtype == dtype
    exact = kernels.int8_activations_reference(x, qweight, params, fmt)
    # float32 sums over blocks and groups, whose terms are larger than their sum (a mistake in the arithmetic
    # is 1e-3 and more), then the output's own rounding
    tolerance = {torch.float32: 2e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]
    scale = exact.abs().amax(dim=1, keepdim=True)
    assert ((got.double() - exact).abs() / scale).max().item() <= tolerance
    # and close to the float activations' result: int8 rounds each input to 1/254 of its block's largest
    floating = x.double() @ reference_dequantize(q, fmt).T
    assert ((got.double() - floating).norm() / floating.norm()).item() < 2e-2


def test_each_row_gets_the_same_bits_alone_or_with_others(ext):
    """Rows are quantized and summed on their own, in one order, whatever the tile they fall in: a token
    computes the same numbers in a batch as alone."""
    g = torch.Generator().manual_seed(5)
    for name, group in (("int4", 64), ("int8", None)):
        fmt = QuantFormat.make(name, group or 32)
        _, qweight, params = _matrix(fmt, 64, 256, g)
        x = _activations(7, 256, torch.float32, g)
        together = kernels.quantized_matmul(x, qweight, params, fmt, True)
        for row in range(7):
            assert torch.equal(together[row : row + 1], kernels.quantized_matmul(x[row : row + 1], qweight, params, fmt, True))


@pytest.mark.parametrize("name,group", FORMATS)
def test_the_blocked_loops_give_every_row_the_bits_it_gets_alone(loop, ext, name, group):
    """A prefill's many rows run the blocked loops (lowbit_gemm.h) where the variant has them: each row still
    gets exactly the bits it gets alone (a token decoded after its prompt meets the same numbers), and the
    bits the decode-shaped loops give the same rows."""
    fmt = QuantFormat.make(name, group or 32)
    g = torch.Generator().manual_seed(len(name) * 100 + (group or 0))
    default_rows = ext.lowbit_gemm_rows(0)
    try:
        for n, k, m in ((48, 256, 37), (24, 768, 16), (40, 384, 133)):  # 133: a block of 128 rows and 5 more
            if group and k % group:
                continue
            _, qweight, params = _matrix(fmt, n, k, g)
            for dtype in (torch.float32, torch.bfloat16):
                x = _activations(m, k, dtype, g)
                blocked = kernels.quantized_matmul(x, qweight, params, fmt, True)
                ext.lowbit_gemm_rows(1 << 40)  # no matmul has that many rows: the decode-shaped loops throughout
                loops = kernels.quantized_matmul(x, qweight, params, fmt, True)
                ext.lowbit_gemm_rows(default_rows)
                alone = torch.cat([kernels.quantized_matmul(x[r : r + 1], qweight, params, fmt, True) for r in range(m)])
                assert torch.equal(blocked, loops), (n, k, m, dtype)
                assert torch.equal(blocked, alone), (n, k, m, dtype)
    finally:
        ext.lowbit_gemm_rows(default_rows)


def test_the_variant_a_matrix_runs_is_the_cpus_best_where_its_loop_takes_the_shape(loop, ext):
    """`lowbit_variant` (what each plan reports) follows the dispatch's rules under every cap: VNNI where K
    is an even number of its 32- or 64-input blocks and the int4 family's groups are not 32, else AVX2."""
    vnni = ISAS.index(loop) >= ISAS.index("avx512-vnni")
    plainer = "avx2" if ISAS.index(loop) >= ISAS.index("avx2") else "portable"
    assert ext.lowbit_variant(8, 0, 64) == (loop if vnni else plainer)
    assert ext.lowbit_variant(8, 0, 96) == plainer  # three blocks of 32
    assert ext.lowbit_variant(4, 64, 128) == ext.lowbit_variant(6, 64, 128) == (loop if vnni else plainer)
    assert ext.lowbit_variant(4, 64, 192) == plainer  # three blocks of 64
    assert ext.lowbit_variant(4, 32, 128) == plainer  # group 32 stays on AVX2
    int4 = QuantFormat.make("int4", 64)
    assert plan.loops_variant(int4, [(8, 128), (8, 192)]) == ", ".join(sorted({ext.lowbit_variant(4, 64, 128), plainer}))


def test_each_simd_variant_agrees_with_the_portable_loops(ext):
    g = torch.Generator().manual_seed(8)
    previous = ext.lowbit_isa("")
    try:
        for name, group in FORMATS:
            fmt = QuantFormat.make(name, group or 32)
            for k in (256, 384):  # (384: an odd number of 128-input pairs for the int8 weights' blocks)
                _, qweight, params = _matrix(fmt, 48, k, g)
                x = _activations(5, k, torch.float32, g)
                ext.lowbit_isa("portable")
                portable = kernels.quantized_matmul(x, qweight, params, fmt, True)
                for variant in _variants(ext)[1:]:
                    ext.lowbit_isa(variant)
                    simd = kernels.quantized_matmul(x, qweight, params, fmt, True)
                    assert torch.allclose(simd, portable, rtol=1e-5, atol=1e-6 * simd.abs().max().item()), (
                        variant,
                        name,
                        group,
                        k,
                    )
    finally:
        ext.lowbit_isa(previous)


def test_the_choice_of_activations(ext, monkeypatch):
    int4 = QuantFormat.make("int4", 64)
    shapes = [(int4, 128, 256), (int4, 256, 128)]
    assert plan.choose_activations("float", shapes, False) == (False, "float activations, as chosen")
    assert plan.choose_activations("int8", shapes, True)[0] is False  # a GPU takes float activations
    assert plan.choose_activations("int8", shapes, False) == (True, "int8 activations, as chosen")
    narrow = [(QuantFormat.make("int4", 32), 16, 32)]  # K = 32: not a multiple of 64
    assert plan.choose_activations("int8", narrow, False)[0] is False
    used, why = plan.choose_activations("auto", shapes, False)
    integer, floating = plan.measure_activations(int4, 128, 256)
    assert integer > 0 and floating > 0
    if floating / integer >= plan.INT8_ACTIVATIONS_MARGIN:  # faster by the margin at one token
        assert used and f"{floating / integer:.1f}x"[:3] in why
    else:  # then a prompt's rows decide, if one token is not slower
        prefill_int8, prefill_float = plan.measure_activations(int4, 128, 256, plan.PREFILL_ROWS, 3)
        gains = prefill_float / prefill_int8 >= plan.INT8_ACTIVATIONS_MARGIN and floating / integer >= 1.0
        assert used == gains and f"at {plan.PREFILL_ROWS} rows" in why and f"{floating / integer:.2f}x at one token" in why
    with pytest.raises(UsageError, match="activations must be one of"):
        plan.choose_activations("int4", shapes, False)
    table = [(QuantFormat.make("mxfp4"), 128, 256)]  # a table format's float path dequantizes per call
    assert plan.choose_activations("auto", shapes + table, False) == (
        True,
        "int8 activations: the only fast kernel for mxfp4 weights",
    )
    monkeypatch.setattr(fused_build, "extension", lambda: None)
    with pytest.raises(UsageError, match="needs the compiled kernels"):
        plan.choose_activations("int8", shapes, False)
    assert plan.choose_activations("auto", shapes, False) == (False, "float activations: no compiled kernels")
    used, why = plan.choose_activations("auto", shapes + table, False)
    assert not used and "mxfp4 weights are dequantized at every matmul" in why and "--experts-dtype int4" in why


@pytest.fixture(scope="module")
def wide_store(tmp_path_factory):
    """A qwen3_moe wide enough for the kernels (K a multiple of 64), int4 experts and attention."""
    root = tmp_path_factory.mktemp("int8act")
    config = dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=128, moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2, max_position_embeddings=128,
    )  # fmt: skip
    ckpt = save_checkpoint(make_model("qwen3_moe", seed=3, **config), root / "hf")
    store = moestream.convert(ckpt, root / "store", experts_dtype="int4", group_size=64, dense_dtype="int4", progress=False)
    return store


def test_a_model_with_int8_activations_stays_close_to_float_ones(ext, wide_store):
    stride = Store(wide_store).manifest.max_record_stride
    integer, _ = moestream.load(wide_store, stride * 2, activations="int8")  # two experts: evicts all the time
    floating, _ = moestream.load(wide_store, stride * 16, activations="float")
    engine = engine_of(integer)
    assert all(plan.int8_activations for plan in engine.plans) and all(
        p is None for p in engine.supply.preparers
    )  # records read as stored
    assert not any(plan.int8_activations for plan in engine_of(floating).plans)
    line = loading.fast_paths(integer)
    assert "low-bit matmuls (int8 activations, as chosen)" in line and "read as stored" in line
    variants = {name for p in engine.plans for name in p.isa.split(", ")}  # each layer's matrices' loops
    assert variants and variants <= set(ISAS) and "int8-activation loops (" in line and "experts layers and linears)" in line
    assert "attention (one token) 2/2" in line  # the fused attention agrees with the int8 linears' own forward
    ids = torch.randint(0, 250, (2, 12), generator=torch.Generator().manual_seed(9))
    with torch.inference_mode():
        got, expected = integer(ids).logits, floating(ids).logits
    assert ((got - expected).norm() / expected.norm()).item() < 3e-2
    kl = torch.nn.functional.kl_div(got.log_softmax(-1), expected.log_softmax(-1), log_target=True, reduction="batchmean")
    assert kl.item() < 1e-2
    # greedy decoding, one token at a time through the fused kernels, is the same under any budget
    prompt = ids[:1, :5]
    small = integer.generate(prompt, max_new_tokens=8, do_sample=False)
    large, _ = moestream.load(wide_store, stride * 16, activations="int8")
    assert torch.equal(small, large.generate(prompt, max_new_tokens=8, do_sample=False))
    for model in (integer, floating, large):
        loading.close(model)


def test_eval_prices_int8_activations_against_float_ones_on_the_same_store(ext, wide_store):
    from moestream.tools.quality import compare

    text = "".join(chr(c) for c in torch.randint(97, 123, (300,), generator=torch.Generator().manual_seed(4)).tolist())
    report = compare(wide_store, wide_store, text, max_tokens=200, context=64, activations="int8")
    assert report.activations == "int8 activations, as chosen"
    assert report.reference_activations == "float activations, as chosen"
    assert 0 < report.kl_mean < 1e-2 and report.top1_agreement > 0.8
    assert "low-bit matmuls" in report.table()
    same = compare(wide_store, wide_store, text, max_tokens=200, context=64, activations="float")
    assert same.kl_mean == 0 and same.top1_agreement == 1.0  # the check can tell: equal paths, equal numbers


def test_bench_kernels_times_both_kernels_of_each_int4_matrix(wide_store):
    """`bench --kernels` on int4 experts: each matrix with the int8-activation kernels (as stored) and torch's
    int4 kernel (on its layout), each with the bytes one call streams."""
    from moestream.core.kernel_timing import time_kernels

    report = time_kernels(wide_store, rotation_bytes=4 << 20)
    rows = sorted((k.shape, k.kernel, k.format) for k in report.kernels)
    assert rows == sorted(
        (shape, kernel, "int4-g64") for shape in [(128, 64), (64, 64)] for kernel in ("int8 activations", "torch int4 kernel")
    )
    for k in report.kernels:
        # codes (N x K/2 bytes) and bf16 scales and zeros (K/64 x N x 2) are what one call streams
        assert k.weight_bytes == k.shape[0] * k.shape[1] // 2 + (k.shape[1] // 64) * k.shape[0] * 2 * 2
        assert k.microseconds > 0 and k.share_of_memory > 0
