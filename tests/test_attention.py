"""The model's attention function (core/compute/attention.py). A decode step's (native/decode_attention.h): the
compiled flash-decoding kernel against float64 attention at 1, 17, 4,096 and 33,000 positions with grouped-query
ratios 1, 4 and 8, with padding masks and a growing cache's strided views; a model running it as its attention
function gives transformers' greedy tokens over 64 steps after a long prompt; `--attention sdpa` and models
whose code decides by the attention's name keep sdpa. A bf16 prompt's (native/prefill_attention.h, CPUs with
AVX-512 BF16): against float64 attention as close as torch's sdpa in bf16, causal, masked, padded, a cached
prefix, every grouped-query ratio and head size it takes; a bf16 model prefilling through it stays as close
to float32 transformers as sdpa does. A float32 prompt's (AVX-512): likewise, and a float32 model prefilling
through it gives transformers' greedy tokens."""

import pytest
import torch
from tiny import TINY
from transformers import AutoModelForCausalLM

import moestream
from moestream.cli import main
from moestream.conversion.synthetic import make_model, save_checkpoint
from moestream.core.compute import attention, fused
from moestream.core.loading import stats
from moestream.native import fused_build

SIMD = ["avx512", "avx2", "loops"]  # from the most capable


@pytest.fixture(scope="module", params=SIMD)
def ext(request):
    """The kernels, once with each set of loops this CPU can run: AVX-512, AVX2, and the loops the compiler
    writes for every CPU."""
    extension = fused_build.extension()
    if extension is None:
        pytest.skip(f"no compiled kernels: {fused.unavailable_reason()}")
    best = extension.decode_attention_simd("avx512")
    extension.decode_attention_simd(best)
    if SIMD.index(request.param) < SIMD.index(best):
        pytest.skip(f"this CPU has no {request.param}")
    extension.decode_attention_simd(request.param)
    yield extension
    extension.decode_attention_simd("avx512")  # (the default: the most capable loops the CPU has)


def reference(q, k, v, mask, scale):
    """Attention in float64, the key/value heads repeated for their query heads."""
    groups = q.shape[1] // k.shape[1]
    keys, values = (t.double().repeat_interleave(groups, 1) for t in (k, v))
    scores = (q.double() @ keys.transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, -1) @ values


@pytest.mark.parametrize("positions", [1, 17, 4096, 33000])
@pytest.mark.parametrize("groups", [1, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_the_kernel_against_float64(ext, positions, groups, dtype):
    """int8: an 8-bit cache's packed rows (float32 queries), against float64 attention over the rows they
    unpack to: the kernel adds no error of its own to the cache's rounding."""
    g = torch.Generator().manual_seed(positions * 10 + groups)
    kv_heads, dim = (2, 64) if positions > 4096 else (4, 128)
    q = torch.randn(2, kv_heads * groups, 1, dim, generator=g).to(dtype if dtype != torch.int8 else torch.float32)
    # scores of a few units, as trained models' are (a random key of 128 unit entries gives about 1)
    k = torch.randn(2, kv_heads, positions, dim, generator=g) * 2
    v = torch.randn(2, kv_heads, positions, dim, generator=g)
    if dtype == torch.int8:
        k, v = attention.pack_int8(k), attention.pack_int8(v)
        rows = attention.unpack_int8(k, torch.float64), attention.unpack_int8(v, torch.float64)
    else:
        k, v = k.to(dtype), v.to(dtype)
        rows = k, v
    mask = torch.ones(2, 1, 1, positions, dtype=torch.bool)
    mask[1, ..., : positions // 3] = False  # the second row left-padded, as a batch's shorter row is
    scale = dim**-0.5
    exact = reference(q, *rows, mask, scale)
    got = ext.decode_attention(q, k, v, mask, scale)
    assert got.dtype == q.dtype and got.shape == q.shape
    # float32: sums of thousands of terms in float32; bf16: the output's own rounding (2^-8 relative)
    tolerance = {torch.float32: 2e-6, torch.int8: 2e-6, torch.bfloat16: 8e-3}[dtype]
    assert (got.double() - exact).abs().max().item() <= tolerance * max(1.0, exact.abs().max().item())
    # no mask at all: every position
    alone = [t[:1] for t in rows]
    assert torch.allclose(ext.decode_attention(q[:1], k[:1], v[:1], None, scale).double(), reference(q[:1], *alone, None, scale),
                          atol=tolerance * 4, rtol=0)  # fmt: skip


def test_strided_views_of_a_growing_cache_and_an_additive_mask(ext):
    g = torch.Generator().manual_seed(3)
    room = torch.randn(1, 4, 700, 64, generator=g).bfloat16()  # a cache buffer with room past its 500 positions
    k, v = room[:, :, :500], room.flip(2)[:, :, :500]
    assert not k.is_contiguous()
    q = torch.randn(1, 16, 1, 64, generator=g).bfloat16()
    additive = torch.zeros(1, 1, 1, 500)
    additive[..., :100] = float("-inf")
    expected = ext.decode_attention(q, k.contiguous(), v.contiguous(), additive > -1, 0.125)
    assert torch.equal(ext.decode_attention(q, k, v, additive, 0.125), expected)


def test_a_model_running_it_gives_transformers_greedy_tokens_after_a_long_prompt(ext, tmp_path):
    model = make_model("qwen3_moe", seed=2, **{**TINY["qwen3_moe"], "max_position_embeddings": 4096})
    checkpoint = save_checkpoint(model, tmp_path / "hf")
    assert main(["convert", str(checkpoint), str(tmp_path / "store"), "--experts-dtype", "fp32"]) == 0
    prompt = torch.randint(3, model.config.vocab_size, (1, 2000), generator=torch.Generator().manual_seed(9))
    reference_model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    expected = reference_model.generate(prompt, max_new_tokens=64, min_new_tokens=64, do_sample=False)
    streamed, _ = moestream.load(tmp_path / "store", "1GiB")
    assert streamed.config._attn_implementation == attention.NAME
    line = next(p["note"] for p in stats(streamed)["fast_paths"] if p["name"] == "attention function")
    assert line.startswith("flash-decoding kernel")
    assert torch.equal(streamed.generate(prompt, max_new_tokens=64, min_new_tokens=64, do_sample=False), expected)
    plain, _ = moestream.load(tmp_path / "store", "1GiB", attention="sdpa")
    assert plain.config._attn_implementation == "sdpa"
    assert next(p["note"] for p in stats(plain)["fast_paths"] if p["name"] == "attention function") == "sdpa, as chosen"
    # the kernel is what runs a decode step: its last bits are its own, within float32 rounding of sdpa's
    steps = []
    for m in (streamed, plain):
        with torch.no_grad():
            cache = m(prompt, use_cache=True).past_key_values
            steps.append(m(expected[:, 2000:2001], cache=cache, use_cache=True).logits)
    assert 0 < (steps[0] - steps[1]).abs().max().item() < 1e-5


def test_models_whose_code_decides_by_the_name_keep_sdpa():
    class PlainAttention(torch.nn.Module):
        def forward(self, x):
            return x

    class SparseAttention(torch.nn.Module):
        def forward(self, x):
            if self.config._attn_implementation in ("eager", "sdpa"):
                return x
            return -x

    assert not attention._branches_on_the_name(PlainAttention)
    assert attention._branches_on_the_name(SparseAttention)
    with pytest.raises(moestream.errors.UsageError, match="attention must be one of"):
        attention.install(torch.nn.Linear(1, 1), "flash", False)


def test_a_padded_row_in_a_batch_gets_the_bits_it_gets_alone(ext):
    """A batch's rows are right-aligned, a shorter row's padding masked at the front: the kernel cuts the
    positions from the last one, so the row sums the same terms in the same order as alone."""
    g = torch.Generator().manual_seed(11)
    for positions, padding in ((700, 0), (700, 45), (1300, 600), (90, 89)):
        q = torch.randn(2, 8, 1, 64, generator=g)
        k, v = (torch.randn(2, 2, positions, 64, generator=g) for _ in range(2))
        mask = torch.ones(2, 1, 1, positions, dtype=torch.bool)
        mask[1, ..., :padding] = False
        batch = ext.decode_attention(q, k, v, mask, 0.125)
        for row, start in ((0, 0), (1, padding)):
            alone = ext.decode_attention(q[row : row + 1], k[row : row + 1, :, start:], v[row : row + 1, :, start:], None, 0.125)
            assert torch.equal(batch[row : row + 1], alone), (positions, padding, row)


@pytest.fixture
def no_prefill_kernel():
    """The prefill kernel switched off for a test (what a CPU without AVX-512 BF16 runs), on again after."""
    extension = fused_build.extension()
    was = extension.prefill_attention_switch(False) if extension is not None else None
    yield
    if extension is not None:
        extension.prefill_attention_switch(was)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_prompt_of_grouped_heads_gets_transformers_sdpa_bits_without_the_repeated_heads(dtype, no_prefill_kernel):
    """On the CPU a prompt's grouped-query attention runs sdpa on the key and value heads as they are: the
    output is transformers' own sdpa function's (which repeats them first) bit for bit, with a causal mask,
    a padded row, no mask at all (sdpa's causal flag) and keys longer than the queries (a cached prefix)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    for batch, heads, kv_heads, queries, keys, dim in ((1, 32, 4, 19, 300, 128), (2, 16, 2, 7, 7, 64), (2, 14, 2, 33, 90, 64)):
        module = torch.nn.Module()
        module.num_key_value_groups, module.is_causal = heads // kv_heads, True
        q = torch.randn(batch, heads, queries, dim, generator=g).to(dtype)
        k, v = (torch.randn(batch, kv_heads, keys, dim, generator=g).to(dtype) for _ in range(2))
        causal = torch.ones(queries, keys, dtype=torch.bool).tril(keys - queries)[None, None].expand(batch, 1, -1, -1)
        padded = causal.clone()
        padded[0, ..., :3] = False
        for mask in (causal, padded) + ((None,) if queries == keys else ()):
            assert attention._grouped_prompt_on_cpu(module, q, k, v, {})
            ours, _ = attention.attend(module, q, k, v, mask, scaling=dim**-0.5)
            theirs, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=dim**-0.5)
            assert ours.shape == theirs.shape and torch.equal(ours, theirs), (dtype, batch, heads, queries, keys)


@pytest.fixture
def prefill_ext():
    extension = fused_build.extension()
    if extension is None:
        pytest.skip(f"no compiled kernels: {fused.unavailable_reason()}")
    if not extension.prefill_attention_ready(False):
        pytest.skip("this CPU has no AVX-512: prompts run sdpa")
    return extension


def needs(ext, dtype) -> None:
    """Skip where this CPU cannot run the kernel in `dtype` (whether or not a test has switched it off)."""
    was = ext.prefill_attention_switch(True)
    ready = ext.prefill_attention_ready(dtype == torch.bfloat16)
    ext.prefill_attention_switch(was)
    if not ready:
        pytest.skip("this CPU has no AVX-512 BF16: bf16 prompts run sdpa")


def prompt_reference(q, k, v, mask, causal, scale):
    """A prompt's attention in float64 -> [B, Q, H, D]: query i's keys are 0 .. T - Q + i when causal (no
    mask), the mask's when given."""
    queries, positions = q.shape[2], k.shape[2]
    if mask is None and causal:
        mask = torch.arange(positions)[None, :] <= (positions - queries + torch.arange(queries))[:, None]
    return reference(q, k, v, mask, scale).transpose(1, 2)


# (batch, heads, kv heads, queries, keys, head size, mask): every grouped-query ratio the models use and one that
# is not a power of two, head sizes from 64 to 256, query and key counts that fill no block exactly
PROMPTS = [
    (1, 32, 4, 200, 200, 128, "causal"),
    (1, 16, 16, 131, 131, 64, "causal"),
    (2, 14, 2, 77, 130, 64, "padded"),  # a batch with a cached prefix, the first row left-padded
    (1, 16, 2, 97, 97, 256, "causal"),
    (2, 12, 4, 65, 65, 96, "padded"),
    (1, 8, 1, 40, 40, 128, "none"),  # every key for every query (an encoder's attention)
    (1, 8, 2, 3, 300, 128, "padded"),  # a few tokens after a long cached prefix
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("batch,heads,kv_heads,queries,positions,dim,masking", PROMPTS)
def test_the_prefill_kernel_against_float64_as_close_as_sdpa(
    prefill_ext, dtype, batch, heads, kv_heads, queries, positions, dim, masking
):
    """Queries, keys and values in bf16 or float32 (keys of a few units, as trained models' scores are): the
    kernel's output is within its dtype's rounding of float64 attention; on average, in bf16 within 1.3x of
    float64 attention rounded once to bf16 (the best a bf16 output can be; rounding the weights to bf16 before
    the values, as torch's sdpa also does, adds the rest), in float32 as close as torch's sdpa."""
    needs(prefill_ext, dtype)
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    q = torch.randn(batch, heads, queries, dim, generator=g).to(dtype)
    k = (torch.randn(batch, kv_heads, positions, dim, generator=g) * 2).to(dtype)
    v = torch.randn(batch, kv_heads, positions, dim, generator=g).to(dtype)
    mask = None
    if masking == "padded":
        mask = torch.ones(queries, positions, dtype=torch.bool).tril(positions - queries)[None, None].repeat(batch, 1, 1, 1)
        mask[0, ..., : positions // 5] = False
    scale = dim**-0.5
    exact = prompt_reference(q, k, v, mask, masking == "causal", scale)
    got = prefill_ext.prefill_attention(q, k, v, mask, scale, masking == "causal")
    assert got.dtype == dtype and got.shape == (batch, queries, heads, dim)
    attends = exact.isfinite()  # (a padded query with no key to attend: float64 gives NaN, the kernel zeros)
    assert torch.equal(got[~attends], torch.zeros_like(got[~attends]))
    error = (got.double() - exact)[attends].abs()
    if dtype == torch.bfloat16:
        # bf16 keeps 8 significant bits: the output's own rounding is up to 2^-9 of it, the weights' another 2^-9
        assert (error <= 2**-7 * exact[attends].abs() + 2**-8).all(), error.max().item()
    else:  # float32 sums of a few hundred terms and a polynomial exp, as the decode kernel's bound
        assert error.max().item() <= 2e-6 * max(1.0, exact[attends].abs().max().item())
    if dtype == torch.bfloat16:  # on average within 1.3x of float64 attention rounded once to bf16, the best there is
        best = (exact.to(dtype).double() - exact)[attends].abs().mean().item()
        assert error.mean().item() <= 1.3 * best
    else:  # on average as close as torch's sdpa in float32
        sdpa = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, is_causal=masking == "causal", enable_gqa=True
        ).transpose(1, 2)
        assert error.mean().item() <= 1.25 * (sdpa.double() - exact)[attends].abs().mean().item() + 1e-7


def test_the_prefill_kernel_through_the_attention_function(prefill_ext):
    """`attend` hands a float32 or bf16 prompt to the kernel (no mask: causal; a bool mask: the mask's keys),
    and a call the kernel does not take (float16, an additive mask, a sliding window) to sdpa; a cached prefix
    with no mask is cut to the queries' keys as transformers' sdpa function cuts it."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 4, True
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 16, 70, 64, generator=g)
    k, v = (torch.randn(1, 4, 70, 64, generator=g) for _ in range(2))
    kernel = prefill_ext.prefill_attention(q, k, v, None, 0.125, True)
    assert torch.equal(attention.attend(module, q, k, v, None, scaling=0.125)[0], kernel)
    if prefill_ext.prefill_attention_ready(True):
        q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    expected = prefill_ext.prefill_attention(q, k, v, None, 0.125, True)
    assert torch.equal(attention.attend(module, q, k, v, None, scaling=0.125)[0], expected)
    mask = torch.ones(70, 70, dtype=torch.bool).tril()[None, None]
    assert torch.equal(attention.attend(module, q, k, v, mask, scaling=0.125)[0], expected)
    room = torch.randn(1, 4, 90, 64, generator=g).to(q.dtype)  # keys beyond the queries', no mask: cut
    assert torch.equal(attention.attend(module, q, room, room, None, scaling=0.125)[0],
                       prefill_ext.prefill_attention(q, room[:, :, :70], room[:, :, :70], None, 0.125, True))  # fmt: skip
    additive = torch.zeros(1, 1, 70, 70).masked_fill(~mask, float("-inf")).to(q.dtype)
    for args, kwargs in (
        ((q.half(), k.half(), v.half(), None), {}),
        ((q, k, v, additive), {}),
        ((q, k, v, mask), {"sliding_window": 16}),
    ):
        ours, _ = attention.attend(module, *args, scaling=0.125, **kwargs)
        theirs, _ = sdpa_attention_forward(module, *args, scaling=0.125, **kwargs)
        assert torch.equal(ours, theirs)


def qwen3_with_heads_of_64(seed: int):
    config = {**TINY["qwen3_moe"], "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}
    return make_model("qwen3_moe", seed=seed, **{**config, "max_position_embeddings": 1024})


def test_a_bf16_model_prefilling_through_the_kernel_stays_as_close_to_float32_as_sdpa(prefill_ext, tmp_path, no_prefill_kernel):
    """A bf16 model's 600-token prompt through the kernel (its fast-paths line says so) and through sdpa
    (the kernel switched off): each one's last-position logits against transformers' float32 forward on the
    same weights; the kernel's distance is sdpa's within a quarter, and the two differ (the kernel ran)."""
    needs(prefill_ext, torch.bfloat16)
    model = qwen3_with_heads_of_64(seed=4)
    checkpoint = save_checkpoint(model, tmp_path / "hf")
    assert main(["convert", str(checkpoint), str(tmp_path / "store"), "--experts-dtype", "bf16"]) == 0
    prompt = torch.randint(
        3, model.config.vocab_size, (1, 600), generator=torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    )
    reference_model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        exact = reference_model(prompt).logits[0, -1].double()
    prefill_ext.prefill_attention_switch(True)
    streamed, _ = moestream.load(tmp_path / "store", "1GiB", compute_dtype="bf16")
    line = next(p["note"] for p in stats(streamed)["fast_paths"] if p["name"] == "attention function")
    assert "flash kernel for bf16 and float32 prompts" in line
    distances, logits = [], []
    for on in (True, False):
        prefill_ext.prefill_attention_switch(on)
        with torch.no_grad():
            logits.append(streamed(prompt).logits[0, -1].double())
        distances.append((logits[-1] - exact).abs().mean().item())
    assert not torch.equal(*logits)
    assert distances[0] <= 1.25 * distances[1], distances


def test_a_float32_model_prefilling_through_the_kernel_gives_transformers_greedy_tokens(prefill_ext, tmp_path):
    """A float32 model (heads of 64) prefills a 700-token prompt through the kernel and then decodes: its
    greedy tokens are transformers' float32 ones (sdpa), and its prompt's logits are theirs within float32
    rounding, not the same bits (the kernel ran)."""
    model = qwen3_with_heads_of_64(seed=6)
    checkpoint = save_checkpoint(model, tmp_path / "hf")
    assert main(["convert", str(checkpoint), str(tmp_path / "store"), "--experts-dtype", "fp32"]) == 0
    prompt = torch.randint(3, model.config.vocab_size, (1, 700), generator=torch.Generator().manual_seed(11))
    reference_model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    expected = reference_model.generate(prompt, max_new_tokens=24, min_new_tokens=24, do_sample=False)
    streamed, _ = moestream.load(tmp_path / "store", "1GiB", compute_dtype="fp32")
    line = next(p["note"] for p in stats(streamed)["fast_paths"] if p["name"] == "attention function")
    assert "float32 prompts" in line
    assert torch.equal(streamed.generate(prompt, max_new_tokens=24, min_new_tokens=24, do_sample=False), expected)
    with torch.no_grad():
        ours, theirs = streamed(prompt).logits, reference_model(prompt).logits
    assert 0 < (ours - theirs).abs().max().item() < 1e-4
