"""Decode tokens/s of two source trees of moestream side by side, in alternating rounds of one run.

    git worktree add /tmp/moestream-old <old commit>
    python benchmarks/decode_ab.py --tree old=/tmp/moestream-old --tree new=. \\
        --store tiny-code-int4.moe --store tiny-code-bf16.moe --memory 8MiB --text heldout.txt
    python benchmarks/decode_ab.py --tree lfu=.@lfu --tree forecast=.@forecast --store tiny-code.moe \
        --memory 8MiB --text heldout.txt --prefetch off       # two cache policies of one tree
    python benchmarks/decode_ab.py --tree old=/tmp/moestream-old --tree new=. --tree new-v3=. \
        --store-for old=store-v3 --store-for new=store-v4 --store-for new-v3=store-v3 \
        --memory 6GiB --text README.md --prefetch off --warmup-tokens same   # each tree its own store; all hits

Each measurement is a fresh process that imports moestream from its tree's src/, loads the store through
the public API only (`moestream.load`, which every version has), decodes a warm-up pass, then times a greedy
generation of --tokens tokens after the first --prompt-tokens tokens of the text, through transformers'
`generate` or, with --loop moestream, through the tree's own loop (what `moestream bench` times). Decode tokens/s is
(tokens - 1) / (time of the last token - time of the first), so the prompt is not in it. Rounds alternate
the trees (A B, B A, A B, ...) so that a noisy neighbour slows both alike; it prints the ratio of the
medians, the median of the per-round ratios and the ratio of the best runs (with more than two trees, of
each against the first).

A tree decodes every --store in turn, or, given --store-for NAME=STORE, that store instead (a tree whose
code cannot read the other's store format: an old commit's store against the new one's). A NAME may repeat
a PATH (one tree on two stores). --warmup-tokens same makes the warm-up the timed generation itself, so
that with a --memory that holds every expert the timed pass is all hits (greedy decoding routes the same
way twice); it prints the hit rate of the whole run and of the timed pass, and, with --store-for, each
tree's store and the moestream it imported; and the machine's load average as each run started. --json writes
every run's figures with the machine (the commit there is the running checkout's; each tree's path is in "trees");
--record writes a table per store as this machine's record of old-against-new (benchmarks/machine.py; the
trees by name: say in the names which commits they are).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

import machine

CHILD = r"""
import json, sys, time
import torch
import moestream
from transformers.generation.streamers import BaseStreamer

store, memory, text, prompt_tokens, tokens = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
torch.set_num_threads(int(sys.argv[6]))
options = {"policy": sys.argv[8]} if sys.argv[8] else {}  # NAME=PATH@POLICY; else the tree's default
warmup = tokens if sys.argv[9] == "same" else int(sys.argv[9])
model, tokenizer = moestream.load(store, memory, prefetch=sys.argv[7], **options)
ids = tokenizer(open(text).read(), return_tensors="pt").input_ids[:, :prompt_tokens]

class Times(BaseStreamer):
    def __init__(self):
        self.at = []
    def put(self, value):
        self.at.append(time.perf_counter())
    def end(self):
        pass

def decode(n):
    if sys.argv[10] == "moestream":  # the tree's own generation loop (it moved between modules)
        try:
            from moestream.generation.serving import timed
        except ImportError:
            try:
                from moestream.frontends.serving import timed
            except ImportError:
                from moestream.frontends.generate import timed
        return timed(model, ids[0].tolist(), n).decode_tokens_per_second
    times = Times()
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, streamer=times, pad_token_id=0)
    first, last = times.at[1], times.at[-1]  # put 0 is the prompt, put 1 the first new token
    return (n - 1) / (last - first)

decode(warmup)  # warm-up: the first pass pays for lazy initialisation (and, "same", reads what the timed one needs)
before = moestream.stats(model)
rate = decode(tokens)
after = moestream.stats(model)
hits, misses = after["hits"] - before["hits"], after["misses"] - before["misses"]
timed = hits / (hits + misses) if hits + misses else 0.0
print(json.dumps({"rate": rate, "hit_rate": after["hit_rate"], "timed_hit_rate": timed, "module": moestream.__file__}))
"""


def measure(tree: str, store: str, args) -> dict:
    tree, _, policy = tree.partition("@")
    env = dict(os.environ, PYTHONPATH=os.path.join(os.path.abspath(tree), "src"))
    cmd = [
        sys.executable,
        "-c",
        CHILD,
        store,
        args.memory,
        args.text,
        str(args.prompt_tokens),
        str(args.tokens),
        str(args.threads),
        args.prefetch,
        policy,
        str(args.warmup_tokens),
        args.loop,
    ]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{tree} on {store} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--tree",
        action="append",
        required=True,
        metavar="NAME=PATH[@POLICY]",
        help="a source tree (give two or more), with a cache policy if given",
    )
    parser.add_argument("--store", action="append", default=[], help="a store to decode (repeatable)")
    parser.add_argument(
        "--store-for",
        action="append",
        default=[],
        metavar="NAME=STORE",
        help="the store tree NAME decodes instead of each --store (repeatable)",
    )
    parser.add_argument("--memory", default="8MiB")
    parser.add_argument("--text", required=True, help="the prompt's text (its first --prompt-tokens tokens)")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prefetch", default="auto", help="auto (the default users get), on or off (hit rates then equal)")
    parser.add_argument(
        "--warmup-tokens",
        default="16",
        help="tokens of the warm-up generation (default 16), or `same`: the timed generation itself",
    )
    parser.add_argument(
        "--loop",
        choices=("transformers", "moestream"),
        default="transformers",
        help="the generation loop: transformers' `generate` (default: the engine alone differs between trees) "
        "or each tree's own (`timed`, what bench runs: the loops differ too)",
    )
    parser.add_argument("--json", help="write every run's figures here too")
    machine.add_record_argument(parser, "old-against-new")
    args = parser.parse_args()
    if args.warmup_tokens != "same" and not args.warmup_tokens.isdigit():
        parser.error("--warmup-tokens takes a number or `same`")
    trees = [t.split("=", 1) for t in args.tree]
    names = [name for name, _ in trees]
    if len(trees) < 2 or len(set(names)) != len(names):
        parser.error("give two or more --tree NAME=PATH with distinct names")
    own = dict(s.split("=", 1) for s in args.store_for)
    if set(own) - set(names):
        parser.error(f"--store-for names no --tree: {', '.join(sorted(set(own) - set(names)))}")
    if not args.store and set(own) != set(names):
        parser.error("give --store, or a --store-for for every tree")
    print(f"machine: {machine.line()}")
    report, tables = [], []
    for store in args.store or [None]:
        stores = {name: own.get(name, store) for name in names}
        rates: dict[str, list[float]] = {name: [] for name in names}
        hit_rates, timed_hit_rates, modules, loads = {}, {}, {}, {name: [] for name in names}
        for r in range(args.rounds):
            order = trees if r % 2 == 0 else trees[::-1]
            for name, path in order:
                loads[name].append(os.getloadavg()[0])  # a neighbour's share of the CPUs, as this run starts
                result = measure(path, stores[name], args)
                rates[name].append(result["rate"])
                hit_rates[name] = result["hit_rate"]
                timed_hit_rates[name] = result["timed_hit_rate"]
                modules[name] = result.get("module", "?")
        medians = {name: statistics.median(v) for name, v in rates.items()}
        what = stores[names[0]] if len(set(stores.values())) == 1 else "each tree's own store"
        print(
            f"{what} at {args.memory}, prefetch {args.prefetch}, {args.tokens} greedy tokens, {args.rounds} alternating rounds:"
        )
        for name in names:
            values = " ".join(f"{v:.1f}" for v in rates[name])
            print(
                f"  {name:>6}: median {medians[name]:6.2f} tok/s, best {max(rates[name]):6.2f}  (rounds: {values})  "
                f"hit rate {hit_rates[name]:.1%} (timed pass {timed_hit_rates[name]:.1%})"
            )
            if own:
                print(f"          store {stores[name]}, moestream from {modules[name]}")
            print(f"          load average (1 min) at each run's start: {' '.join(f'{v:.1f}' for v in loads[name])}")
        a = names[0]
        for b in names[1:]:
            # A neighbour's load comes in bursts that slow both runs of a round alike: the ratio within each
            # round is steadier than the ratio of medians; the best run is the least disturbed one.
            ratios = [y / x for x, y in zip(rates[a], rates[b])]
            print(
                f"  {b} / {a}: {medians[b] / medians[a]:.3f} (medians), {statistics.median(ratios):.3f} (median of "
                f"per-round ratios: {' '.join(f'{v:.3f}' for v in ratios)}), {max(rates[b]) / max(rates[a]):.3f} (best runs)"
            )
        report.append(
            dict(stores=stores, tokens_per_second=rates, hit_rate=hit_rates, timed_hit_rate=timed_hit_rates, load=loads)
        )
        rows = []
        for name in names:
            against = ""
            if name != a:
                ratios = [y / x for x, y in zip(rates[a], rates[name])]
                against = f"{medians[name] / medians[a]:.3f}; {statistics.median(ratios):.3f}"
            rounds = " ".join(f"{v:.1f}" for v in rates[name])
            rows.append([name, rounds, f"{medians[name]:.2f}", f"{hit_rates[name]:.1%}", against])
        where = os.path.basename(os.path.normpath(what)) if store else what
        caption = (
            f"`{where}` at `--memory {args.memory}`, `--prefetch {args.prefetch}`, {args.tokens} greedy tokens after {args.prompt_tokens}, "
            f"warm-up {args.warmup_tokens}, the {args.loop} loop, {args.rounds} alternating rounds of fresh processes:"
        )
        columns = ["tree", "tok/s per round", "median tok/s", "hit rate", f"against {a}: medians; median of per-round ratios"]
        tables.append(machine.table(caption, columns, rows))
    if args.json:
        options = {k: v for k, v in vars(args).items() if k not in ("tree", "json")}
        machine.write_json(args.json, {"trees": dict(trees), "options": options, "runs": report})
    if args.record:
        path = machine.write_result(args.record, "Refactors: the old tree against the new", machine.invocation(), tables)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
