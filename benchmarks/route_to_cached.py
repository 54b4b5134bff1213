"""Cache-aware routing (core/routing.py) priced: hit rate and reads against perplexity, KL and top-1.

    python benchmarks/route_to_cached.py STORE --reference CHECKPOINT --text FILE --memory 8MiB \
        [--margins 0,0.1,0.2,0.3,0.5] [--max-tokens 1024]

For each margin (0: off), loads the store under --memory with prefetch off (so every read is a miss of
the call that needs it) and runs `moestream eval --decode`'s comparison (tools/quality.compare_models:
the store decodes each window token by token with its KV cache, the reference runs the window at once),
then prints the hit rate, expert reads per token, the choices rerouted, the perplexity change, KL and
top-1 agreement against the reference.
"""

import argparse

import torch

import moestream
from moestream.tools import quality


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("store")
    parser.add_argument("--reference", required=True)
    parser.add_argument("--text", required=True)
    parser.add_argument("--memory", default="8MiB")
    parser.add_argument("--margins", default="0,0.1,0.2,0.3,0.5")
    parser.add_argument("--max-tokens", type=int, default=1024)
    parser.add_argument("--context", type=int, default=quality.DEFAULT_CONTEXT)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    reference, _ = quality._load_checkpoint(quality.Path(args.reference), False)
    print(f"{args.store} at {args.memory}, prefetch off, {args.max_tokens} tokens decoded one by one")
    print(
        f"{'margin':>6} {'hit rate':>8} {'reads/token':>11} {'rerouted':>8} {'ppl change':>10} {'KL mean':>9} {'KL p99':>9} {'top-1':>7}"
    )
    for margin in (float(m) for m in args.margins.split(",")):
        model, tokenizer = moestream.load(args.store, args.memory, prefetch="off", route_to_cached=margin)
        ids = quality._encode(tokenizer, open(args.text, encoding="utf-8").read())[: args.max_tokens]
        metrics = quality.compare_models(model, reference, ids, args.context, decode=True)
        stats = moestream.stats(model)
        print(
            f"{margin:>6g} {stats['hit_rate']:>8.1%} {stats['misses'] / metrics['tokens']:>11.2f} {stats['rerouted']:>8} "
            f"{metrics['perplexity_change_percent']:>+9.3f}% {metrics['kl_mean']:>9.2e} {metrics['kl_p99']:>9.2e} "
            f"{metrics['top1_agreement']:>7.2%}",
            flush=True,
        )
        moestream.close(model)


if __name__ == "__main__":
    main()
