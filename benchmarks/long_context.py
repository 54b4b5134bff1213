"""Decode after a long prompt with the KV cache growing into room (kv_layer.py) against transformers'
concatenation, side by side in one process.

    python benchmarks/long_context.py STORE --memory 6GiB [--positions 3000] [--tokens 18] [--rounds 5]

Loads the store, prefills --positions random token ids once, then decodes --tokens greedy tokens from
that prefill in alternating rounds (A B, B A, ...): once with the cache's layers made GrowingLayers
(what `generate_step` does after its prefill) and once with transformers' DynamicLayers as they are.
Each round starts from its own copy of the prefilled cache; decode tokens/s counts the tokens after the
first two (the growing layers' first update copies the history into buffers with room). Prints each
round, whether both gave the same logits, and the medians and the median of per-round ratios
(ab_rounds.py).
"""

import argparse
import time

import torch
from ab_rounds import alternate, load, store_arguments

from moestream.frontends.generate import Forward
from moestream.frontends.kv_cache import _shallow
from moestream.frontends.kv_layer import grow_in_place


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    store_arguments(parser, tokens=18, rounds=5)
    parser.add_argument("--positions", type=int, default=3000)
    args = parser.parse_args()
    model = load(args)
    ids = torch.randint(0, 200, (1, args.positions), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        prefill = Forward(model)
        first = prefill(ids)[:, -1].argmax(-1).view(1, 1)

        def decode(grow: bool) -> tuple[float, torch.Tensor]:
            forward = Forward(model, _shallow(prefill.cache))  # layers of its own over the prefill's tensors
            if grow:
                grow_in_place(forward.cache)
            token, logits, start = first, [], None
            for i in range(args.tokens):
                if i == 2:
                    start = time.perf_counter()
                out = forward(token)[:, -1]
                token = out.argmax(-1).view(1, 1)
                logits.append(out)
            return (args.tokens - 2) / (time.perf_counter() - start), torch.stack(logits)

        decode(True), decode(False)  # warm-up: every expert these tokens use into the cache
        print(f"{args.positions} positions:")
        alternate({"growing": lambda: decode(True), "concatenating": lambda: decode(False)}, args.rounds)


if __name__ == "__main__":
    main()
