"""One experts call with every expert cached, against its floor: the same kernel calls on the same tensors.

    python benchmarks/make_synthetic_checkpoint.py ckpt --layers 2 --experts 128 --top-k 8 --hidden 2048 --expert-width 768
    moestream convert ckpt int4.moe --experts-dtype int4
    PYTHONPATH=src python benchmarks/experts_call_floor.py int4.moe --tokens 1
    PYTHONPATH=src python benchmarks/experts_call_floor.py int4.moe --tokens 256 --passes 5

Loads the store with a budget that holds every expert (prefetch off), fills the cache, then times, in
alternating passes of one process (a neighbour's load slows both alike):
- call: `ExpertEngine.run` on every layer (random routing, fixed seed), with the real expert math;
- floor: for each of those calls, only the two quantized kernel calls per distinct expert, on the cached
  slot's tensors and on bf16 activations made beforehand (int4/int3/int2: `_weight_int4pack_mm_for_cpu`;
  int8: `_weight_int8pack_mm`). Nothing else: no gate, no weighting, no sum.
Each call and its floor are timed on their own, one after the other, and each one's best time over the
passes is kept: the sum of those bests is a pass as undisturbed as the passes allowed (a neighbour's load
only ever slows a call down). With `--against OLD/engine.py` an older engine.py is loaded beside this
tree's (its class, bound to the same cache and state) and timed call by call in alternation with it.
With --decode N it also times greedy decoding of N tokens through `moestream.frontends.generate.timed`
(in alternating rounds with the older engine, if given).
"""

import argparse
import importlib.util
import sys
import time

import torch

import moestream
from moestream.conversion.skeleton import experts_modules
from moestream.core.loading import engine_of


def floor_calls(engine, calls):
    """Per call, the (kernel, args...) tuples of its bare kernel calls."""
    out = []
    for layer, h, index, _ in calls:
        spec = engine.layers[layer]
        fmt = spec.quantization
        kernels = []
        for e in sorted(set(index.reshape(-1).tolist())):
            w = engine.cache._entries[(layer, e)].tensors
            rows = int((index == e).sum())
            x = h[:rows].to(torch.bfloat16).contiguous()
            first = "gate_up_proj" if "gate_up_proj.qweight" in w else "up_proj"
            for name, inp in ((first, x), ("down_proj", None)):
                q = w[f"{name}.qweight"]
                if fmt.name == "int8":
                    k_in = q.shape[1]
                    a = inp if inp is not None else torch.randn(rows, k_in).to(h.dtype)
                    kernels.append((torch._weight_int8pack_mm, a, q, w[f"{name}.scales"].to(a.dtype)))
                else:
                    if fmt.bits < 4:
                        from moestream.conversion.quant import expand_int4_bytes

                        q = expand_int4_bytes(q, fmt.bits)
                    k_in = q.shape[1] * 2
                    a = inp if inp is not None else torch.randn(rows, k_in).to(torch.bfloat16)
                    kernels.append((torch._weight_int4pack_mm_for_cpu, a, q, fmt.group_size, w[f"{name}.scales_zeros"]))
        out.append(kernels)
    return out


def engine_from(path, engine):
    """The ExpertEngine class of another engine.py (same package, so its relative imports resolve), as an
    object that shares `engine`'s cache, reader, statistics and every other field."""
    spec = importlib.util.spec_from_file_location("moestream.core._engine_against", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    other = object.__new__(module.ExpertEngine)
    other.__dict__ = engine.__dict__
    return other


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("store")
    parser.add_argument("--memory", default="2GiB", help="a budget that holds every expert")
    parser.add_argument("--tokens", type=int, default=1, help="tokens per experts call (1: decode)")
    parser.add_argument("--calls", type=int, default=20, help="calls per layer in a pass")
    parser.add_argument("--passes", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--decode", type=int, default=0, help="also time this many greedy decode tokens")
    parser.add_argument("--decode-rounds", type=int, default=6)
    parser.add_argument("--against", help="an older engine.py to time call by call beside this tree's")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = moestream.load(args.store, args.memory, prefetch="off")
    engine = engine_of(model)
    modules = [m for _, m in experts_modules(model)]
    hidden, k, experts = model.config.hidden_size, model.config.num_experts_per_tok, engine.layers[0].num_experts
    dtype = next(model.parameters()).dtype
    g = torch.Generator().manual_seed(0)
    T = args.tokens
    calls = []
    for layer in range(len(modules)):
        for _ in range(args.calls):
            index = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(T)])
            weights = torch.rand(T, k, generator=g).softmax(-1).to(dtype)
            calls.append((layer, torch.randn(T, hidden, generator=g).to(dtype), index, weights))
    with torch.inference_mode():
        for layer in range(len(modules)):  # every expert of every layer into the cache
            for e0 in range(0, experts, k):
                index = (torch.arange(k) + e0).remainder(experts).view(1, k)
                engine.run(modules[layer], layer, calls[0][1][:1], index, torch.full((1, k), 1.0 / k, dtype=dtype))
        stats = engine.stats()
        floors = floor_calls(engine, calls)
        runs = {"call": engine}
        if args.against:
            runs["against"] = engine_from(args.against, engine)
        best = {name: [float("inf")] * len(calls) for name in (*runs, "floor")}
        for p in range(args.passes):
            for i, (layer, h, index, weights) in enumerate(calls):
                names = list(runs) if p % 2 == 0 else list(runs)[::-1]
                for name in names:
                    start = time.perf_counter()
                    runs[name].run(modules[layer], layer, h, index, weights)
                    best[name][i] = min(best[name][i], time.perf_counter() - start)
                start = time.perf_counter()
                for fn, *a in floors[i]:
                    fn(*a)
                best["floor"][i] = min(best["floor"][i], time.perf_counter() - start)
        after = engine.stats()
    assert after["misses"] == stats["misses"], "the budget does not hold every expert"
    kernels_per_call = sum(len(x) for x in floors) / len(floors)
    per = {name: sum(v) / len(calls) for name, v in best.items()}
    floor = per["floor"]
    print(f"T={T}: floor {floor * 1e6:8.1f} us per call ({kernels_per_call:.1f} kernel calls)")
    for name in runs:
        print(
            f"  {name:>8}: {per[name] * 1e6:8.1f} us per call, overhead above the floor "
            f"{(per[name] - floor) * 1e6:7.1f} us ({per[name] / floor:.3f}x floor)"
        )
    if args.decode:
        from moestream.frontends.generate import timed

        ids = torch.arange(32).view(1, -1) + 65
        classes = {name: type(run) for name, run in runs.items()}
        rates = {name: [] for name in classes}
        for r in range(args.decode_rounds):  # alternating: the same engine state, run by each class in turn
            for name in list(classes) if r % 2 == 0 else list(classes)[::-1]:
                engine.__class__ = classes[name]
                timed(model, ids, 4)
                rates[name].append(timed(model, ids, args.decode).decode_tokens_per_second)
        engine.__class__ = classes["call"]
        for name, v in rates.items():
            print(
                f"  {name:>8}: decode {max(v):6.2f} tok/s best, {sorted(v)[len(v) // 2]:6.2f} median ({' '.join(f'{x:.2f}' for x in v)})"
            )
        if "against" in rates:
            per_round = sorted(a / b for a, b in zip(rates["call"], rates["against"]))
            print(f"  call / against: {per_round[len(per_round) // 2]:.3f} (median of per-round ratios)")


if __name__ == "__main__":
    main()
