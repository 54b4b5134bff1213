"""Where a decode step's time goes, by module: each module kind's time per call inside a real decode.

    python benchmarks/module_times.py STORE --memory 6GiB [--tokens 64]
    MOESTREAM_FUSED=0 python benchmarks/module_times.py STORE --memory 6GiB     # without core/fused.py

Wraps the forward of the modules of every decoder layer (its norms, attention and its projections, the
router, the experts call, the LM head) with a timer, decodes a warm-up pass and then --tokens greedy
tokens after a 32-token prompt, and prints per kind: calls per token, microseconds per call and
milliseconds per token. Times nest (attention includes its projections), and each wrapper adds a few
microseconds, so the total is above an untimed decode's. Small ops cost far more here than in a loop of
their own: the experts' kernels between them push the interpreter's and the dispatcher's data out of the
caches.
"""

import argparse
import collections
import time

import torch

import moestream
from moestream.frontends.generate import timed

KINDS = {
    "input_layernorm": "layer norms",
    "post_attention_layernorm": "layer norms",
    "q_norm": "q/k norms",
    "k_norm": "q/k norms",
    "q_proj": "q projection",
    "k_proj": "k/v projections",
    "v_proj": "k/v projections",
    "o_proj": "o projection",
    "self_attn": "attention (all of it)",
    "gate": "router",
    "router": "router",
    "experts": "experts call",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("store")
    parser.add_argument("--memory", default="6GiB", help="a budget that holds every expert")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = moestream.load(args.store, args.memory, prefetch="off")
    seconds, calls = collections.defaultdict(float), collections.Counter()

    def timer(kind, forward):
        def run(*a, **k):
            start = time.perf_counter()
            out = forward(*a, **k)
            seconds[kind] += time.perf_counter() - start
            calls[kind] += 1
            return out

        return run

    for name, module in model.named_modules():
        parts = name.split(".")
        kind = KINDS.get(parts[-1]) if "layers" in parts else ("LM head" if module is model.get_output_embeddings() else None)
        if kind is not None:
            module.forward = timer(kind, module.forward)
    ids = torch.arange(40, 72).view(1, -1)
    timed(model, ids, args.tokens)  # warm-up: the prompt's and the decode's experts into the cache
    seconds.clear()
    calls.clear()
    start = time.perf_counter()
    rate = timed(model, ids, args.tokens).timing.decode_tokens_per_second
    steps = args.tokens + 1  # the prompt's pass and every decode step (the prompt's share is small)
    print(f"decode {rate:.2f} tok/s; wall {(time.perf_counter() - start) / steps * 1e3:.3f} ms per step, timers included")
    print(f"{'module':<24} {'calls/step':>10} {'us/call':>9} {'ms/step':>8}")
    for kind in dict.fromkeys([*KINDS.values(), "LM head"]):
        if calls[kind]:
            print(
                f"{kind:<24} {calls[kind] / steps:>10.1f} {seconds[kind] / calls[kind] * 1e6:>9.1f} {seconds[kind] / steps * 1e3:>8.3f}"
            )


if __name__ == "__main__":
    main()
