"""`moestream demo` as a result record: runs the command (its default run unless told otherwise), prints its
output as it came, and parses its two tables (the budget sweep on random routers, and skewed routers against
random ones at one budget).

    python benchmarks/demo_record.py [--tokens N] [--threads N] [--quick] [--record]

--record writes the tables, as the demo printed them, as this machine's record of demo (benchmarks/machine.py);
the demo's first and last lines (the model built, the largest peak RSS, its own time) go into the notes.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time

import machine

HEADER = "budget of experts hit rate MB read peak RSS of which model TTFT s decode tok/s"
COLUMNS = ["budget", "of experts", "hit rate", "MB read", "peak RSS", "of which model", "TTFT s", "decode tok/s"]
SIZE = r"\S+ (?:[KMGT]iB|B)"
ROW = re.compile(rf"^\s*({SIZE})\s+(\S+)\s+(\S+%)\s+(\S+)\s+({SIZE})\s+({SIZE})\s+(\S+)\s+(\S+)\s*$")


def parse(output: str) -> tuple[list[tuple[str, list[list[str]]]], list[str]]:
    """The demo's tables, each (the line before its header, its rows), and its lines outside the tables."""
    lines = output.splitlines()
    tables, other, i = [], [], 0
    while i < len(lines):
        if " ".join(lines[i].split()) == HEADER:
            caption = other.pop() if other else ""
            rows = []
            i += 1
            while i < len(lines) and (match := ROW.match(lines[i])):
                rows.append(list(match.groups()))
                i += 1
            if not rows:
                raise SystemExit(f"demo_record.py: no rows under the table of {caption!r}; the demo's output changed")
            tables.append((caption, rows))
            continue
        if lines[i].strip():
            other.append(lines[i].strip())
        i += 1
    if not tables:
        raise SystemExit(f"demo_record.py: no table headed {HEADER!r} in the demo's output; it changed")
    return tables, other


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, help="passed to `moestream demo --tokens`")
    parser.add_argument("--threads", type=int, help="passed to `moestream demo --threads`")
    parser.add_argument("--quick", action="store_true", help="`moestream demo --quick`")
    machine.add_record_argument(parser, "demo")
    args = parser.parse_args()
    argv = ["demo"]
    if args.tokens is not None:
        argv += ["--tokens", str(args.tokens)]
    if args.threads is not None:
        argv += ["--threads", str(args.threads)]
    if args.quick:
        argv.append("--quick")
    print(f"machine: {machine.line()}", flush=True)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "moestream.cli", *argv], capture_output=True, text=True)
    wall = time.perf_counter() - start
    print(done.stdout, end="")
    if done.returncode != 0:
        print(done.stderr, file=sys.stderr, end="")
        raise SystemExit(f"`moestream {' '.join(argv)}` exited with {done.returncode}")
    tables, other = parse(done.stdout)
    print(f"`moestream {' '.join(argv)}` took {wall:.1f} s, measured here")
    if args.record:
        records = [machine.table(caption, COLUMNS, rows) for caption, rows in tables]
        notes = (
            f"`moestream {' '.join(argv)}`'s own lines around its tables: "
            + " ".join(line if line.endswith((".", ":")) else line + "." for line in other)
            + f" The whole command took {wall:.1f} s, measured by demo_record.py."
        )
        path = machine.write_result(args.record, "`moestream demo`", machine.invocation(), records, notes)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
