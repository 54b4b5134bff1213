"""What run-time checksum verification costs: the same generation with --verify always, first and off.

Prints, per mode: decode tokens/s, seconds spent reading records and hashing them (summed over the I/O
threads), and hashing as a share of read time (--json writes the same; --record writes the table as this
machine's record of checksums, benchmarks/machine.py). Run it on a store much larger than --memory so that
most steps read from disk, e.g.

    python benchmarks/verify_cost.py big.moe --memory 256MiB --tokens 32
"""

from __future__ import annotations

import argparse

import machine
import torch

import moestream
from moestream.frontends.generate import SamplingParams
from moestream.frontends.serving import generate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("store")
    parser.add_argument("--memory", default="256MiB")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--prompt", default="def fibonacci(n):")
    parser.add_argument("--rounds", type=int, default=2, help="alternate the modes this many times")
    parser.add_argument("--json", help="write the rows here too")
    machine.add_record_argument(parser, "checksums")
    args = parser.parse_args()
    torch.set_num_threads(2)

    rows = []
    for round_ in range(args.rounds):
        for mode in ("always", "first", "off"):
            model, tokenizer = moestream.load(args.store, args.memory, verify=mode)
            result = generate(model, tokenizer, args.prompt, SamplingParams.greedy(args.tokens))
            s = result.stats
            rows.append((round_, mode, result.decode_tokens_per_second, s["bytes_read"], s["read_seconds"], s["verify_seconds"]))
            moestream.close(model)
    print(f"machine: {machine.line()}")
    print(f"{'round':>5} {'verify':>7} {'tok/s':>7} {'MB read':>8} {'read s':>7} {'hash s':>7} {'hash/read':>9}")
    for round_, mode, tps, read, read_s, verify_s in rows:
        print(f"{round_:>5} {mode:>7} {tps:>7.2f} {read / 1e6:>8.0f} {read_s:>7.2f} {verify_s:>7.3f} {verify_s / read_s:>9.1%}")
    if args.json:
        keys = ("round", "verify", "decode_tokens_per_second", "bytes_read", "read_seconds", "hash_seconds")
        machine.write_json(args.json, {"store": args.store, "memory": args.memory, "rows": [dict(zip(keys, r)) for r in rows]})
    if args.record:
        shares = {
            mode: ", ".join((f"{v / r:.1%}" if r else "no reads") for _, m, _, _, r, v in rows if m == mode)
            for mode in ("always", "first", "off")
        }
        read = sum(r[3] for r in rows) / len(rows)
        caption = (
            f"Hashing expert records on the I/O threads, as a share of the time those threads spend reading: `--memory {args.memory}`, "
            f"{args.tokens} tokens, {read / 1e9:.1f} GB read per generation, {args.rounds} rounds, modes alternating:"
        )
        table = machine.table(
            caption, ["`--verify`", "hash seconds / read seconds, per round"], [[f"`{m}`", v] for m, v in shares.items()]
        )
        path = machine.write_result(args.record, "Checksums", machine.invocation(), [table])
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
