"""Write a synthetic Qwen3-MoE checkpoint (random bf16 weights, byte-level tokenizer) of a chosen size.

    python benchmarks/make_synthetic_checkpoint.py OUT [--layers 16] [--experts 64] [--hidden 1024] [--expert-width 512] [--zipf 1.2]
    python benchmarks/make_synthetic_checkpoint.py OUT --shape qwen3-30b-a3b [--layers 8]
    python benchmarks/make_synthetic_checkpoint.py OUT --shape qwen3-30b-a3b --tokenizer DIR   # a real-size vocabulary

--zipf skews expert popularity (router biases, moestream.conversion.synthetic.skew_router) so that a cache has
something to find; without it random routers pick experts almost uniformly. --calibrated routes with
moestream.conversion.synthetic.calibrated_router instead (popularity, per-token spread and locality
between consecutive tokens; its CALIBRATED parameters, or e.g. --calibrated zipf=0.5,noise=1,topic=0.5).

--shape qwen3-30b-a3b takes Qwen3-30B-A3B's per-layer shape (hidden 2048, 32 query / 4 KV heads of
head_dim 128, 128 experts of width 768, top-8 with normalized weights, rope theta 1e6) with 8 of its 48
layers and the byte-level vocabulary: 9.3 GiB of bf16, built in memory once. Options given explicitly
override the preset's values. --tokenizer takes a Hugging Face tokenizer directory instead of the byte-level
one (the embedding and LM head grow to its vocabulary: what a per-token cost over the vocabulary, such as a
grammar's mask, is measured with).

The checkpoint is written one decoder layer at a time (save_layerwise): `save_pretrained` turns the
fused experts back into per-expert tensors for the whole model at once, copying gate_up (2/3 of the
expert bytes) before it writes the first file, which at this shape is most of a second copy of the
model. The files hold the same tensors under the same names.
"""

import argparse
import dataclasses
import json
import re
from pathlib import Path

import torch

from moestream.conversion.synthetic import VOCAB_SIZE, byte_tokenizer, make_model, skew_router

# Defaults (the original synthetic store) and the presets; None means "derived" (see main).
DEFAULTS = dict(
    layers=16,
    experts=64,
    top_k=6,
    hidden=1024,
    expert_width=512,
    heads=8,
    kv_heads=4,
    head_dim=None,
    max_positions=512,
    rope_theta=10000.0,
    norm_topk_prob=False,
)
SHAPES = {
    # Qwen3-30B-A3B's config.json, except num_hidden_layers (48 there) and the vocabulary.
    "qwen3-30b-a3b": dict(
        layers=8,
        experts=128,
        top_k=8,
        hidden=2048,
        expert_width=768,
        heads=32,
        kv_heads=4,
        head_dim=128,
        max_positions=4096,
        rope_theta=1e6,
        norm_topk_prob=True,
    ),
}


def save_layerwise(model, directory: str | Path, max_shard_size: str = "1GB", tokenizer=None) -> Path:
    """What save_checkpoint (save_pretrained, then the byte tokenizer) writes, holding at most one layer's
    converted tensors and one shard beyond the model. A shard ends before it would pass max_shard_size."""
    from safetensors.torch import save_file
    from transformers.core_model_loading import revert_weight_conversion

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    limit = int(float(re.fullmatch(r"([0-9.]+)GB", max_shard_size).group(1)) * 1e9)
    groups: dict[str, dict] = {}
    for name, tensor in model.state_dict().items():
        layer = re.match(r"model\.layers\.(\d+)\.", name)
        groups.setdefault(f"layer {int(layer.group(1)):06d}" if layer else "rest", {})[name] = tensor
    shards: list[list[str]] = []
    pending: dict = {}
    total = parameters = 0

    def flush() -> None:
        if pending:
            shards.append(sorted(pending))
            save_file({k: v.contiguous() for k, v in pending.items()}, directory / f"shard-{len(shards)}.tmp", {"format": "pt"})
            pending.clear()

    for group in sorted(groups):
        for name, tensor in revert_weight_conversion(model, groups.pop(group)).items():
            size = tensor.numel() * tensor.element_size()
            if pending and sum(t.numel() * t.element_size() for t in pending.values()) + size > limit:
                flush()
            pending[name] = tensor
            total += size
            parameters += tensor.numel()
    flush()
    weight_map = {}
    for i, names in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors" if len(shards) > 1 else "model.safetensors"
        (directory / f"shard-{i}.tmp").rename(directory / file)
        weight_map.update({name: file for name in names})
    if len(shards) > 1:
        index = {
            "metadata": {"total_parameters": parameters, "total_size": total},
            "weight_map": dict(sorted(weight_map.items())),
        }
        (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    model.config.dtype = str(model.dtype).split(".")[1]
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(directory)
    if model.can_generate():
        model.generation_config.save_pretrained(directory)
    (tokenizer or byte_tokenizer()).save_pretrained(directory)
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--shape", choices=sorted(SHAPES), help="a real model's per-layer shape as the defaults")
    parser.add_argument("--layers", type=int)
    parser.add_argument("--experts", type=int)
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--hidden", type=int)
    parser.add_argument("--expert-width", type=int)
    parser.add_argument("--heads", type=int, help="query heads")
    parser.add_argument("--kv-heads", type=int, help="key/value heads")
    parser.add_argument("--head-dim", type=int, help="default: hidden / heads")
    parser.add_argument("--max-positions", type=int, help="max_position_embeddings")
    parser.add_argument("--rope-theta", type=float)
    parser.add_argument("--shard-size", default="1GB", help="at most this much per file (in GB)")
    parser.add_argument("--zipf", type=float, default=0.0, help="Zipf exponent of expert popularity (0: no skew)")
    parser.add_argument(
        "--calibrated",
        nargs="?",
        const="",
        metavar="zipf=Z,noise=N,topic=T",
        help="route with synthetic.calibrated_router: its CALIBRATED parameters (CALIBRATED_30B with --shape "
        "qwen3-30b-a3b), with these overrides",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", help="a Hugging Face tokenizer directory to use instead of the byte-level one")
    args = parser.parse_args()
    tokenizer = None
    if args.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    shape = dict(DEFAULTS, **SHAPES.get(args.shape, {}))
    for key in shape:
        if getattr(args, key, None) is not None:
            shape[key] = getattr(args, key)
    model = make_model(
        "qwen3_moe",
        seed=args.seed,
        vocab_size=len(tokenizer) if tokenizer is not None else VOCAB_SIZE,
        hidden_size=shape["hidden"],
        intermediate_size=2 * shape["hidden"],  # unused: every layer is MoE
        moe_intermediate_size=shape["expert_width"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        head_dim=shape["head_dim"] or shape["hidden"] // shape["heads"],
        num_experts=shape["experts"],
        num_experts_per_tok=shape["top_k"],
        norm_topk_prob=shape["norm_topk_prob"],
        max_position_embeddings=shape["max_positions"],
        rope_parameters={"rope_type": "default", "rope_theta": shape["rope_theta"]},
        dtype=torch.bfloat16,
    )
    if args.zipf and args.calibrated is not None:
        parser.error("--zipf and --calibrated are two routings; choose one")
    if args.zipf:
        skew_router(model, args.zipf)
    if args.calibrated is not None:
        from moestream.conversion import synthetic

        if not hasattr(synthetic, "calibrated_router"):
            parser.error("--calibrated: this moestream has no synthetic.calibrated_router")
        fields = {f.name: f.type for f in dataclasses.fields(synthetic.RoutingParams)}
        overrides = dict(item.split("=", 1) for item in args.calibrated.split(",") if item)
        if set(overrides) - set(fields):
            parser.error(f"--calibrated takes {', '.join(fields)}")
        typed = {k: (int if fields[k] in (int, "int") else float)(v) for k, v in overrides.items()}
        # The calibration is in logits, so it depends on experts and top-k: the 30B shape has its own.
        base = (
            getattr(synthetic, "CALIBRATED_30B", synthetic.CALIBRATED) if args.shape == "qwen3-30b-a3b" else synthetic.CALIBRATED
        )
        synthetic.calibrated_router(model, dataclasses.replace(base, **typed))
    save_layerwise(model, args.out, max_shard_size=args.shard_size, tokenizer=tokenizer)


if __name__ == "__main__":
    main()
