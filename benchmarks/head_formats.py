"""What an LM head of a real vocabulary, and a down projection, cost per token in each format that holds a
GGUF's Q6_K blocks: int8 by rows (what moestream stored them in before int6), int6 in groups of 64 (6.5
bits a weight; Q6_K is 6.56) and, for scale, int4 in groups of 64.

    python benchmarks/head_formats.py [--threads 2] [--vocab 151936] [--json OUT] [--record]

1. The machine's read bandwidth (a float32 sum over 512 MiB, best of 5): what a kernel streaming weights
   from DRAM can reach.
2. One token (int8 activations, the CPU's kernels as `load` picks them) through the LM head [vocab, 2048]
   (Qwen3-30B-A3B's width; 151,936 rows as every Qwen3), each format in turn, five rounds alternating:
   ms per token, GB/s of weights read, share of the bus.
3. One token through 64 distinct expert down projections [2048, 768] (Q4_K_M keeps them Q6_K), weights from
   DRAM, the same way.
"""

from __future__ import annotations

import argparse
import time

import machine
import torch
from int8_activations import start_benchmark

from moestream.conversion.quant import QuantFormat, pack, quantize
from moestream.core.compute import kernels

FORMATS = [("int8", None), ("int6", 64), ("int4", 64)]


def records(fmt: QuantFormat, n: int, k: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`count` random [n, k] matrices in `fmt`, quantized a slice of rows at a time (a 150k-row head in
    float32 at once would be 1.2 GB more)."""
    out = []
    g = torch.Generator().manual_seed(n + k)
    for _ in range(count):
        parts = [pack(quantize(torch.randn(min(8192, n - r), k, generator=g), fmt), fmt, "w") for r in range(0, n, 8192)]
        qweight = torch.cat([p["w.qweight"] for p in parts])
        params = torch.cat([p[f"w.{fmt.params}"] for p in parts], dim=0 if fmt.name == "int8" else 1).contiguous()
        out.append((qweight, params))
    return out


def timed_rounds(matrices: dict, k: int, rounds: int) -> dict[str, float]:
    """Best seconds per matrix for each format, the formats alternating within each round."""
    x = torch.randn(1, k)
    best = {name: float("inf") for name in matrices}
    for _ in range(rounds):
        for name, (fmt, mats) in matrices.items():
            start = time.perf_counter()
            for qweight, params in mats:
                kernels.quantized_matmul(x, qweight, params, fmt, True)
            best[name] = min(best[name], (time.perf_counter() - start) / len(mats))
    return best


def report(title: str, matrices: dict, seconds: dict, bandwidth: float) -> list[dict]:
    print(title)
    rows = []
    for name, (_, mats) in matrices.items():
        nbytes = sum(t.numel() * t.element_size() for t in mats[0])
        rate = nbytes / seconds[name] / 1e9
        print(
            f"  {name:<9} {nbytes / 2**20:8.1f} MiB  {seconds[name] * 1e3:7.3f} ms  {rate:5.1f} GB/s = {rate / bandwidth:.0%} of the bus",
            flush=True,
        )
        rows.append(dict(format=name, mib=nbytes / 2**20, ms=seconds[name] * 1e3, gbs=rate))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", help="write the results here too")
    machine.add_record_argument(parser, "int6-weights")
    args = parser.parse_args()
    bandwidth = start_benchmark(args.threads)
    label = {name: f"{name}-g{group}" if group else name for name, group in FORMATS}
    formats = {label[name]: QuantFormat.make(name, group or 32) for name, group in FORMATS}
    head = {name: (fmt, records(fmt, args.vocab, 2048, 1)) for name, fmt in formats.items()}
    results = {"threads": args.threads, "bandwidth_gbs": bandwidth, "vocab": args.vocab}
    results["lm_head"] = report(
        f"LM head [{args.vocab}, 2048], one token:", head, timed_rounds(head, 2048, args.rounds), bandwidth
    )
    del head
    downs = {name: (fmt, records(fmt, 2048, 768, 64)) for name, fmt in formats.items()}
    results["down"] = report(
        "\n64 distinct expert down projections [2048, 768], one token, per matrix:",
        downs,
        timed_rounds(downs, 768, args.rounds),
        bandwidth,
    )
    if args.json:
        machine.write_json(args.json, results)
    if args.record:
        names = [r["format"] for r in results["lm_head"]]
        rows = [
            [
                f"LM head [{args.vocab:,}, 2048]",
                *(f"{r['ms']:.2f} ms, {r['mib']:.0f} MiB, {r['gbs']:.1f} GB/s" for r in results["lm_head"]),
            ],
            ["expert down [2048, 768], per matrix", *(f"{r['ms']:.3f} ms, {r['gbs']:.1f} GB/s" for r in results["down"])],
        ]
        caption = (
            f"One token through the LM head and through 64 distinct expert down projections, int8 activations, formats alternating, "
            f"best of {args.rounds} rounds, {args.threads} threads; a float32 sum read {bandwidth:.1f} GB/s:"
        )
        table = machine.table(caption, ["matrix", *names], rows)
        path = machine.write_result(args.record, "6-bit weights (int6): LM heads and Q6_K blocks", machine.invocation(), [table])
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
