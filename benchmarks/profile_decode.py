"""Where a decode step's time goes: cProfile over greedy decoding of a store, after a warm-up pass.

    python benchmarks/profile_decode.py tiny-code.moe --memory 8MiB --text heldout.txt     # misses
    python benchmarks/profile_decode.py tiny-code.moe --memory 128MiB --text heldout.txt   # all hits

Compare the two: the same functions, called the same number of times, cost more per call when reads
are in flight (the I/O threads share the cores), and cache allocation only shows up with misses.
"""

import argparse
import cProfile
import pstats

import moestream
from moestream.frontends.generate import timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("store")
    parser.add_argument("--memory", default="8MiB")
    parser.add_argument("--text", required=True, help="the prompt's text (its first --prompt-tokens tokens)")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--top", type=int, default=18, help="functions to list, by own time")
    args = parser.parse_args()
    model, tokenizer = moestream.load(args.store, args.memory, prefetch="off")
    ids = tokenizer(open(args.text).read(), return_tensors="pt").input_ids[:, : args.prompt_tokens]
    timed(model, ids, 16)  # warm-up
    profile = cProfile.Profile()
    profile.enable()
    rate = timed(model, ids, args.tokens).decode_tokens_per_second
    profile.disable()
    print(f"decode {rate:.2f} tok/s, hit rate {moestream.stats(model)['hit_rate']:.1%} (under the profiler)")
    pstats.Stats(profile).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
