"""Every bucketed matmul shape a served model will run, built before it serves.

Why: oneDNN keeps about 0.6 MiB for each bf16 or fp16 matmul shape it has run (row_buckets.py), in caches of
1,024 entries. The buckets make the shapes few (some 60 row counts per weight shape up to a thousand rows),
but a server meets the rarer ones (long prompts, an expert many tokens chose) one by one over hours, and its
RSS crept up for as long as it ran: the 2-hour soak of the trained fixture grew 1.7% an hour after its first
ten minutes, primitives for new row counts still coming. Run once at start, every shape is built while
nothing waits, and the memory it keeps is there from the first request on; llama.cpp's server runs a warm-up
pass at start for the same kind of reason.

Which shapes: each bucketed resident linear (its own forward) and each float expert matrix whose plan
computes it bucketed (its bound kernel, on a zero matrix of the record's shape, dtype and orientation), one
per distinct shape, at every row count `row_buckets.row_counts(max_rows)` gives, smallest first; the output
embedding only at a decode batch's row counts (its prompt rows are one per sequence). It stops when
`seconds` are spent: a model whose matmuls are large builds what fits, the rest as it meets them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .compute.row_buckets import BucketedLinear, row_counts

DECODE_ROWS = 16  # the output embedding's row counts: below this (one row per sequence of a batch)


@dataclass
class Warmed:
    built: int  # (shape, row count) pairs run
    of: int  # pairs there are up to max_rows
    seconds: float


def matmul_shapes(model, engine) -> list[tuple[int | None, object]]:
    """(most rows or None, run(rows)) for each distinct bucketed matmul the model (with its `engine`) runs."""
    found: dict[tuple, tuple[int, object]] = {}
    head = model.get_output_embeddings()
    for module in model.modules():
        if isinstance(module, BucketedLinear):
            key = ("linear", tuple(module.weight.shape), module.weight.dtype, module.bias is not None)
            limit = DECODE_ROWS - 1 if module is head else None
            found.setdefault(key, (limit, _linear_runner(module)))
    for module in model.modules():
        layer = getattr(module, "_moestream_layer", None)
        if layer is None or not engine.plans[layer].bucketed_rows:
            continue
        plan, transposed = engine.plans[layer], bool(getattr(module, "is_transposed", False))
        for spec in engine.layers[layer].layout.tensors:
            if spec.name not in plan.matmuls:
                continue
            dtype = engine.record_dtypes[layer][spec.name]
            key = ("expert", tuple(spec.shape), dtype, transposed)
            found.setdefault(key, (None, _expert_runner(plan, spec.name, tuple(spec.shape), dtype, transposed)))
    return list(found.values())


def _linear_runner(module):
    width = module.in_features
    return lambda rows: module(torch.zeros(rows, width, dtype=module.weight.dtype))


def _expert_runner(plan, name: str, shape: tuple, dtype: torch.dtype, transposed: bool):
    record = {name: torch.zeros(shape, dtype=dtype)}
    width = shape[0] if transposed else shape[1]
    return lambda rows: plan.linear(torch.zeros(rows, width, dtype=dtype), record, name, transposed)


def warm(model, engine, max_rows: int, seconds: float) -> Warmed:
    """Run every bucketed matmul shape of `model` (with its `engine`) at every row count up to `max_rows`,
    smallest first, until `seconds` are spent."""
    shapes = matmul_shapes(model, engine)
    counts = row_counts(max_rows)
    work = [(rows, run) for rows in counts for limit, run in shapes if limit is None or rows <= limit]
    began, built = time.perf_counter(), 0
    with torch.inference_mode():
        for rows, run in work:
            if time.perf_counter() - began > seconds:
                break
            run(rows)
            built += 1
    return Warmed(built, len(work), time.perf_counter() - began)
