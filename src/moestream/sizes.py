"""Byte arithmetic of a store: what stays resident, what streams, what a token can cost, what a budget buys.

Also the one place where a model config's MoE fields are read, under every family's names (routed_top_k,
routed_experts): a dict (a store manifest's model_config, a config.json) or a transformers PretrainedConfig.

Two sizes of an expert record are kept apart everywhere: its payload bytes (the tensor bytes it holds) and
its stride bytes (as stored, 4 KiB-aligned: what one read and one cache slot cost).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from .store import Manifest

# Family names of the number of routed experts one token uses per MoE layer, first match wins.
# hunyuan_v1_moe and longcat_flash say moe_topk (hunyuan's may be a per-layer list), dbrx moe_top_k,
# ernie4_5_moe moe_k; most families num_experts_per_tok.
TOP_K_FIELDS = ("num_experts_per_tok", "moe_topk", "moe_top_k", "moe_k")
# Family names of the number of routed experts per MoE layer (shared experts are not counted).
EXPERTS_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def _text_config(config: Any) -> Any:
    """The language model's part of a (possibly multimodal) config."""
    if isinstance(config, Mapping):
        text = config.get("text_config")
        return text if isinstance(text, Mapping) else config
    return getattr(config, "get_text_config", lambda: config)()


def _field(config: Any, names: tuple[str, ...]) -> Any:
    config = _text_config(config)
    for name in names:
        value = config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)
        if value:
            return value
    return None


def _largest(value: Any) -> int | None:
    if isinstance(value, (list, tuple)):  # a per-layer value: the largest layer sizes what a token can need
        value = max((int(v) for v in value if v), default=None)
    return int(value) if value else None


def routed_top_k(config: Any) -> int:
    """Routed experts one token uses in one MoE layer (1 when the config does not say), for a dict or a
    transformers PretrainedConfig of any family; a per-layer list gives its largest entry."""
    return _largest(_field(config, TOP_K_FIELDS)) or 1


def routed_experts(config: Any) -> int | None:
    """Routed experts per MoE layer under the family's name, or None when the config does not say."""
    return _largest(_field(config, EXPERTS_FIELDS))


@dataclass(frozen=True)
class StoreSizes:
    resident_bytes: int
    expert_bytes: int  # payload of all expert records
    experts: int  # number of (layer, expert) records
    moe_layers: int
    experts_per_layer: int
    top_k: int
    record_bytes: int  # largest record, as stored (4 KiB-aligned)

    @staticmethod
    def of(manifest: Manifest) -> "StoreSizes":
        config = manifest.model_config
        return StoreSizes(
            resident_bytes=manifest.resident_bytes,
            expert_bytes=manifest.expert_bytes,
            experts=sum(layer.num_experts for layer in manifest.layers),
            moe_layers=len(manifest.layers),
            experts_per_layer=max(layer.num_experts for layer in manifest.layers),
            top_k=routed_top_k(config),
            record_bytes=manifest.max_record_stride,
        )

    @property
    def experts_per_token(self) -> int:
        return self.top_k * self.moe_layers

    @property
    def worst_case_bytes_per_token(self) -> int:
        """Every routed expert of every layer missing the cache."""
        return self.experts_per_token * self.record_bytes

    @property
    def minimum_budget(self) -> int:
        return self.top_k * self.record_bytes

    def cache_slots(self, budget: int) -> int:
        return budget // self.record_bytes

    def cached_fraction(self, budget: int) -> float:
        return min(1.0, self.cache_slots(budget) / self.experts)
