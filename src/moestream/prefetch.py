"""Speculative prefetch: guess the next MoE layer's experts and start reading them early.

After layer L routes, the residual stream entering layer L+1 differs from layer L's by one attention
and one MoE update, so layer L+1's router applied to layer L's hidden state is a decent guess of the
experts L+1 will pick. Reading those while layer L computes hides disk latency, if the guess is good;
a wrong guess costs bandwidth and evicts something. Published results disagree on whether it pays
(+21% on one 750B model, -18% on another), so the engine measures, per layer:

- prediction precision and recall (predicted vs actually routed experts), and
- how many speculative reads were used before being evicted ("useful"),

and with `--prefetch auto` switches speculation off for a layer whose reads are mostly wasted, probing
again now and then. This module decides *what* to prefetch and keeps the books; the engine
(runtime.py) owns the cache and the reads, and follows the rules "demand first": speculation only runs
once every demand read of the step is issued, only on decode steps (a prompt's demand reads already
fill the disk queue), into slots the policy would evict anyway, never a pinned or loading one, on a
separate low-priority reader queue.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .errors import UsageError

PREFETCH_MODES = ("auto", "on", "off")
MAX_SPECULATIVE_TOKENS = 4  # speculate on decode steps only (and tiny batches)
AUTO_MIN_ISSUED = 16  # speculative reads of a layer before auto judges it
AUTO_MIN_USEFUL = 0.5  # auto keeps a layer on while at least this share of its speculative reads is used
AUTO_PROBE_EVERY = 256  # a layer switched off is tried again after this many of its steps


@dataclass
class PrefetchStats:
    predictions: int = 0
    predicted: int = 0  # experts predicted, summed over predictions
    routed: int = 0  # experts actually routed in the predicted steps
    correct: int = 0  # predicted and routed
    issued: int = 0  # speculative reads started
    useful: int = 0  # of those, used by the layer before eviction
    wasted: int = 0  # evicted or failed before use

    @property
    def precision(self) -> float:
        return self.correct / self.predicted if self.predicted else 0.0

    @property
    def recall(self) -> float:
        return self.correct / self.routed if self.routed else 0.0


def find_router(experts_module_parent) -> torch.nn.Module | None:
    """The router of an MoE block: the child whose class is a transformers *Router with a weight."""
    for child in experts_module_parent.children():
        if "Router" in type(child).__name__ and isinstance(getattr(child, "weight", None), torch.Tensor):
            return child
    return None


class Prefetcher:
    def __init__(self, routers: list, top_k: int, mode: str = "auto"):
        if mode not in PREFETCH_MODES:
            raise UsageError(f"--prefetch must be one of {', '.join(PREFETCH_MODES)}, not {mode!r}")
        self.routers = routers  # per MoE layer; None where no router was found (e.g. hash routing)
        self.top_k = top_k
        self.mode = mode
        self.stats = [PrefetchStats() for _ in routers]
        self._pending: dict[int, set[int]] = {}  # layer -> experts predicted for its coming step
        self._off_until = [0] * len(routers)  # auto: the layer's step count at which to probe again
        self._steps = [0] * len(routers)
        self._window = [[0, 0] for _ in routers]  # auto: (useful, judged) since the layer was last judged

    def enabled(self, layer: int) -> bool:
        if self.mode == "off" or layer >= len(self.routers) or self.routers[layer] is None:
            return False
        return self.mode == "on" or self._steps[layer] >= self._off_until[layer]

    @torch.no_grad()
    def predict(self, layer: int, hidden: torch.Tensor) -> list[int]:
        """Experts layer `layer + 1` will likely need, from layer `layer`'s hidden states; [] if none."""
        target = layer + 1
        if hidden.shape[0] > MAX_SPECULATIVE_TOKENS or not self.enabled(target):
            return []
        router = self.routers[target]
        logits = F.linear(hidden.to(router.weight.dtype), router.weight).float()
        bias = getattr(router, "e_score_correction_bias", None)  # DeepSeek-style selection bias
        if isinstance(bias, torch.Tensor):
            logits = logits.sigmoid() + bias.float()
        experts = sorted(set(torch.topk(logits, min(self.top_k, logits.shape[-1]), dim=-1).indices.reshape(-1).tolist()))
        self._pending[target] = set(experts)
        return experts

    def observe(self, layer: int, routed: list[int]) -> None:
        """The layer's actual routing: scores the prediction made for it, if any."""
        self._steps[layer] += 1
        predicted = self._pending.pop(layer, None)
        if predicted is None:
            return
        s = self.stats[layer]
        s.predictions += 1
        s.predicted += len(predicted)
        s.routed += len(routed)
        s.correct += len(predicted.intersection(routed))

    def record_use(self, layer: int, used: bool) -> None:
        """A speculative read of `layer` was used (True) or evicted/failed unused (False)."""
        s, window = self.stats[layer], self._window[layer]
        s.useful += used
        s.wasted += not used
        window[0] += used
        window[1] += 1
        if self.mode == "auto" and window[1] >= AUTO_MIN_ISSUED:
            if window[0] / window[1] < AUTO_MIN_USEFUL:
                self._off_until[layer] = self._steps[layer] + AUTO_PROBE_EVERY
            window[0] = window[1] = 0  # the next judgment (or the probe) rests on fresh evidence

    def report(self) -> dict:
        total = PrefetchStats()
        for s in self.stats:
            for name in total.__dataclass_fields__:
                setattr(total, name, getattr(total, name) + getattr(s, name))
        return {
            "mode": self.mode,
            "precision": total.precision,
            "recall": total.recall,
            "issued": total.issued,
            "useful": total.useful,
            "wasted": total.wasted,
            "layers_off": sum(1 for i in range(len(self.routers)) if not self.enabled(i)),
            "per_layer": [
                {"precision": s.precision, "recall": s.recall, "issued": s.issued, "useful": s.useful, "wasted": s.wasted}
                for s in self.stats
            ],
        }
