"""What run-time checksum verification costs: the same generation with --verify always, first and off.

Prints, per mode: decode tokens/s, seconds spent reading records and hashing them (summed over the I/O
threads), and hashing as a share of read time (--json writes the same; --record writes the table as this
machine's record of checksums, benchmarks/machine.py). Run it on a store much larger than --memory so that
most steps read from disk, e.g.

    python benchmarks/verify_cost.py big.moe --memory 256MiB --tokens 32

--check-rounds N also times `moestream verify STORE` and `moestream verify STORE --quick` N times each,
alternating (fresh processes; the seconds are the command's own, from its --json), as a second table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import machine
import torch

import moestream
from moestream.generation.generate import SamplingParams
from moestream.generation.serving import generate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("store")
    parser.add_argument("--memory", default="256MiB")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--prompt", default="def fibonacci(n):")
    parser.add_argument("--rounds", type=int, default=2, help="alternate the modes this many times")
    parser.add_argument("--check-rounds", type=int, default=0, help="time `moestream verify [--quick]` this many times each")
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
    checks: dict[tuple[str, ...], list] = {(): [], ("--quick",): []}
    for _ in range(args.check_rounds):
        for flags, runs in checks.items():
            argv = [sys.executable, "-m", "moestream.cli", "verify", args.store, "--json", *flags]
            out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
            report = json.loads(out[out.index("{") :])
            runs.append((report["seconds"], report["bytes_checked"], report["records_checked"], report["records_total"]))
    for flags, runs in checks.items():
        for seconds, nbytes, checked, total in runs:
            rate = nbytes / seconds / 1e9
            print(
                f"verify {' '.join(flags):7} {checked}/{total} records, {nbytes / 1e9:.3f} GB in {seconds:.3f} s ({rate:.2f} GB/s)"
            )
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
            f"{args.tokens} tokens, {read / 1e6:,.0f} MB read per generation, {args.rounds} rounds, modes alternating:"
        )
        table = machine.table(
            caption, ["`--verify`", "hash seconds / read seconds, per round"], [[f"`{m}`", v] for m, v in shares.items()]
        )
        tables = [table]
        if args.check_rounds:
            rows = [
                [
                    f"`{' '.join(['moestream verify', *flags])}`",
                    f"{runs[0][2]} of {runs[0][3]}",
                    f"{runs[0][1] / 1e9:.3f} GB",
                    ", ".join(f"{s:.3f}" for s, _, _, _ in runs),
                    ", ".join(f"{b / s / 1e9:.2f}" for s, b, _, _ in runs),
                ]
                for flags, runs in checks.items()
            ]
            columns = ["command", "records checked", "bytes checked", "seconds, per run", "GB/s, per run"]
            caption = f"`moestream verify` on the same store, {args.check_rounds} runs of each, alternating (its own timing):"
            tables.append(machine.table(caption, columns, rows))
        path = machine.write_result(args.record, "Checksums", machine.invocation(), tables)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
