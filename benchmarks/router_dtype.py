"""Routers in float32 against bf16, inside a real decode: each router call's time, and decode tokens/s.

    python benchmarks/router_dtype.py STORE --memory 6GiB [--rounds 8] [--tokens 32]

Loads a bf16 store (its routers then compute in float32, dense.routers_in_float32), keeps a bf16 copy of
each router's weight, and alternates decode rounds between the two: in "bf16" rounds each router gets
its bf16 weight back, so that its input is no longer cast (dense.float32_input casts only up to a
float32 weight), as before routers were float32. Each router call is timed inside the decode (a wrapper
around its forward), so the figure includes what a cold cache does to a small matmul between the
experts' kernels. Prints the median call per dtype, and
the decode tokens/s of both (median of per-round ratios).
"""

import argparse
import statistics
import time

import torch
from ab_rounds import load, store_arguments

from moestream.conversion.skeleton import experts_modules
from moestream.core.prefetch import find_router
from moestream.frontends.generate import timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    store_arguments(parser, tokens=32, rounds=8)
    args = parser.parse_args()
    model = load(args)
    routers = [find_router(model.get_submodule(name.rsplit(".", 1)[0])) for name, _ in experts_modules(model)]
    if not routers or any(r is None or r.weight.dtype != torch.float32 for r in routers):
        raise SystemExit("this store's routers are not bf16 ones computed in float32: nothing to compare")
    weights = {
        "fp32": [r.weight for r in routers],
        "bf16": [torch.nn.Parameter(r.weight.bfloat16(), requires_grad=False) for r in routers],
    }
    calls = {"fp32": [], "bf16": []}
    mode = ["fp32"]

    def timed_forward(forward):
        def run(*a, **k):
            start = time.perf_counter()
            out = forward(*a, **k)
            calls[mode[0]].append(time.perf_counter() - start)
            return out

        return run

    for r in routers:
        r.forward = timed_forward(r.forward)

    def use(name: str) -> None:
        mode[0] = name
        for r, w in zip(routers, weights[name]):
            r.weight = w

    ids = torch.arange(40, 72).view(1, -1)
    for name in ("fp32", "bf16"):  # warm-up: every expert the prompt and decode touch into the cache
        use(name)
        timed(model, ids, args.tokens)
    calls = {"fp32": [], "bf16": []}
    rates = {"fp32": [], "bf16": []}
    for i in range(args.rounds):
        for name in ("fp32", "bf16") if i % 2 == 0 else ("bf16", "fp32"):
            use(name)
            rates[name].append(timed(model, ids, args.tokens).timing.decode_tokens_per_second)
    for name in ("bf16", "fp32"):
        print(
            f"routers {name}: median call {statistics.median(calls[name]) * 1e6:7.1f} us over {len(calls[name])} calls; "
            f"decode median {statistics.median(rates[name]):.2f} tok/s (rounds: {' '.join(f'{x:.1f}' for x in rates[name])})"
        )
    ratios = [a / b for a, b in zip(rates["fp32"], rates["bf16"])]
    print(f"decode fp32 / bf16 routers: {statistics.median(ratios):.3f} (median of per-round ratios)")


if __name__ == "__main__":
    main()
