"""The config layer: MoE fields read under every family's names, from a dict or a PretrainedConfig."""

from transformers import CONFIG_MAPPING

from moestream.conversion.sizes import routed_experts, routed_top_k


def test_routed_top_k_reads_every_family_name():
    assert routed_top_k({"num_experts_per_tok": 6}) == 6
    assert routed_top_k({"moe_topk": 3}) == 3  # hunyuan_v1_moe, longcat_flash
    assert routed_top_k({"moe_topk": [2, 4, 4]}) == 4  # per-layer: the largest layer
    assert routed_top_k({"moe_top_k": 2}) == 2  # dbrx
    assert routed_top_k({"text_config": {"num_experts_per_tok": 5}}) == 5  # multimodal wrapper
    assert routed_top_k({}) == 1


def test_routed_top_k_and_experts_of_a_pretrained_config():
    config = CONFIG_MAPPING["qwen3_moe"](num_experts=16, num_experts_per_tok=4)
    assert routed_top_k(config) == 4 and routed_experts(config) == 16
    config = CONFIG_MAPPING["mixtral"](num_local_experts=8, num_experts_per_tok=2)
    assert routed_top_k(config) == 2 and routed_experts(config) == 8
    assert routed_experts({"n_routed_experts": 64}) == 64 and routed_experts({}) is None
