"""Row counts bucketed for the CPU's bf16 and fp16 matmuls, so that a server meets a bounded set of shapes.

torch multiplies bf16 and fp16 matrices on the CPU through oneDNN, which builds a primitive for every new
shape and keeps it, with about half a MiB of memory beside it that its cache's capacity does not bound. A
model's matmuls meet a new row count with every prompt length (the dense linears) and with every count of
tokens routed to an expert (float expert records): in a server that answers prompts of every length the
process grew without end (a 2-hour soak: 13% an hour, none of it Python objects or tensors; a probe of 78
prompt lengths, three rounds: 138 -> 648 MiB of heap in use, still growing in the third round as the cache
evicted and rebuilt).

So such a matmul of M rows runs at `padded_rows(M)` rows: M itself below 16, above that the next of eight
steps per power of two (at most an eighth more rows, eight shapes per doubling), the pad rows zeros and
their outputs dropped. The same probe then holds 216 MiB from its first round on. float32 goes through MKL,
which keeps nothing per shape, and GPUs through cuBLAS: both run unpadded. What runs here is chosen once, at
load: the experts' plans (plan.py) for float records, `install` for the resident linears.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

BUCKETED_DTYPES = (torch.bfloat16, torch.float16)


def padded_rows(m: int) -> int:
    """The row count a matmul of m rows runs at: m below 16, else m rounded up to a multiple of 2^(b - 3)
    where 2^b <= m < 2^(b + 1)."""
    step = 1 << max(0, m.bit_length() - 4)
    return -(-m // step) * step


def row_counts(max_rows: int) -> list[int]:
    """The row counts a matmul of 1 to max_rows rows runs at, ascending."""
    return sorted({padded_rows(m) for m in range(1, max_rows + 1)})


def bucketed(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] with zero rows appended up to padded_rows(M) (x itself where none are needed)."""
    m = x.shape[0]
    rows = padded_rows(m)
    return x if rows == m else torch.cat([x, x.new_zeros(rows - m, x.shape[1])])


def bucketed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, transposed: bool = False):
    """F.linear(x, weight, bias) for x [..., K] (x @ weight where `transposed`: weight stored [K, N], no bias),
    computed at a bucketed row count."""
    m = x.numel() // x.shape[-1]
    if m < 16:  # its own bucket: a decode step's rows, as they are (no reshape, no copy)
        return x @ weight if transposed else F.linear(x, weight, bias)
    flat = x.reshape(m, x.shape[-1])
    padded = bucketed(flat)
    y = padded @ weight if transposed else F.linear(padded, weight, bias)
    return y[:m].view(*x.shape[:-1], y.shape[-1])


class BucketedLinear(nn.Linear):
    """An nn.Linear whose matmul runs at a bucketed row count (`install` makes the model's ones so)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return bucketed_linear(x, self.weight, self.bias)


def install(model: nn.Module) -> int:
    """Make the model's plain nn.Linear modules with bf16 or fp16 weights BucketedLinear (on the CPU, once at
    load, after the compute dtype is set); the number made so."""
    made = 0
    for module in model.modules():
        if type(module) is nn.Linear and module.weight.dtype in BUCKETED_DTYPES and module.weight.device.type == "cpu":
            module.__class__ = BucketedLinear
            made += 1
    return made
