"""Tiny random checkpoints of each MoE family, built by transformers and saved as real HF directories."""

from __future__ import annotations

from pathlib import Path

import torch

from moestream.conversion.synthetic import VOCAB_SIZE, make_model, save_checkpoint

_COMMON = dict(vocab_size=VOCAB_SIZE, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=256)

TINY: dict[str, dict] = {
    "qwen3_moe": dict(
        _COMMON,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=8,
        num_experts_per_tok=2,
    ),
    "qwen2_moe": dict(
        _COMMON,
        intermediate_size=64,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
        num_key_value_heads=2,
        num_experts=8,
        num_experts_per_tok=2,
    ),
    "mixtral": dict(_COMMON, intermediate_size=16, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2),
    "olmoe": dict(
        _COMMON, intermediate_size=16, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, pad_token_id=1, eos_token_id=2
    ),  # the default eos id lies outside a tiny vocabulary
    # Group-limited sigmoid routing (2 groups of 4, one chosen), a dense first layer, a shared expert, MLA.
    "deepseek_v3": dict(
        _COMMON,
        num_hidden_layers=3,
        num_key_value_heads=4,
        intermediate_size=64,
        moe_intermediate_size=16,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        n_shared_experts=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
    ),
    # Interleaved gate/up, biases, clamped activation; sliding and full attention layers.
    "gpt_oss": dict(
        _COMMON,
        max_position_embeddings=131072,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=16,
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
    ),
    # Hash-routed first layer, compressed and sparse attention, hyper-connections, clamped SwiGLU experts.
    "deepseek_v4": dict(
        _COMMON,
        num_hidden_layers=3,
        num_key_value_heads=1,
        head_dim=16,
        q_lora_rank=16,
        partial_rotary_factor=0.5,
        moe_intermediate_size=16,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        layer_types=["heavily_compressed_attention", "compressed_sparse_attention", "sliding_attention"],
        mlp_layer_types=["hash_moe", "moe", "moe"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        sliding_window=8,
        o_groups=2,
        o_lora_rank=8,
        index_n_heads=2,
        index_head_dim=8,
        index_topk=2,
        hc_mult=2,
        hc_sinkhorn_iters=5,
    ),
}


def tiny_model(family: str, seed: int = 0):
    model = make_model(family, seed=seed, **TINY[family])
    if family == "deepseek_v4":
        # Hash routing tables start as zeros (every token -> expert 0); give each token distinct experts.
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, buffer in model.named_buffers():
                if name.endswith("tid2eid"):
                    experts = model.config.n_routed_experts
                    rows = [torch.randperm(experts, generator=g)[: buffer.shape[1]] for _ in range(buffer.shape[0])]
                    buffer.copy_(torch.stack(rows))
    return model


def tiny_checkpoint(family: str, directory: Path, seed: int = 0) -> tuple[torch.nn.Module, Path]:
    model = tiny_model(family, seed)
    return model, save_checkpoint(model, directory)
