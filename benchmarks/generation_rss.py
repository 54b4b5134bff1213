"""Peak RSS growth of one sampled generation above the runtime's baseline, for any tree of moestream.

    PYTHONPATH=/tmp/moestream-old/src python benchmarks/generation_rss.py DEMO/uniform.moe --memory 6MiB
    PYTHONPATH=src python benchmarks/generation_rss.py DEMO/uniform.moe --memory 6MiB

(DEMO: `moestream demo --quick --workdir DEMO` leaves its stores there.) Loads the store through the
public API and samples 24 tokens with transformers' `model.generate`, which every version runs, so two
trees (or two installs of torch/transformers) can be compared on the same work.
"""

import argparse
import resource

import torch

import moestream


def current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("store")
    parser.add_argument("--memory", default="6MiB")
    parser.add_argument("--tokens", type=int, default=24)
    args = parser.parse_args()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to the current RSS
    base = current_rss()
    model, tokenizer = moestream.load(args.store, args.memory)
    ids = tokenizer("def fibonacci(n):", return_tensors="pt").input_ids
    torch.manual_seed(0)
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=True, temperature=1.0,
                       top_k=0, top_p=1.0, pad_token_id=0)  # fmt: skip
    with open("/proc/self/status") as f:
        peak = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    print(f"baseline {base / 2**20:.0f} MiB, peak growth {(peak - base) / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
