"""Cache-aware routing (`load(route_to_cached=m)`, `--route-to-cached M`; off by default): in a decode
step, an expert the router chose that is not cached gives way to a cached one it did not choose whose
router probability is within the margin: at least (1 - m) times the chosen one's.

Why: under a small budget most of a decode step's time is reads, and routers often rank several experts
almost equally; taking a cached near-equal instead saves a read. It changes the model's output, so it is
opt-in and priced with `moestream eval --decode --route-to-cached M` (perplexity, KL and top-1
agreement against the checkpoint, beside the hit rate; docs/DECISIONS.md, "Cache-aware routing off by default").

Only softmax top-k routers (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE): the new choice's weights are computed
as such a router computes them (the probabilities of the chosen experts, divided by their sum where the
router normalizes). Which of those a router does is found by behaviour on random inputs, as
core/compute/fused.py finds it; a router of another formula (DeepSeek's sigmoid groups, gpt-oss) is refused.
Prompts and batched decode steps (calls of several tokens, `serve` with several streams) are left alone:
the rule is for one token's choices, and a batch's rows would share reads, which it does not weigh.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UsageError
from .compute import fused


def softmax_topk(x: torch.Tensor, weight: torch.Tensor, k: int, normalize: bool, cast: bool):
    """A softmax top-k router's forward in torch ops -> (logits, weights, indices); what `fused`'s router
    kernel computes in C++ (`fused.router_variant` checks a router against either)."""
    logits = F.linear(x.reshape(-1, weight.shape[1]), weight)
    values, indices = torch.topk(F.softmax(logits, dim=-1, dtype=torch.float32), k, dim=-1)
    if normalize:
        values /= values.sum(dim=-1, keepdim=True)
    return logits, values.to(logits.dtype) if cast else values, indices


def reroute(probabilities: list[float], chosen: list[int], cached, margin: float) -> list[int]:
    """The experts to use instead of `chosen`: each chosen expert that is not `cached` (a predicate on
    expert ids), least probable first, gives way to the most probable cached expert not yet used whose
    probability is at least (1 - margin) times its own; the others stay."""
    used = set(chosen)
    candidates = sorted((e for e, p in enumerate(probabilities) if e not in used and cached(e)), key=lambda e: -probabilities[e])
    result = list(chosen)
    for e in sorted((e for e in chosen if not cached(e)), key=lambda e: probabilities[e]):
        if not candidates or probabilities[candidates[0]] < (1.0 - margin) * probabilities[e]:
            continue
        result[result.index(e)] = candidates.pop(0)
    return result


class CacheAwareRouting:
    """Forward hooks on the routers of a loaded model that reroute its decode steps towards cached experts."""

    def __init__(self, engine, margin: float):
        if not 0.0 < margin < 1.0:
            raise UsageError(f"--route-to-cached takes a margin between 0 and 1 (0.1: within 10%), not {margin}")
        self.engine, self.margin = engine, margin

    def install(self, routers) -> None:
        """One hook per MoE layer's router; a UsageError if a router is not a softmax top-k router."""
        for layer, router in enumerate(routers):
            if router is None:
                continue
            variant = fused.router_variant(router, softmax_topk)
            if variant is None:
                raise UsageError(
                    f"--route-to-cached needs softmax top-k routers; this model's {type(router).__name__} computes "
                    "another formula. Run it without --route-to-cached."
                )
            normalize = variant[0]  # (its cast shows in the dtype of the weights it returns)
            router.register_forward_hook(functools.partial(self._hook, layer, normalize))

    def _hook(self, layer: int, normalize: bool, router: nn.Module, args, output):
        logits, weights, indices = output
        if indices.shape[0] != 1:
            return None
        probabilities = F.softmax(logits[0], dim=-1, dtype=torch.float32)
        p, chosen = probabilities.tolist(), indices[0].tolist()
        cache = self.engine.supply.cache
        experts = reroute(p, chosen, lambda e: (layer, e) in cache, self.margin)
        if experts == chosen:
            return None
        self.engine.supply.count_rerouted(layer, sum(a != b for a, b in zip(experts, chosen)))
        experts.sort(key=lambda e: -p[e])  # as top-k orders them
        index = torch.tensor([experts], dtype=indices.dtype, device=indices.device)
        values = probabilities[index[0]][None]
        if normalize:
            values /= values.sum(dim=-1, keepdim=True)
        return logits, values.to(weights.dtype), index  # the dtype the router gives (cast or float32)
