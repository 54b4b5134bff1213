"""The experts' kernel plan: how each MoE layer's experts compute on this machine, decided once at load.

For each layer one `ExpertsPlan`: the record's format, whether its matmuls take int8 activations, what a
record needs where it lands (the supply runs it on the I/O thread), and the fused one-token kernel per
activation dtype. The engine calls the plan (`linear`, `one_token_kernel`) instead of deciding, and
fastpaths.py reports what the plans hold. The format's matmul itself is kernels.py's registry, and the
C++ has its one dispatch (native/matmuls.h, `project`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import fused, kernels


@dataclass
class ExpertsPlan:
    layer: object  # the store's LayerSpec: the record's layout and format
    int8_activations: bool  # the matmuls take int8 activations and read the records as stored
    preparer: object | None  # what turns a record, as read, into its kernels' layout (None: used as stored)
    one_token: dict = field(default_factory=dict)  # activation dtype -> the fused kernel's arguments, or None

    @property
    def fmt(self):
        return self.layer.quantization

    def linear(self, x: torch.Tensor, record: dict, name: str, transposed: bool) -> torch.Tensor:
        """x [M, K] -> [M, N] with the record's matrix `name` (kernels.expert_linear, as this plan says)."""
        return kernels.expert_linear(x, record, name, self.fmt, transposed, self.int8_activations)

    def one_token_kernel(self, module, x: torch.Tensor, tiered: bool) -> tuple | None:
        """The fused one-token experts kernel for this layer and x's dtype (fused.one_token_experts decides,
        once per dtype; load resolves the model's compute dtype), or None."""
        if x.dtype not in self.one_token:
            self.one_token[x.dtype] = fused.one_token_experts(module, self.layer, x, tiered, self.int8_activations)
        return self.one_token[x.dtype]


def experts_plans(layers, cpu_kernels: bool, int8_activations: bool) -> list[ExpertsPlan]:
    """Per MoE layer of a store: int8 activations where asked for, on the CPU's kernels, and every matrix
    fits them (kernels.takes_int8_activations); and the record preparer that goes with that choice
    (kernels.record_preparer)."""
    plans = []
    for layer in layers:
        integer = int8_activations and cpu_kernels and kernels.takes_int8_activations(layer)
        plans.append(ExpertsPlan(layer, integer, kernels.record_preparer(layer.quantization, layer.layout, cpu_kernels, integer)))
    return plans
