"""Decode with the fused one-token attention (core/fused.py) against the attention modules' own forwards,
side by side in one process.

    python benchmarks/fused_attention.py STORE --memory 256MiB [--tokens 200] [--rounds 8] [--prefill]

Loads the store (the fused attention installs itself where it gives the module's bits), warms the cache
with a 512-token prompt, then decodes --tokens greedy tokens after a 32-token prompt through
`generate_step`, the decode path of every command, in alternating rounds: once with the fused forwards,
once with each module's own. Prints each round, whether both decoded the same tokens, and the medians
and the median of per-round ratios (ab_rounds.py). With --prefill the rounds time the 512-token prompt
instead (512 / time to first token), which must take the modules' own forward either way.
"""

import argparse

from ab_rounds import alternate, load, store_arguments

from moestream.core import fused
from moestream.frontends.generate import timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    store_arguments(parser, tokens=200, rounds=8, memory="256MiB")
    parser.add_argument("--prefill", action="store_true", help="time the 512-token prefill instead of the decode")
    args = parser.parse_args()
    model = load(args)
    modules = [m for m in model.modules() if getattr(m.forward, "func", None) is fused._fused_attention]
    if not modules:
        raise SystemExit("no attention module of this model takes the fused one-token step")
    forwards = {"fused": [m.forward for m in modules], "own": [m.forward.args[-1] for m in modules]}
    print(f"{len(modules)} attention modules take the fused step")

    def decode(way: str) -> tuple[float, list[int]]:
        for module, forward in zip(modules, forwards[way]):
            module.forward = forward
        if args.prefill:
            result = timed(model, long, 1)
            return len(long) / result.timing.time_to_first_token, result.token_ids
        result = timed(model, prompt, args.tokens)
        return result.timing.decode_tokens_per_second, result.token_ids

    long = [10 + i % 200 for i in range(512)]
    timed(model, long, 2)  # every expert a long prompt routes to, into the cache
    prompt = [10 + i for i in range(32)]
    decode("fused"), decode("own")  # and any the decode needs besides
    alternate({"fused": lambda: decode("fused"), "own": lambda: decode("own")}, args.rounds)


if __name__ == "__main__":
    main()
