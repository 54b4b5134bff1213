"""Speculative prefetch off / on / auto on the same store, prompt and budget, modes alternating.

Prints decode tokens/s, hit rate, expert MB read per decoded token and, for on/auto, the prediction's
precision and recall and how many speculative reads were used or wasted; for auto, the median decode
step with speculation on and off in its latest probe and the state it ended in. Auto warms up for 16
steps, probes for 32 and then holds its choice for 256, so give it a few hundred new tokens to be judged
fairly. Use a trained
model for real routing (random routers predict nothing useful), e.g.

    python benchmarks/prefetch_modes.py tiny-code.moe --memory 8MiB --text heldout.txt --rounds 3 --new-tokens 320
"""

from __future__ import annotations

import argparse
import statistics

import torch

import moestream
from moestream.core.loading import engine_of
from moestream.frontends.generate import timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("store")
    parser.add_argument("--memory", default="8MiB")
    parser.add_argument("--text", default=None, help="prompt from this text (default: random ids)")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=320)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(2)

    rates: dict[str, list[float]] = {"off": [], "on": [], "auto": []}
    print(
        f"{'round':>5} {'prefetch':>8} {'tok/s':>7} {'hit':>6} {'MB/tok':>7} {'precision':>9} {'recall':>6} "
        f"{'useful':>6} {'wasted':>6}  auto probe (median step on/off) -> choice"
    )
    for round_ in range(args.rounds):
        for mode in rates:
            model, tokenizer = moestream.load(args.store, args.memory, prefetch=mode)
            if args.text:
                ids = tokenizer(open(args.text).read(), return_tensors="pt").input_ids[:, : args.prompt_tokens]
            else:
                ids = torch.randint(
                    0, model.config.vocab_size, (1, args.prompt_tokens), generator=torch.Generator().manual_seed(0)
                )
            engine = engine_of(model)
            rate = timed(model, ids, args.new_tokens).decode_tokens_per_second
            s = engine.stats()
            p = s["prefetch"]
            rates[mode].append(rate)
            last = p["auto_last_probe_ms"]
            probe = f"{last['on']:.1f} / {last['off']:.1f} ms -> {'on' if p['speculating'] else 'off'}" if last else ""
            print(
                f"{round_:>5} {mode:>8} {rate:>7.2f} {s['hit_rate']:>6.1%} {s['bytes_read'] / 1e6 / args.new_tokens:>7.2f} "
                f"{p['precision']:>9.2f} {p['recall']:>6.2f} {p['useful']:>6} {p['wasted']:>6}  {probe}"
            )
            engine.close()
    medians = {mode: statistics.median(r) for mode, r in rates.items()}
    best = max(medians["on"], medians["off"])
    print(
        "median tok/s: "
        + ", ".join(f"{m} {v:.2f}" for m, v in medians.items())
        + f"; auto / best of on,off = {medians['auto'] / best:.3f}"
    )


if __name__ == "__main__":
    main()
