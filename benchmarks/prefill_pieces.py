"""A long prompt in one forward pass against pieces of `--piece` tokens (generation/generate.py,
PREFILL_PIECE): prefill time and the process's peak RSS, each in a fresh process, every expert cached first.

    python benchmarks/prefill_pieces.py STORE [--tokens 16384] [--pieces 4096 0] [--memory 6GiB]

`--pieces 0` is one pass. Prints one line per setting: seconds, tokens/s, peak RSS, and the peak over what
the process held before the prompt (the prompt's activations and KV cache). `--record` writes them as this
machine's record of prefill-pieces (benchmarks/machine.py), a table per prompt length.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import machine  # noqa: E402


def measure(store: str, tokens: int, piece: int, memory: str) -> dict:
    import torch

    import moestream
    from moestream.core.memory import peak_rss_bytes
    from moestream.generation import generate

    generate.PREFILL_PIECE = piece or 1 << 40
    model, _ = moestream.load(store, memory, prefetch="off")
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(5)
    with torch.inference_mode():
        generate.Forward(model)(torch.randint(3, vocab, (1, 512), generator=g))  # every expert read in
        before = peak_rss_bytes()
        ids = torch.randint(3, vocab, (1, tokens), generator=g)
        start = time.perf_counter()
        generate.Forward(model)(ids)
        seconds = time.perf_counter() - start
    return {"seconds": seconds, "peak_rss": peak_rss_bytes(), "before": before}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("store")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--pieces", type=int, nargs="+", default=[4096, 0])
    parser.add_argument("--memory", default="6GiB")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    machine.add_record_argument(parser, "prefill-pieces")
    args = parser.parse_args()
    if args.worker is not None:
        print(json.dumps(measure(args.store, args.tokens, args.worker, args.memory)))
        return
    row = []
    for piece in args.pieces:
        command = [
            sys.executable,
            __file__,
            args.store,
            "--tokens",
            str(args.tokens),
            "--memory",
            args.memory,
            "--worker",
            str(piece),
        ]
        r = json.loads(subprocess.run(command, check=True, stdout=subprocess.PIPE, text=True).stdout.strip().splitlines()[-1])
        print(
            f"{'one pass' if piece == 0 else f'pieces of {piece}':>16}: {r['seconds']:.1f} s ({args.tokens / r['seconds']:.1f} tok/s), "
            f"peak RSS {r['peak_rss'] / 2**30:.2f} GiB, {(r['peak_rss'] - r['before']) / 2**30:.2f} GiB over the warm model",
            flush=True,
        )
        row.append(f"{r['seconds']:.1f} s, peak RSS {(r['peak_rss'] - r['before']) / 2**30:.2f} GiB over the warm model")
    if args.record:
        columns = ["prompt", *("one pass" if p == 0 else f"pieces of {p:,}" for p in args.pieces)]
        caption = f"A {args.tokens:,}-token prompt of random ids, every expert cached first (`--memory {args.memory}`), each setting in a fresh process:"
        table = machine.table(caption, columns, [[f"{args.tokens:,} tokens", *row]])
        path = machine.write_result(
            args.record, "Long prompts in pieces of 4,096 against one pass", machine.invocation(), [table]
        )
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
