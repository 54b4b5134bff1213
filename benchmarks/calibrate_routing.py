"""Calibrate synthetic routers (moestream.conversion.synthetic.calibrated_router) against a trained model.

    python benchmarks/calibrate_routing.py ../shared/models/tiny-code-moe
    python benchmarks/calibrate_routing.py ../shared/models/tiny-code-moe --shape qwen3-30b-a3b

FIXTURE is a trained Hugging Face MoE checkpoint with a heldout.txt beside it (or pass --text). Its
routing over the text is the reference: the experts each token of the text chooses, in each layer, fed as
decoding feeds them (teacher forcing; a causal model routes a token the same whether the sequence comes
whole or one token at a time, so one forward pass records it: --check-trace compares with a
`moestream trace` file of the converted fixture).

A random model of the chosen shape (default: the fixture's own, so the comparison is like for like;
--shape qwen3-30b-a3b: hidden 2048, 128 experts, top-8, with the fixture's layer count) gets routers of
RoutingParams(zipf, noise, topic) and routes the same text through the byte-level tokenizer of
synthetic checkpoints. A coordinate search over a small grid of each parameter minimizes the squared
distance between the two traces' (a) expert popularity (share of the routings taken by the top 5, 10,
20, 50% of each layer's experts) and (b) hit rates at budgets of 5, 10, 20, 30% of all experts under
lru, lfu and Belady's MIN (moestream.tools.simulate.replay, one decode call per token and layer).

Layers: routing is per layer, but the budgets are shares of all layers' experts and one cache holds
them all, so the layer count decides how LRU behaves when a token's experts (layers x top_k) outnumber
the budget. With the fixture's 6 layers x top-4 over a 5% budget (19 of 384), no expert of a layer
survives until the next token reaches that layer, and LRU hits nothing; with 2 layers x top-8 (13 of
256) most of the previous token's last layer survives, and RoutingParams(0.35, 1, 0.5), 0% at 6 layers,
hits 18% (distance 0.074, 0.034 of it that one number, against 0.016 at 6 layers). Keep
--layers at the fixture's count (the default) for a like-for-like 5% budget; --expert-width can be small.

It prints the fixture, the calibrated synthetic router, the plain Zipf router of the checkpoint builder
(skew_router, --zipf 1.2) and the random router side by side, and the RoutingParams line to paste into
synthetic.py (CALIBRATED, or CALIBRATED_30B for the Qwen3-30B-A3B shape). --json FILE writes it all.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import numpy as np
import torch

from moestream.conversion.synthetic import (
    VOCAB_SIZE,
    RoutingParams,
    byte_tokenizer,
    calibrated_router,
    make_model,
    routed_experts,
    skew_router,
)
from moestream.tools.simulate import replay
from moestream.tools.trace import Trace

SHARES = (0.05, 0.10, 0.20, 0.50)
BUDGETS = (0.05, 0.10, 0.20, 0.30)
POLICIES = ("lru", "lfu", "belady")
GRID = {
    "zipf": (0.0, 0.2, 0.35, 0.5, 0.75, 1.0, 1.5),
    "noise": (0.5, 0.75, 1.0, 1.5, 2.0),
    "topic": (0.0, 0.25, 0.5, 1.0, 1.5),
}
SHAPES = {
    # Qwen3-30B-A3B's per-layer shape (its config.json); the layer count stays the fixture's (see above).
    "qwen3-30b-a3b": dict(
        hidden_size=2048,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        norm_topk_prob=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    ),
}


def measure(experts: np.ndarray, n_experts: int) -> dict:
    """Popularity shares and hit rates per (budget, policy) of a [tokens, layers, top_k] routing."""
    tokens, layers, k = experts.shape
    counts = np.stack([np.bincount(experts[:, layer].ravel(), minlength=n_experts) for layer in range(layers)])
    ranked = -np.sort(-counts, axis=1)
    pop = {s: float(ranked[:, : max(1, round(s * n_experts))].sum() / ranked.sum()) for s in SHARES}
    trace = Trace.of_decode(experts, int(experts.max()) + 1)
    trace.layer_experts[:] = n_experts
    records = layers * n_experts
    hits = {(b, p): replay(trace, max(k, round(b * records)), p).hit_rate for b in BUDGETS for p in POLICIES}
    onehot = np.zeros((tokens, layers, n_experts), bool)
    np.put_along_axis(onehot, experts.astype(np.int64), True, axis=2)
    shuffled = onehot[np.random.default_rng(0).permutation(tokens)]
    overlap = float((onehot[1:] & onehot[:-1]).sum() / ((tokens - 1) * layers * k))
    baseline = float((shuffled[1:] & shuffled[:-1]).sum() / ((tokens - 1) * layers * k))
    return {"popularity": pop, "hits": hits, "overlap": overlap, "overlap_shuffled": baseline}


def distance(a: dict, b: dict) -> float:
    d = sum((a["popularity"][s] - b["popularity"][s]) ** 2 for s in SHARES)
    return d + sum((a["hits"][key] - b["hits"][key]) ** 2 for key in a["hits"])


def table(columns: dict[str, dict]) -> str:
    names = list(columns)
    width = max(12, *(len(n) for n in names))
    lines = [f"{'':<22}" + "".join(f"{n:>{width + 2}}" for n in names)]
    for s in SHARES:
        lines.append(
            f"{f'top {s:.0%} experts take':<22}" + "".join(f"{columns[n]['popularity'][s]:>{width + 2}.1%}" for n in names)
        )
    for b, p in itertools.product(BUDGETS, POLICIES):
        lines.append(f"{f'hit rate {b:.0%} {p}':<22}" + "".join(f"{columns[n]['hits'][(b, p)]:>{width + 2}.1%}" for n in names))
    lines.append(f"{'next token same expert':<22}" + "".join(f"{columns[n]['overlap']:>{width + 2}.1%}" for n in names))
    lines.append(f"{'  ...order shuffled':<22}" + "".join(f"{columns[n]['overlap_shuffled']:>{width + 2}.1%}" for n in names))
    return "\n".join(lines)


def fixture_routing(path: Path, text: str, tokens: int) -> tuple[np.ndarray, dict]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype="auto").eval()  # as stored, as the store runs it
    ids = tokenizer(text)["input_ids"][:tokens]
    experts = routed_experts(model, ids)
    return experts, model.config.to_dict()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("fixture", type=Path, help="a trained HF MoE checkpoint (e.g. ../shared/models/tiny-code-moe)")
    parser.add_argument("--text", type=Path, help="UTF-8 text to route (default: FIXTURE/heldout.txt)")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens of the text to route, for both models (default 2048)")
    parser.add_argument("--shape", choices=sorted(SHAPES), help="the synthetic model's shape (default: the fixture's)")
    parser.add_argument("--layers", type=int, help="synthetic MoE layers (default: the fixture's)")
    parser.add_argument("--expert-width", type=int, help="synthetic moe_intermediate_size (the routing does not depend on it)")
    parser.add_argument("--rounds", type=int, default=2, help="coordinate-search rounds over the grid (default 2)")
    parser.add_argument("--check-trace", type=Path, help="a `moestream trace` of the converted fixture over the same text")
    parser.add_argument(
        "--grid",
        action="append",
        default=[],
        metavar="NAME=V,V,...",
        help="the values to try for one parameter (zipf, noise, topic) instead of the default grid; repeatable",
    )
    parser.add_argument("--start", default="0.5,1.0,0.5", metavar="ZIPF,NOISE,TOPIC", help="where the search starts")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    text = (args.text or args.fixture / "heldout.txt").read_text()
    started = time.perf_counter()

    reference, config = fixture_routing(args.fixture, text, args.tokens)
    fixture_experts = config.get("num_experts") or config["num_local_experts"]
    target = measure(reference, fixture_experts)
    print(
        f"fixture {args.fixture}: {reference.shape[0]} tokens, {reference.shape[1]} MoE layers x {fixture_experts} experts, top-{reference.shape[2]}"
    )
    if args.check_trace:
        recorded = Trace.load(args.check_trace)
        rows = min(len(recorded.experts), reference.shape[0] * reference.shape[1])
        same = (np.sort(recorded.experts[:rows], 1) == np.sort(reference.reshape(-1, reference.shape[2])[:rows], 1)).all(1).mean()
        print(f"  {same:.1%} of {rows} (token, layer) routings equal those of {args.check_trace}")

    shape = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=config["hidden_size"],
        intermediate_size=config.get("intermediate_size", 2 * config["hidden_size"]),
        moe_intermediate_size=config["moe_intermediate_size"],
        num_hidden_layers=config["num_hidden_layers"],
        num_attention_heads=config["num_attention_heads"],
        num_key_value_heads=config["num_key_value_heads"],
        head_dim=config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
        num_experts=fixture_experts,
        num_experts_per_tok=config["num_experts_per_tok"],
        norm_topk_prob=config.get("norm_topk_prob", True),
        max_position_embeddings=max(args.tokens, 512),
    )
    shape.update(SHAPES.get(args.shape, {}))
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    if args.expert_width:
        shape["moe_intermediate_size"] = args.expert_width
    model = make_model("qwen3_moe", seed=args.seed, dtype=torch.bfloat16, **shape)
    n_experts = shape["num_experts"]
    ids = byte_tokenizer()(text)["input_ids"][: args.tokens]
    print(
        f"synthetic: hidden {shape['hidden_size']}, {shape['num_hidden_layers']} layers x {n_experts} experts, "
        f"top-{shape['num_experts_per_tok']}, {len(ids)} byte tokens of the same text"
    )
    with torch.no_grad():
        pristine = {k: v.clone() for k, v in model.state_dict().items()}
    columns = {"fixture": target, "random": measure(routed_experts(model, ids), n_experts)}
    skew_router(model, 1.2)
    columns["zipf 1.2"] = measure(routed_experts(model, ids), n_experts)
    model.load_state_dict(pristine)

    seen: dict[RoutingParams, tuple[float, dict]] = {}

    def score(p: RoutingParams) -> float:
        if p not in seen:
            calibrated_router(model, p)
            m = measure(routed_experts(model, ids), n_experts)
            seen[p] = (distance(m, target), m)
            print(f"  {p}: distance {seen[p][0]:.4f}", flush=True)
        return seen[p][0]

    grid = dict(GRID)
    for spec in args.grid:
        name, _, values = spec.partition("=")
        if name not in grid:
            parser.error(f"--grid {spec}: the parameters are {', '.join(grid)}")
        grid[name] = tuple(float(v) for v in values.split(","))
    zipf, noise, topic = (float(v) for v in args.start.split(","))
    best = RoutingParams(zipf=zipf, noise=noise, topic=topic, seed=args.seed)
    for _ in range(args.rounds):
        for name, values in grid.items():
            trial = [RoutingParams(**{**best.__dict__, name: v}) for v in values]
            best = min(trial, key=score)
    columns[f"calibrated ({len(seen)} tried)"] = seen[best][1]
    print()
    print(table(columns))
    constant = "CALIBRATED_30B" if args.shape else "CALIBRATED"
    print(
        f"\n{constant} = RoutingParams(zipf={best.zipf}, noise={best.noise}, topic={best.topic})  # distance {seen[best][0]:.4f}"
    )
    print(f"({time.perf_counter() - started:.0f} s)")
    if args.json:

        def flat(m: dict) -> dict:
            return {
                "popularity": {f"{s:.0%}": v for s, v in m["popularity"].items()},
                "hits": {f"{b:.0%} {p}": v for (b, p), v in m["hits"].items()},
                "overlap": m["overlap"],
                "overlap_shuffled": m["overlap_shuffled"],
            }

        out = {"params": best.__dict__, "shape": shape, "columns": {n: flat(m) for n, m in columns.items()}}
        args.json.write_text(json.dumps(out, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
