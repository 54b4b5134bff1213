"""Speculative prefetch: guess the next MoE layer's experts and start reading them early.

After layer L routes, the residual stream entering layer L+1 differs from layer L's by one attention
and one MoE update, so layer L+1's router applied to layer L's hidden state is a decent guess of the
experts L+1 will pick. Reading those while layer L computes hides disk latency, if the guess is good;
a wrong guess costs bandwidth, CPU and an eviction. Published results disagree on whether it pays
(+21% on one 750B model, -18% on another), and so do our own workloads: a guess can be 70% right and
still make decoding slower when the model is compute-bound. So the engine keeps the books per layer
(prediction precision and recall; speculative reads used or wasted) and, with `--prefetch auto`,
decides from the only signal that settles it, the time of a decode step:

    warm up: the first `AUTO_WARMUP_STEPS` decode steps run without speculation and untimed: right after
             a prompt the cache is still settling, and a probe there misjudged steady decoding
    probe:   decode steps in blocks, on / off / on / off, each step timed (`AUTO_PROBE_BLOCK`)
    hold:    speculation on only if its median step was at least `AUTO_MARGIN` faster (it costs bytes
             and evictions, so a tie goes to off), for `AUTO_HOLD_STEPS` decode steps
    repeat:  probe again, since the cache, the prompt and the machine's load all drift

Hash-routed layers (DeepSeek-V4's first MoE layers pick experts by a frozen token-id table, `tid2eid`)
need no guess: their experts follow from the input ids before any layer runs, so `exact` lists them at
the start of a decode step and the engine reads them at once, with demand priority. Exact reads are
made whenever prefetch is not off, whatever auto decides for the guesses.

This module decides *what* to prefetch, keeps the books and runs auto's clock; the engine (runtime.py)
owns the cache and the reads, and follows the rules "demand first": speculation only runs once every
demand read of the step is issued, only on decode steps (a prompt's demand reads already fill the disk
queue), into slots the policy would evict anyway, never a pinned or loading one, on a separate
low-priority reader queue.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...choices import PREFETCH_MODES
from ...errors import UsageError

MAX_SPECULATIVE_TOKENS = 4  # speculate on decode steps only (and tiny batches)
AUTO_WARMUP_STEPS = 16  # decode steps before auto's first probe (speculation off)
AUTO_PROBE_BLOCK = 8  # decode steps per block of a probe; the first of each block is not timed (transition)
AUTO_PROBE_BLOCKS = ("on", "off", "on", "off")  # interleaved, so that a drifting step time favours neither
AUTO_MARGIN = 0.03  # speculation must make the median decode step this much faster to be kept on
AUTO_HOLD_STEPS = 256  # decode steps auto keeps its choice before probing again


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


class AutoSwitch:
    """`--prefetch auto`: time decode steps with speculation on and off, keep the faster, probe again.

    `step(tokens)` is called at the start of every forward pass; a step's time is the interval to the
    next call, counted only when both calls are decode steps (so prompts and idle time between requests
    are never timed).
    """

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.speculating = False
        self.decisions = 0  # probes completed
        self.last_probe_ms: dict[str, float] = {}  # median decode step per mode in the latest probe
        self._schedule: list[str] = []  # modes of the coming decode steps while probing
        self._samples: dict[str, list[float]] = {"on": [], "off": []}
        self._timed_mode: str | None = None  # mode of the step now running, if it is to be timed
        self._started = 0.0  # when the step now running began
        self._hold = AUTO_WARMUP_STEPS  # decode steps left before the next probe

    def _start_probe(self) -> None:
        self._schedule = [mode for mode in AUTO_PROBE_BLOCKS for _ in range(AUTO_PROBE_BLOCK)]
        self._samples = {"on": [], "off": []}

    def step(self, tokens: int) -> None:
        now = self.clock()
        decode = tokens <= MAX_SPECULATIVE_TOKENS
        if self._timed_mode is not None and decode:
            self._samples[self._timed_mode].append(now - self._started)
        self._timed_mode, self._started = None, now
        if not decode:
            return
        if self._schedule:
            mode = self._schedule.pop(0)
            first_of_block = len(self._schedule) % AUTO_PROBE_BLOCK == AUTO_PROBE_BLOCK - 1
            self.speculating = mode == "on"
            self._timed_mode = None if first_of_block else mode
            return
        if self._samples["on"] or self._samples["off"]:
            self._decide()
        self._hold -= 1
        if self._hold <= 0:
            self._start_probe()

    def _decide(self) -> None:
        # The last probe step's time arrives with the step after it, which therefore runs in the hold.
        medians = {mode: statistics.median(s) for mode, s in self._samples.items() if s}
        if len(medians) == 2:
            self.speculating = medians["on"] < (1 - AUTO_MARGIN) * medians["off"]
            self.last_probe_ms = {mode: 1e3 * m for mode, m in medians.items()}
            self.decisions += 1
        self._samples = {"on": [], "off": []}
        self._hold = AUTO_HOLD_STEPS


class Prefetcher:
    def __init__(self, routers: list, top_k: int, mode: str = "auto", clock=time.perf_counter):
        if mode not in PREFETCH_MODES:
            raise UsageError(f"--prefetch must be one of {', '.join(PREFETCH_MODES)}, not {mode!r}")
        self.routers = routers  # per MoE layer; None where no router was found
        # Per MoE layer, the router if it routes by a token-id -> expert-ids table (DeepSeek-V4's `tid2eid`).
        # The module, not the table: loading weights with assign=True replaces the buffer after this runs.
        self.hash_routers = [r if isinstance(getattr(r, "tid2eid", None), torch.Tensor) else None for r in routers]
        self.top_k = top_k
        self.mode = mode
        self.auto = AutoSwitch(clock) if mode == "auto" else None
        self.stats = [PrefetchStats() for _ in routers]
        self._pending: dict[int, set[int]] = {}  # layer -> experts predicted for its coming step

    def speculating(self) -> bool:
        return self.mode == "on" or (self.auto is not None and self.auto.speculating)

    def start_step(self, tokens: int) -> None:
        """A forward pass of `tokens` tokens begins (an engine step hook)."""
        if self.auto is not None:
            self.auto.step(tokens)

    def end_layer(self, layer: int) -> None:
        """Nothing per layer: the clock times whole forward passes."""

    def exact(self, input_ids: torch.Tensor) -> dict[int, list[int]]:
        """For a decode step's input ids: each hash-routed layer's experts, known before the layers run."""
        if self.mode == "off" or input_ids.numel() > MAX_SPECULATIVE_TOKENS:
            return {}
        known = {}
        for layer, router in enumerate(self.hash_routers):
            if router is not None:
                experts = sorted(set(router.tid2eid[input_ids.reshape(-1)].reshape(-1).tolist()))
                self._pending[layer] = set(experts)
                known[layer] = experts
        return known

    def predict(self, layer: int, hidden: torch.Tensor) -> list[int]:
        """Experts layer `layer + 1` will likely need, from layer `layer`'s hidden states; [] if none.
        Called once per experts call: the checks come first, since most calls do not speculate."""
        target = layer + 1
        if hidden.shape[0] > MAX_SPECULATIVE_TOKENS or not self.speculating() or target >= len(self.routers):
            return []
        router = self.routers[target]
        if router is None or self.hash_routers[target] is not None:  # a hash layer's experts are read exactly
            return []
        with torch.no_grad():
            logits = F.linear(hidden.to(router.weight.dtype), router.weight).float()
            bias = getattr(router, "e_score_correction_bias", None)  # DeepSeek-style selection bias
            if isinstance(bias, torch.Tensor):
                logits = logits.sigmoid() + bias.float()
            chosen = torch.topk(logits, min(self.top_k, logits.shape[-1]), dim=-1).indices
        experts = sorted(set(chosen.reshape(-1).tolist()))
        self._pending[target] = set(experts)
        return experts

    def observe(self, layer: int, routed: list[int]) -> None:
        """The layer's actual routing: scores the prediction made for it, if any."""
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
        s = self.stats[layer]
        s.useful += used
        s.wasted += not used

    def report(self) -> dict:
        total = PrefetchStats()
        for s in self.stats:
            for name in total.__dataclass_fields__:
                setattr(total, name, getattr(total, name) + getattr(s, name))
        return {
            "mode": self.mode,
            "speculating": self.speculating(),
            "auto_probes": self.auto.decisions if self.auto else 0,
            "auto_last_probe_ms": dict(self.auto.last_probe_ms) if self.auto else {},
            "precision": total.precision,
            "recall": total.recall,
            "issued": total.issued,
            "useful": total.useful,
            "wasted": total.wasted,
            "per_layer": [
                {"precision": s.precision, "recall": s.recall, "issued": s.issued, "useful": s.useful, "wasted": s.wasted}
                for s in self.stats
            ],
        }
