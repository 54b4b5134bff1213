"""All-hits decode speed: moestream with a budget that holds every expert against transformers fully loaded,
same checkpoint, same prompt, greedy, measured side by side in one process.

    python benchmarks/all_hits_vs_transformers.py CHECKPOINT [--store STORE] [--tokens 64] [--repeats 3] [--json OUT]

tok/s here is tokens over the whole `generate` call, the prompt's prefill included, for both. --store: a store
already converted from CHECKPOINT (e.g. `moestream convert CHECKPOINT STORE --experts-dtype bf16`); without it
the checkpoint is converted to a temporary store at its own dtype. --record writes the rates as this machine's
record of all-hits-vs-transformers (benchmarks/machine.py).

The greedy tokens of the two are compared in every repeat. Where they part (a bf16 near-tie that two kernels
round differently), the script says at which generated token, and compares moestream's tokens with one untimed
run of transformers in float32 as well.
"""

import argparse
import tempfile
import time

import machine
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import moestream
from moestream.conversion.store import Store
from moestream.core.runtime import runtime_of


def decode_rate(model, ids, tokens: int) -> tuple[float, torch.Tensor]:
    with torch.inference_mode():
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
        return tokens / (time.perf_counter() - start), out


def parted_at(a: torch.Tensor, b: torch.Tensor, prompt: int) -> int | None:
    """The first generated token (counted from 1) at which two greedy outputs differ; None if they are equal."""
    differ = (a[0, prompt:] != b[0, prompt:]).nonzero()
    return None if len(differ) == 0 else int(differ[0, 0]) + 1


def agreement(parted: list) -> str:
    if all(p is None for p in parted):
        return "greedy tokens identical"
    return "greedy tokens part at generated token " + ", ".join("none" if p is None else str(p) for p in parted)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt", default="def fibonacci(n):")
    parser.add_argument("--store", help="a store of CHECKPOINT to stream from (default: convert it to a temporary one)")
    parser.add_argument("--json", help="write the rates here too")
    machine.add_record_argument(parser, "all-hits-vs-transformers")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        store = args.store or moestream.convert(args.checkpoint, f"{tmp}/store", progress=False)
        streamed, _ = moestream.load(store, Store(store).manifest.expert_bytes * 2)
        reference = AutoModelForCausalLM.from_pretrained(args.checkpoint).eval()
        args.checkpoint_dtype = str(reference.dtype).removeprefix("torch.")
        ids = AutoTokenizer.from_pretrained(args.checkpoint)(args.prompt, return_tensors="pt").input_ids
        decode_rate(streamed, ids, args.tokens)  # warm-up: reads every expert the prompt needs once
        decode_rate(reference, ids, args.tokens)
        runtime_of(streamed).reset_stats()
        rates = {"moestream": [], "transformers": []}
        parted = []  # per repeat
        for _ in range(args.repeats):  # interleaved, so machine noise hits both alike
            r, a = decode_rate(streamed, ids, args.tokens)
            rates["moestream"].append(r)
            r, b = decode_rate(reference, ids, args.tokens)
            rates["transformers"].append(r)
            parted.append(parted_at(a, b, ids.shape[1]))
        against_fp32 = None
        if any(p is not None for p in parted):
            float32 = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32).eval()
            _, c = decode_rate(float32, ids, args.tokens)
            against_fp32 = agreement([parted_at(a, c, ids.shape[1])])
            del float32
        best = {k: max(v) for k, v in rates.items()}
        hit_rate = moestream.stats(streamed)["hit_rate"]
        print(f"machine: {machine.line()}")
        print(f"transformers fully loaded: {best['transformers']:.1f} tok/s (best of {args.repeats})")
        print(f"moestream, all experts cached: {best['moestream']:.1f} tok/s (best of {args.repeats}), hit rate {hit_rate:.1%}")
        print(f"ratio moestream / transformers: {best['moestream'] / best['transformers']:.2f}; {agreement(parted)} (per repeat)")
        if against_fp32:
            print(f"moestream against transformers in float32 (one untimed run): {against_fp32}")
        if args.json:
            machine.write_json(
                args.json,
                {"tokens": args.tokens, "tokens_per_second": rates, "ratio_of_best": best["moestream"] / best["transformers"]},
            )
        if args.record:
            record(args, rates, best, hit_rate, agreement(parted), against_fp32)


def record(args, rates: dict, best: dict, hit_rate: float, agreed: str, against_fp32: str | None) -> None:
    import transformers

    caption = (
        f"Greedy, {args.tokens} new tokens of `{args.prompt}`, {args.repeats} interleaved repeats after a warm-up of each; "
        "tok/s is tokens over the whole `generate` call, prompt included:"
    )
    rows = [
        ["transformers fully loaded", f"{best['transformers']:.1f}", ", ".join(f"{r:.1f}" for r in rates["transformers"]), ""],
        [
            "moestream, every expert cached",
            f"{best['moestream']:.1f}",
            ", ".join(f"{r:.1f}" for r in rates["moestream"]),
            f"{hit_rate:.1%}",
        ],
    ]
    table = machine.table(caption, ["", f"tok/s, best of {args.repeats}", "tok/s, per repeat", "hit rate"], rows)
    notes = (
        f"moestream / transformers, best against best: **{best['moestream'] / best['transformers']:.2f}x**; {agreed} "
        f"(per repeat). transformers {transformers.__version__}, the checkpoint at its own dtype ({args.checkpoint_dtype})."
    )
    if against_fp32:
        notes += f" moestream against transformers in float32 (one untimed run): {against_fp32}."
    title = "Every expert cached against transformers fully loaded"
    path = machine.write_result(args.record, title, machine.invocation(), [table], notes)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
