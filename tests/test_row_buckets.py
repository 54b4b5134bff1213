"""Bucketed row counts for the CPU's bf16 and fp16 matmuls (row_buckets.py): a bounded set of shapes, the
same numbers as the unpadded matmul, and a loaded bf16 model running its resident linears and float expert
records through them while it still equals transformers' forward."""

import ctypes
import ctypes.util
import gc

import pytest
import torch
import torch.nn.functional as F
from tiny import TINY
from torch import nn
from transformers import AutoModelForCausalLM

import moestream
from moestream.conversion.synthetic import make_model, save_checkpoint
from moestream.core.compute import row_buckets
from moestream.core.compute.row_buckets import BucketedLinear, bucketed_linear, padded_rows
from moestream.core.memory import current_rss_bytes, release_freed_heap

MiB = 2**20


def test_padded_rows_are_few_and_never_an_eighth_more():
    seen = set()
    for m in range(1, 8193):
        rows = padded_rows(m)
        seen.add(rows)
        assert rows >= m
        assert rows == m if m < 16 else (rows - m) * 8 < m
        assert padded_rows(rows) == rows  # a bucket is its own bucket
    # 1 to 16 as they are, then 8 per doubling up to 8192
    assert len(seen) == 16 + 8 * 9


def _float64_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ weight.double().T
    return y + bias.double() if bias is not None else y


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 15, 17, 100, 333])
def test_a_bucketed_linear_computes_the_rows_it_was_given(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g).to(dtype)
    weight = (torch.randn(80, 96, generator=g) / 10).to(dtype)
    bias = torch.randn(80, generator=g).to(dtype)
    got = bucketed_linear(x, weight, bias)
    assert got.shape == (rows, 80) and got.dtype == dtype
    expected = _float64_linear(x, weight, bias)
    # one rounding of a float32 sum to the dtype: within a few of its units in the last place
    tolerance = 4 * torch.finfo(dtype).eps * expected.abs().max().item()
    assert (got.double() - expected).abs().max().item() <= tolerance
    assert (got.double() - F.linear(x, weight, bias).double()).abs().max().item() <= tolerance
    # stored [K, N] (gpt-oss's experts): the same rows
    transposed = bucketed_linear(x, weight.T.contiguous(), transposed=True)
    assert (transposed.double() - _float64_linear(x, weight, None)).abs().max().item() <= tolerance


def test_a_bucketed_linear_keeps_leading_dimensions():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 19, 64, generator=g).bfloat16()
    weight = torch.randn(48, 64, generator=g).bfloat16()
    got = bucketed_linear(x, weight)
    assert got.shape == (3, 19, 48)
    expected = _float64_linear(x.reshape(-1, 64), weight, None).view(3, 19, 48)
    assert (got.double() - expected).abs().max().item() <= 4 * 2**-8 * expected.abs().max().item()


def test_install_makes_only_half_precision_plain_linears_bucketed():
    model = nn.Sequential(nn.Linear(8, 8).bfloat16(), nn.Linear(8, 8), nn.Linear(8, 8).half())
    assert row_buckets.install(model) == 2
    assert [type(m) for m in model] == [BucketedLinear, nn.Linear, BucketedLinear]
    x = torch.randn(20, 8, generator=torch.Generator().manual_seed(1)).bfloat16()
    expected = _float64_linear(x, model[0].weight, model[0].bias)
    assert (model[0](x).double() - expected).abs().max().item() <= 4 * 2**-8 * expected.abs().max().item()


_libc = ctypes.CDLL(ctypes.util.find_library("c"))


def _resident_after_release() -> int:
    gc.collect()
    release_freed_heap()
    return current_rss_bytes()


@pytest.mark.skipif(not hasattr(_libc, "malloc_trim"), reason="needs glibc's malloc_trim to read the RSS in use")
def test_many_row_counts_keep_memory_bounded():
    """The point of the buckets: 600 row counts run as 22 shapes. Unbucketed, torch 2.13's oneDNN
    keeps about half a MiB for each new count of a bf16 matmul (about 300 MiB here)."""
    g = torch.Generator().manual_seed(2)
    weights = [torch.randn(64, 128, generator=g).bfloat16() for _ in range(2)]
    for m in range(1, 120):  # the small buckets once, so that their memory counts in the start
        for w in weights:
            bucketed_linear(torch.randn(m, 128, generator=g).bfloat16(), w)
    start = _resident_after_release()
    for m in range(120, 720):
        for w in weights:
            bucketed_linear(torch.randn(m, 128, generator=g).bfloat16(), w)
    grown = _resident_after_release() - start
    assert grown < 64 * MiB, f"RSS grew {grown / MiB:.0f} MiB over 600 row counts"


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    model = make_model("qwen3_moe", seed=11, dtype=torch.bfloat16, **TINY["qwen3_moe"])
    return save_checkpoint(model, tmp_path_factory.mktemp("bf16") / "hf")


def test_a_bf16_model_runs_its_linears_and_float_experts_bucketed_and_equals_transformers(bf16_checkpoint, tmp_path):
    store = moestream.convert(bf16_checkpoint, tmp_path / "store", "bf16", progress=False)
    streamed, _ = moestream.load(store, "1MiB", compute_dtype="bf16")
    engine = streamed._moestream_engine
    assert all(plan.bucketed_rows for plan in engine.plans)
    assert isinstance(streamed.model.layers[0].self_attn.q_proj, BucketedLinear)
    reference = AutoModelForCausalLM.from_pretrained(bf16_checkpoint, dtype=torch.float32).eval()
    ids = torch.randint(0, 250, (2, 37), generator=torch.Generator().manual_seed(6))  # 74 rows: padded to 76
    with torch.no_grad():
        expected, got = reference(ids).logits, streamed(ids).logits.float()
    assert ((got - expected).norm() / expected.norm()).item() <= 2e-2  # bf16 rounding apart
    moestream.close(streamed)
    # Computed in float32 (MKL keeps nothing per shape) the resident linears stay plain; the bf16 records
    # still compute in their own dtype, so their plans keep the buckets.
    fp32, _ = moestream.load(store, "1MiB", compute_dtype="fp32")
    assert type(fp32.model.layers[0].self_attn.q_proj) is nn.Linear
    assert all(plan.bucketed_rows for plan in fp32._moestream_engine.plans)
    moestream.close(fp32)
