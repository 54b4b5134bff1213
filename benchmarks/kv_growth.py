"""What one decode step's attention costs per layer as the context grows: the KV cache's growth and sdpa.

    python benchmarks/kv_growth.py [--shape qwen3-30b-a3b] [--positions 256,1024,4096,16384] [--threads 2]

transformers' DynamicCache grows each layer's keys and values by `torch.cat` at every step, which copies
the whole history; a cache with room to spare would copy in only the new position. For each context
length it times, for one layer and one token in bf16: that `cat` (for the keys; the values cost the
same again), the in-place write of one position into a preallocated buffer, and
`scaled_dot_product_attention` of one query over the positions (grouped-query heads, as transformers
calls it in decode). The best of 5 x 50 calls after 5 warm-up ones.
"""

import argparse

import packed_qkv  # its timing loop (run from benchmarks/, which Python puts on the path)
import torch
import torch.nn.functional as F

SHAPES = {"qwen3-30b-a3b": (32, 4, 128), "fixture": (4, 2, 64)}  # query heads, KV heads, head dim


def best_us(fn) -> float:
    return packed_qkv.best_us(fn, calls=50, repeats=5, warm_up=5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    parser.add_argument("--positions", default="256,1024,4096,16384")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    heads, kv_heads, dim = SHAPES[args.shape]
    print(f"{args.shape}: {heads} query / {kv_heads} KV heads of {dim}, bf16, one token, {args.threads} threads")
    print("| positions | cat (keys) | in-place write (keys) | sdpa | attention's share spent in the two cats |")
    print("| --- | --- | --- | --- | --- |")
    g = torch.Generator().manual_seed(0)
    for positions in (int(p) for p in args.positions.split(",")):
        keys, values = (torch.randn(1, kv_heads, positions, dim, generator=g).bfloat16() for _ in range(2))
        new = torch.randn(1, kv_heads, 1, dim, generator=g).bfloat16()
        buffer = torch.empty(1, kv_heads, positions + 64, dim, dtype=torch.bfloat16)
        query = torch.randn(1, heads, 1, dim, generator=g).bfloat16()
        cat = best_us(lambda k=keys, n=new: torch.cat([k, n], dim=-2))
        in_place = best_us(lambda b=buffer, p=positions, n=new: b[:, :, p : p + 1].copy_(n))
        sdpa = best_us(lambda q=query, k=keys, v=values: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
        print(f"| {positions} | {cat:.1f} us | {in_place:.1f} us | {sdpa:.1f} us | {2 * cat / (2 * cat + sdpa):.0%} |")


if __name__ == "__main__":
    main()
