"""All-hits decode speed: moestream with a budget that holds every expert against transformers fully loaded,
same checkpoint, same prompt, greedy, measured side by side in one process.

    python benchmarks/all_hits_vs_transformers.py CHECKPOINT [--tokens 64] [--repeats 3] [--json OUT]

tok/s here is tokens over the whole `generate` call, the prompt's prefill included, for both.
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt", default="def fibonacci(n):")
    parser.add_argument("--json", help="write the rates here too")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        store = moestream.convert(args.checkpoint, f"{tmp}/store", progress=False)
        streamed, _ = moestream.load(store, Store(store).manifest.expert_bytes * 2)
        reference = AutoModelForCausalLM.from_pretrained(args.checkpoint).eval()
        ids = AutoTokenizer.from_pretrained(args.checkpoint)(args.prompt, return_tensors="pt").input_ids
        decode_rate(streamed, ids, args.tokens)  # warm-up: reads every expert the prompt needs once
        decode_rate(reference, ids, args.tokens)
        runtime_of(streamed).reset_stats()
        rates = {"moestream": [], "transformers": []}
        for _ in range(args.repeats):  # interleaved, so machine noise hits both alike
            r, a = decode_rate(streamed, ids, args.tokens)
            rates["moestream"].append(r)
            r, b = decode_rate(reference, ids, args.tokens)
            rates["transformers"].append(r)
            assert torch.equal(a, b), "greedy tokens differ"
        best = {k: max(v) for k, v in rates.items()}
        print(f"machine: {machine.line()}")
        print(f"transformers fully loaded: {best['transformers']:.1f} tok/s (best of {args.repeats})")
        print(
            f"moestream, all experts cached: {best['moestream']:.1f} tok/s (best of {args.repeats}), "
            f"hit rate {moestream.stats(streamed)['hit_rate']:.1%}"
        )
        print(f"ratio moestream / transformers: {best['moestream'] / best['transformers']:.2f}; greedy tokens identical")
        if args.json:
            machine.write_json(
                args.json,
                {"tokens": args.tokens, "tokens_per_second": rates, "ratio_of_best": best["moestream"] / best["transformers"]},
            )


if __name__ == "__main__":
    main()
