"""The engine's own cost per experts call: cache lookups, pins, scheduling, bookkeeping; no expert math.

    PYTHONPATH=/tmp/moestream-old/src python benchmarks/experts_call_overhead.py tiny-code-int4.moe
    PYTHONPATH=src python benchmarks/experts_call_overhead.py tiny-code-int4.moe

Loads the store with a budget that holds every expert (prefetch off), replaces the per-expert compute
with a no-op, and times single-token experts calls of every layer (random routing, fixed seed) after a
pass that fills the cache. What is left is what the engine adds around the kernels. Prints the best of 25
passes (a neighbour's load only ever slows a pass down). Runs on older trees too (their module paths).
"""

import argparse
import time

import torch

import moestream


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("store")
    parser.add_argument("--memory", default="1GiB", help="a budget that holds every expert")
    parser.add_argument("--passes", type=int, default=25)
    args = parser.parse_args()
    torch.set_num_threads(2)
    model, _ = moestream.load(args.store, args.memory, prefetch="off")
    try:
        from moestream.conversion.skeleton import experts_modules
        from moestream.core.loading import engine_of
    except ImportError:  # a tree from before the layer sub-packages
        from moestream.runtime import engine_of
        from moestream.skeleton import experts_modules
    engine = engine_of(model)

    def no_math(*args, **kwargs):
        call = args[0]
        if getattr(call, "single", False):  # keep one token's outputs for the end sum
            entries = args[1] if isinstance(args[1], list) else [args[1]]  # compute(call, entries) or (call, entry)
            for entry in entries:
                call.ys[call.rows[entry.key[1]]] = call.x

    for name in ("compute", "_compute"):  # the name differs between versions
        if hasattr(engine, name):
            setattr(engine, name, no_math)
    modules = [m for _, m in experts_modules(model)]
    hidden, k, experts = model.config.hidden_size, model.config.num_experts_per_tok, engine.layers[0].num_experts
    dtype = next(model.parameters()).dtype
    g = torch.Generator().manual_seed(0)
    calls = [
        (layer, torch.randn(1, hidden, generator=g).to(dtype), torch.randperm(experts, generator=g)[:k].view(1, k),
         torch.rand(1, k, generator=g).to(dtype))
        for layer in range(len(modules))
        for _ in range(50)
    ]  # fmt: skip
    best = float("inf")
    with torch.inference_mode():
        for layer, h, index, weights in calls:  # fills the cache
            engine.run(modules[layer], layer, h, index, weights)
        for _ in range(args.passes):
            start = time.perf_counter()
            for layer, h, index, weights in calls:
                engine.run(modules[layer], layer, h, index, weights)
            best = min(best, (time.perf_counter() - start) / len(calls))
    print(f"{best * 1e6:.1f} us per experts call ({len(calls)} single-token calls, all hits, no expert math)")


if __name__ == "__main__":
    main()
