"""One sequence decoded three ways, in alternating rounds of one process: what `chat` and a server with
one stream cost against the lone path.

    python benchmarks/one_stream.py STORE --memory 6GiB --text README.md --prompt-tokens 512 --tokens 256

- `stream`: the lone path (`generate.stream`, what `generate` and `bench` run), whose KV layers grow into
  room (frontends/kv_layer.py);
- `scheduler`: a one-row serving scheduler (`serving.Scheduler`, `max_batch=1`), as `chat` and a server
  with one stream run it;
- `scheduler-concat`: the same with the batch's KV layers left as transformers' concatenating ones, as
  the batch kept them before its layers grew (the module attribute the batch calls is swapped for a no-op
  in this process: the emulation of the older code, not a user's option).

Each generation is greedy, exactly --tokens tokens after the first --prompt-tokens tokens of the text.
A warm-up generation of the same tokens first, so with a --memory that holds every expert each timed
pass is all hits. Decode tokens/s is `Timing`'s (the prompt is not in it). Rounds rotate the order of
the paths; it prints each path's median, and each path's median per-round ratio against `stream`.
"""

import argparse
import statistics

import machine
import torch

import moestream
from moestream.frontends import kv_cache
from moestream.frontends.generate import Decoding, timed
from moestream.frontends.serving import Request, Scheduler, run_until_idle

PATHS = ("stream", "scheduler", "scheduler-concat")


def through_scheduler(scheduler: Scheduler, model, ids: list[int], tokens: int) -> float:
    decoding = Decoding(model, None, ids, tokens, greedy=True, ignore_eos=True)
    scheduler.add(Request.of(decoding))
    run_until_idle(scheduler)
    return decoding.result().decode_tokens_per_second


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("store")
    parser.add_argument("--memory", default="6GiB")
    parser.add_argument("--text", required=True, help="the prompt's text (its first --prompt-tokens tokens)")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="write every run's figures here too")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"machine: {machine.line()}")
    model, tokenizer = moestream.load(args.store, args.memory)
    ids = tokenizer(open(args.text).read())["input_ids"][: args.prompt_tokens]
    if len(ids) < args.prompt_tokens:
        parser.error(f"the text has {len(ids)} tokens, fewer than --prompt-tokens")
    scheduler = Scheduler(model, max_batch=1)
    grow = kv_cache.grow_in_place

    def run(path: str) -> float:
        if path == "stream":
            return timed(model, ids, args.tokens).decode_tokens_per_second
        kv_cache.grow_in_place = grow if path == "scheduler" else (lambda cache: None)
        try:
            return through_scheduler(scheduler, model, ids, args.tokens)
        finally:
            kv_cache.grow_in_place = grow

    timed(model, ids, args.tokens)  # warm-up: reads what the timed passes need
    rates: dict[str, list[float]] = {p: [] for p in PATHS}
    for r in range(args.rounds):
        order = PATHS[r % len(PATHS) :] + PATHS[: r % len(PATHS)]
        for path in order:
            rates[path].append(run(path))
    stats = moestream.stats(model)
    print(
        f"{args.store} at {args.memory}: {args.prompt_tokens}-token prompt, {args.tokens} greedy tokens, "
        f"{args.rounds} rounds, hit rate {stats['hit_rate']:.1%} (warm-up included)"
    )
    for path in PATHS:
        ratios = [v / s for v, s in zip(rates[path], rates["stream"])]
        print(
            f"  {path:>16}: median {statistics.median(rates[path]):6.2f} tok/s  (rounds: "
            f"{' '.join(f'{v:.2f}' for v in rates[path])})  / stream: {statistics.median(ratios):.3f}"
        )
    if args.json:
        options = {k: v for k, v in vars(args).items() if k != "json"}
        machine.write_json(args.json, {"options": options, "tokens_per_second": rates, "hit_rate": stats["hit_rate"]})


if __name__ == "__main__":
    main()
