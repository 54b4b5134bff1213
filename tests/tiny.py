"""Tiny random checkpoints of each MoE family, built by transformers and saved as real HF directories."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig

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

# Every other model type whose experts use transformers' experts interface (tests/test_families.py lists
# those that cannot run here, with why). Each is its own default config shrunk by `shrunk`: the sizes below
# wherever the config has the field, per-layer lists cut to one layer of each kind, then its own overrides.
_SIZES = dict(
    vocab_size=VOCAB_SIZE, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
    intermediate_size=64, moe_intermediate_size=16, dense_intermediate_size=64, shared_expert_intermediate_size=24,
    shared_intermediate_size=24, shared_experts_intermediate_size=24, moe_shared_expert_intermediate_size=24,
    num_experts=8, n_routed_experts=8, num_local_experts=8, moe_num_experts=8,
    num_experts_per_tok=2, num_experts_per_token=2, moe_topk=2, moe_k=2,
    n_shared_experts=1, num_shared_experts=1, moe_num_shared_experts=1,
    q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, qk_head_dim=16,
    index_n_heads=2, index_head_dim=8, index_topk=2, sliding_window=4, sliding_window_size=4,
    linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_head_dim=8, linear_num_heads=4,
    mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_chunk_size=16, mamba_dt_rank=4,
    mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=8, n_groups=1, chunk_size=16,
    swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=8, rel_extent=16, d_rel=4,
    hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB_SIZE, router_hidden_size=16, rotary_dim=4,
    hc_lowrank=8, ple_embed_dim=32, gated_norm_rank=4, loop_gate_rank=4,
)  # fmt: skip
_PER_LAYER = ("layer_types", "mlp_layer_types", "indexer_types", "layer_rope_theta", "num_attention_heads_per_layer")
_TOKEN_IDS = dict(pad_token_id=1, bos_token_id=0, eos_token_id=2, eod_token_id=2)  # inside the tiny vocabulary


def shrunk(model_type: str, **overrides) -> dict:
    """`model_type`'s default config made tiny: every field of `_SIZES` it has; its per-layer lists cut to
    the first layer of each kind (at least two layers); a first dense layer where it has some; special
    token ids inside the vocabulary; then `overrides`."""
    base = AutoConfig.for_model(model_type).to_dict()
    out = {k: v for k, v in _SIZES.items() if k in base}
    layers = base.get("num_hidden_layers")
    lists = {k: base[k] for k in _PER_LAYER if isinstance(base.get(k), list) and len(base[k]) == layers}
    if lists:
        kinds, picked = set(), []
        for i in range(layers):
            kind = tuple(str(v[i]) for v in lists.values())
            if kind not in kinds:
                kinds.add(kind)
                picked.append(i)
        picked += [picked[-1] + 1] if len(picked) < 2 else []
        out.update({k: [v[i] for i in picked] for k, v in lists.items()}, num_hidden_layers=len(picked))
    elif layers:
        out["num_hidden_layers"] = 2
    out.update({k: 1 for k in ("first_k_dense_replace", "num_dense_layers", "moe_layer_start_index") if (base.get(k) or 0) > 0})
    if base.get("mlp_only_layers"):
        out["mlp_only_layers"] = [0]
    if "moe_layer_end_index" in base:
        out["moe_layer_end_index"] = out["num_hidden_layers"] - 1
    for groups in ("n_group", "num_expert_group"):
        if (base.get(groups) or 0) > 1:
            out.update({groups: 2, "topk_group": 1})  # 2 groups of 4 experts, one chosen
    if base.get("per_layer_config"):
        out["per_layer_config"] = {}
    out.update({k: v for k, v in _TOKEN_IDS.items() if isinstance(base.get(k), int) and base[k] >= VOCAB_SIZE})
    return {**out, **overrides}


_MLA = dict(num_key_value_heads=4)  # multi-head latent attention: as many key/value heads as query heads
_FAMILIES = dict(
    afmoe={}, aria_text={}, axk1=_MLA, axk2=_MLA, bailing_hybrid=_MLA, beam={}, cohere2_moe={}, deepseek_v2=_MLA,
    deepseek_v32=_MLA, dots1={}, dots3_note_text=dict(_MLA, head_dim=16), ergo={}, ernie4_5_moe={}, exaone_moe={}, flex_olmo={},
    flint={}, gemma4_text=dict(enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=16),
    glm4_moe={}, glm4_moe_lite=_MLA, glm_moe_dsa=_MLA, granitemoe={}, granitemoe_swa={},
    granitemoehybrid=dict(layer_types=["linear_attention", "full_attention"], num_hidden_layers=2),
    granitemoeshared={}, hunyuan_v1_moe={}, hy_v3={}, hy_v4={}, inkling_text={},
    inkling2_text=dict(unpadded_vocab_size=VOCAB_SIZE), inkling2_loop_text=dict(unpadded_vocab_size=VOCAB_SIZE),
    jamba=dict(num_hidden_layers=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=1, expert_layer_offset=0),
    kimi_linear=_MLA, kolibri1={}, laguna={}, lara_mini={},
    kolibri1_1=dict(  # layer 2 reads layer 1's keys and values; head_dim a multiple of 16 (its NVFP4 rounding)
        num_hidden_layers=3, layer_types=["sliding_attention", "indexed_attention", "indexed_attention"], index_layers=[1],
        kv_source_layers=[0, 1, 1], head_dim=16, index_num_heads=2, index_topk=4, index_pool_size=16, index_compression=4,
        index_num_local_tokens=2, index_num_sink_tokens=1, mlp_only_intermediate_size=64,
    ),
    longcat_flash=dict(_MLA, num_layers=2, ffn_hidden_size=64, expert_ffn_hidden_size=16, zero_expert_num=2),
    lfm2_moe=dict(num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"]),
    mellum={}, mimo_v2_flash={}, minicpm5_moe={}, minimax={}, minimax_m2={}, minimax_m3_vl_text={}, nemotron_h={}, phimoe={},
    qwen3_5_moe_text={}, qwen3_next={},
    qwen4_exp_text=dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=4, indexer_compress_ratio=2),
    solar_open={}, zaya=dict(num_experts_per_tok=1),  # ZAYA routes to one expert only
)  # fmt: skip
_INITIALIZED_AS_IS = frozenset(TINY)  # the first seven keep transformers' own initialization (other tests' numbers)
TINY.update({family: shrunk(family, **overrides) for family, overrides in _FAMILIES.items()})
# Multimodal configs whose causal LM is their text model (the model types real checkpoints carry).
TINY.update(
    qwen3_5_moe=dict(text_config=TINY["qwen3_5_moe_text"]),
    qwen4_exp=dict(text_config=TINY["qwen4_exp_text"]),
    dots3_note=dict(text_config=TINY["dots3_note_text"], vision_config=dict(adapter_out_dim=32), audio_config=dict(adapter_out_dim=32)),
    gemma4=dict(  # with its vision and audio towers, shrunk too
        text_config=TINY["gemma4_text"],
        vision_config=dict(
            hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, head_dim=8,
            position_embedding_size=64,
        ),
        audio_config=dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, subsampling_conv_channels=[8, 4], output_proj_dims=16),
    ),
)  # fmt: skip


def _no_zero_init(model: torch.nn.Module, seed: int) -> None:
    """Small random values where transformers' init leaves a parameter (a router, a bias, a norm's offset) or a
    routing bias buffer all zeros: a zero router sends every token to the same experts, and a zero term hides
    whether it is computed at all. A router's own linear biases stay zero: in ZAYA's MLP router they would
    outweigh its tiny random logits and send every token to the same experts."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            in_router = name.endswith(".bias") and (".gate." in name or ".router" in name)
            chosen = isinstance(t, torch.nn.Parameter) or "bias" in name
            if chosen and not in_router and t.is_floating_point() and t.numel() and not t.any():
                t.copy_(torch.randn(t.shape, generator=g).to(t.dtype) * 0.02)  # the usual init std


def tiny_model(family: str, seed: int = 0):
    model = make_model(family, seed=seed, **TINY[family])
    if family not in _INITIALIZED_AS_IS:
        _no_zero_init(model, seed)
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
