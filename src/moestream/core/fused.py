"""Fused CPU kernels for upstream modules whose small ops dominate a decode step: RMSNorm.

Why: a one-token decode step on the CPU runs hundreds of tiny ops, each costing 5-30 us of dispatch
and cache misses whatever its size. transformers' RMSNorm is eight of them (cast, pow, mean, add,
rsqrt, mul, cast, mul) and runs two to four times per layer; one fused kernel does the same arithmetic
in one call (docs/BENCHMARKS.md, "Fused RMSNorm"). transformers itself swaps RMSNorm forwards for
kernels (`use_kernel_forward_from_hub("RMSNorm")`), which here would need the network; so the kernel is
compiled from the source below with torch's C++ extension builder, once per machine (about 40 s, cached
in torch's extensions directory), and used only where it computes what the module computes.

Which modules: every module whose class is named *RMSNorm with a 1-D `weight` and a float epsilon. A
class's formula is not read from its source but checked by behaviour (`agrees`): on random rows and a
random weight its forward and the kernel must agree within one unit in the last place on at most 0.1%
of a 16-bit result's elements (float32: within a few units, its sums run in another order), so a variant
(Gemma's 1 + weight, gpt-oss's single rounding in bf16) keeps its own forward.
Without a C++ compiler, or with MOESTREAM_FUSED=0, nothing changes.
"""

from __future__ import annotations

import copy
import functools
import os
import sys
import time
import warnings

import torch
from torch import nn

EXTENSION = "moestream_fused_v1"  # a new name for every change of the source: the build cache is by name
STALE_LOCK_SECONDS = 600  # an older build lock belongs to a build that was killed

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <cmath>

// transformers' RMSNorm on rows of x [..., H], in its rounding: the mean of squares and the scaling in
// float32, the normalized row rounded to x's dtype, then multiplied by the weight (in float32, rounded).
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "rms_norm: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "rms_norm: x and weight must share a dtype");
  const int64_t H = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == H, "rms_norm: weight must be [H]");
  auto in = x.contiguous();
  auto w = weight.contiguous();
  auto out = torch::empty_like(in);
  const int64_t rows = H ? in.numel() / H : 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, in.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = in.data_ptr<scalar_t>();
    const scalar_t* wp = w.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const float epsilon = static_cast<float>(eps);
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* a = xp + r * H;
        scalar_t* o = op + r * H;
        float sum = 0.f;
        for (int64_t i = 0; i < H; ++i) {
          const float v = static_cast<float>(a[i]);
          sum += v * v;
        }
        const float inv = 1.f / std::sqrt(sum / static_cast<float>(H) + epsilon);
        for (int64_t i = 0; i < H; ++i) {
          const scalar_t normed = static_cast<scalar_t>(static_cast<float>(a[i]) * inv);
          o[i] = static_cast<scalar_t>(static_cast<float>(wp[i]) * static_cast<float>(normed));
        }
      }
    });
  });
  return out;
}
"""


@functools.lru_cache(maxsize=1)
def extension():
    """The compiled kernels, or None (no compiler, a failed build, or MOESTREAM_FUSED=0)."""
    if os.environ.get("MOESTREAM_FUSED", "1") == "0":
        return None
    try:
        from torch.utils import cpp_extension

        try:  # the ninja wheel's binary, which torch looks for on PATH (a venv's bin may not be on it)
            import ninja

            if ninja.BIN_DIR not in os.environ.get("PATH", "").split(os.pathsep):
                os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except ImportError:
            pass

        directory = cpp_extension._get_build_directory(EXTENSION, verbose=False)
        lock = os.path.join(directory, "lock")
        # torch waits for as long as a build's lock file exists, and a build that was killed (Ctrl-C during
        # the first load) leaves it behind: every later load would hang. A build takes about a minute.
        if os.path.exists(lock) and time.time() - os.path.getmtime(lock) > STALE_LOCK_SECONDS:
            os.remove(lock)
        if not os.path.exists(os.path.join(directory, f"{EXTENSION}.so")):
            print(
                "moestream: compiling its fused CPU kernels, once for this machine (about a minute); "
                "MOESTREAM_FUSED=0 skips them",
                file=sys.stderr,
                flush=True,
            )
        return cpp_extension.load_inline(EXTENSION, cpp_sources=_SOURCE, functions=["rms_norm"], extra_cflags=["-O3"])
    except Exception as error:  # no compiler, no headers: the model runs as it would without them
        warnings.warn(f"moestream: running without fused CPU kernels ({type(error).__name__}: {error})", stacklevel=2)
        return None


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
    probe.weight = nn.Parameter((torch.rand(hidden, generator=g) + 0.5).to(dtype), requires_grad=False)
    x = (torch.randn(rows, hidden, generator=g) * 3).to(dtype)
    with torch.no_grad():
        expected = type(module).forward(probe, x)
        got = kernel(x, probe.weight, _epsilon(module))
    if got.dtype != expected.dtype or got.shape != expected.shape:
        return False
    units = 8 if dtype == torch.float32 else 1
    diff = (got.float() - expected.float()).abs()
    if not bool((diff <= units * torch.finfo(dtype).eps * expected.float().abs() + torch.finfo(dtype).tiny).all()):
        return False
    return dtype == torch.float32 or (diff > 0).float().mean().item() <= 1e-3


def install(model: nn.Module) -> int:
    """Give each RMSNorm module whose class agrees with the kernel (`agrees`) the fused forward; returns
    how many. The forward falls back to the module's own for inputs the kernel does not take (another
    dtype than the weight's, a device other than the CPU, more arguments than the one checked, or with
    autograd recording)."""
    norms = _rms_norms(model)
    ext = extension() if norms else None
    if ext is None:
        return 0
    verdict: dict[tuple[type, torch.dtype], bool] = {}
    installed = 0
    for module in norms:
        key = (type(module), module.weight.dtype)
        if key not in verdict:
            verdict[key] = agrees(module, ext.rms_norm)
        if verdict[key]:
            module.forward = functools.partial(_fused_forward, module, ext.rms_norm, _epsilon(module))
            installed += 1
    return installed


def _fused_forward(module: nn.Module, kernel, eps: float, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    w = module.weight
    differentiating = torch.is_grad_enabled() and (w.requires_grad or hidden_states.requires_grad)  # no backward here
    if not args and not kwargs and hidden_states.dtype == w.dtype and hidden_states.device.type == "cpu" and not differentiating:
        return kernel(hidden_states, w, eps)
    return type(module).forward(module, hidden_states, *args, **kwargs)  # (a call with more inputs than checked)
