"""Byte arithmetic of a store: what stays resident, what streams, what a token can cost, what a budget buys."""

from __future__ import annotations

from dataclasses import dataclass

from .store import Manifest


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
            top_k=int(config.get("num_experts_per_tok") or 1),
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
