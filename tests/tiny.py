"""Tiny random checkpoints of each MoE family, built by transformers and saved as real HF directories."""

from __future__ import annotations

from pathlib import Path

import torch

from moestream.synthetic import VOCAB_SIZE, make_model, save_checkpoint

_COMMON = dict(vocab_size=VOCAB_SIZE, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=256)

TINY: dict[str, dict] = {
    "qwen3_moe": dict(_COMMON, intermediate_size=64, moe_intermediate_size=16, num_key_value_heads=2, head_dim=8,
                      num_experts=8, num_experts_per_tok=2),
    "qwen2_moe": dict(_COMMON, intermediate_size=64, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                      num_key_value_heads=2, num_experts=8, num_experts_per_tok=2),
    "mixtral": dict(_COMMON, intermediate_size=16, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2),
    "olmoe": dict(_COMMON, intermediate_size=16, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2),
}


def tiny_model(family: str, seed: int = 0):
    return make_model(family, seed=seed, **TINY[family])


def tiny_checkpoint(family: str, directory: Path, seed: int = 0) -> tuple[torch.nn.Module, Path]:
    model = tiny_model(family, seed)
    return model, save_checkpoint(model, directory)
