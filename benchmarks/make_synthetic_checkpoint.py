"""Write a synthetic Qwen3-MoE checkpoint (random bf16 weights, byte-level tokenizer) of a chosen size.

    python benchmarks/make_synthetic_checkpoint.py OUT [--layers 16] [--experts 64] [--hidden 1024] [--expert-width 512] [--zipf 1.2]

--zipf skews expert popularity (router biases, moestream.conversion.synthetic.skew_router) so that a cache has
something to find; without it random routers pick experts almost uniformly.
"""

import argparse

import torch

from moestream.conversion.synthetic import VOCAB_SIZE, make_model, save_checkpoint, skew_router


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--expert-width", type=int, default=512)
    parser.add_argument("--shard-size", default="1GB")
    parser.add_argument("--zipf", type=float, default=0.0, help="Zipf exponent of expert popularity (0: no skew)")
    args = parser.parse_args()
    model = make_model(
        "qwen3_moe",
        seed=0,
        vocab_size=VOCAB_SIZE,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        moe_intermediate_size=args.expert_width,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=args.hidden // 8,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        max_position_embeddings=512,
        dtype=torch.bfloat16,
    )
    if args.zipf:
        skew_router(model, args.zipf)
    save_checkpoint(model, args.out, max_shard_size=args.shard_size)


if __name__ == "__main__":
    main()
