"""What the in-process A/B benchmarks share (long_context.py, fused_attention.py, router_dtype.py): their
common arguments and the store's loading (`store_arguments`, `load`), and alternating rounds of two ways
to decode (A B, B A, ...; `alternate`): each way returns its tokens/s and what it decoded, which must be
the same for both."""

import argparse
import statistics
from typing import Callable


def store_arguments(parser: argparse.ArgumentParser, tokens: int, rounds: int, memory: str = "6GiB") -> None:
    """STORE, --memory (a budget that holds every expert), --tokens, --rounds and --threads."""
    parser.add_argument("store")
    parser.add_argument("--memory", default=memory, help="a budget that holds every expert")
    parser.add_argument("--tokens", type=int, default=tokens)
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--threads", type=int, default=2)


def load(args: argparse.Namespace):
    """The store's model at --threads compute threads, without speculative reads."""
    import torch

    import moestream

    torch.set_num_threads(args.threads)
    return moestream.load(args.store, args.memory, prefetch="off")[0]


def alternate(ways: dict[str, Callable[[], tuple[float, object]]], rounds: int) -> None:
    """Run the two `ways` (name -> decode()) in alternating order for `rounds` rounds, printing each round
    (tokens/s, and whether both decoded the same), then the medians and the median of per-round ratios
    (first way / second)."""
    (a, decode_a), (b, decode_b) = ways.items()
    rates: dict[str, list[float]] = {a: [], b: []}
    for r in range(rounds):
        outputs = {}
        for name, decode in ((a, decode_a), (b, decode_b)) if r % 2 == 0 else ((b, decode_b), (a, decode_a)):
            rate, outputs[name] = decode()
            rates[name].append(rate)
        same = _equal(outputs[a], outputs[b])
        print(f"round {r}: {a} {rates[a][-1]:.2f} tok/s, {b} {rates[b][-1]:.2f} tok/s, same output: {same}", flush=True)
    median_a, median_b = statistics.median(rates[a]), statistics.median(rates[b])
    per_round = statistics.median(x / y for x, y in zip(rates[a], rates[b]))
    print(
        f"{a} {median_a:.2f} / {b} {median_b:.2f} tok/s (medians), {median_a / median_b:.3f} (ratio of medians), "
        f"{per_round:.3f} (median of per-round ratios)"
    )


def _equal(x, y) -> bool:
    import torch

    return torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
