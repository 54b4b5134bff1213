"""Serve a loaded model's experts from disk through the cache: the streaming experts function.

One decode step, as a reader follows it:
1. the input embedding's pre-hook calls `ExpertEngine.start_step`: the step hooks hear that a forward
   pass begins, and the supply (supply/expert_supply.py) tells the cache policy the token ids and reads hash-routed
   layers' experts ahead (their ids alone determine them);
2. transformers runs embeddings, attention, norms and the router (upstream code, unchanged);
3. the router's top-k goes to the experts module, whose forward is `streaming_experts_forward` below
   (registered in transformers' ExpertsInterface as "moestream", and set as each module's own forward
   at load, which skips the interface's lookup per call);
4. `ExpertEngine.run` groups the tokens by expert and asks the supply for the experts
   (`ExpertSupply.provide`: the cache's hits at once, each miss as its read lands), computing each batch
   it is handed (`_LayerCall.compute`) with the kernels of kernels.py and fused.py;
5. per-(token, k) outputs are summed in a fixed order, so the numbers never depend on what was cached.
"""

from __future__ import annotations

import threading
from dataclasses import asdict

import torch
from tqdm.auto import tqdm
from transformers.integrations.moe import ExpertsInterface

from ..conversion.store import DTYPES, Store
from ..errors import UsageError
from .compute.plan import ExpertsPlan
from .memory import peak_rss_bytes
from .supply.expert_supply import ExpertSupply

IMPLEMENTATION = "moestream"
# A prompt at least this long shows a progress bar over the MoE layers (on a terminal): its reads can
# take seconds per layer when little of it is cached.
PREFILL_PROGRESS_TOKENS = 256
# One token's experts share one gate only when their first matmul's width is a multiple of this. torch's
# elementwise CPU kernels run whole blocks of up to 64 elements (two AVX-512 vectors of bf16) through the
# vector function and the tail of a row through the scalar one, whose exp can differ in the last bit; rows
# stacked into one tensor move the tails, unless no row has one. (A gate of width I over 2I: I a multiple
# of 64.) Real experts' widths are (768, 1408, 2048, 2880); tiny test models' are not.
SHARED_GATE_WIDTH = 128


class ExpertEngine:
    """The experts function of a loaded model: each experts call's tokens grouped by expert, the experts
    asked of the supply (supply/expert_supply.py: cache, reads, tiers) and computed over their slots as they arrive.

    Collaborators are given at construction: the supply (built by loading.py with the kernels' record
    layouts) and the prefetcher (a step hook here; the supply reads ahead with it). `trace` is the routing
    observer (runtime.py's `observe_routing` sets it). Every method runs on the thread that runs the model, except `stats`, which any
    thread may call: it reads the supply's counters without waiting for a read in flight."""

    def __init__(self, store: Store, supply: ExpertSupply, plans: list[ExpertsPlan], prefetcher=None):
        """supply: the store's experts under the budget (supply/expert_supply.py), built with the plans'
        preparers. plans: per layer, how its experts compute (compute/plan.py: int8 activations or not, the
        fused one-token kernel). prefetcher: the prefetch.Prefetcher the supply reads ahead with, told here
        when a forward pass starts, or None."""
        self.store = store
        self.layers = store.manifest.layers
        self.plans = plans
        self.supply = supply
        self.lock = threading.Lock()  # one experts call at a time
        # Each layer's record tensors' dtypes by name (float records compute in their own dtype).
        self.record_dtypes = [{t.name: DTYPES[t.dtype] for t in layer.layout.tensors} for layer in self.layers]
        self.trace = None  # the routing observer (a tools.trace.TraceRecorder while routing is recorded)
        # Told when a forward pass starts (`start_step(tokens)`) and when an experts call ends
        # (`end_layer(layer)`): the prefill progress bar, the prefetcher's clock.
        self.step_hooks: list = [PrefillProgress(len(self.layers))] + ([prefetcher] if prefetcher is not None else [])
        self.fast_paths: list = []  # fastpaths.survey's findings, made by load()

    # -- one forward pass -------------------------------------------------------------------------------

    def embedding_pre_hook(self, module, args) -> None:
        """The input embedding's forward pre-hook: its input is the forward pass's token ids."""
        if args and isinstance(args[0], torch.Tensor):
            self.start_step(args[0])

    def start_step(self, input_ids: torch.Tensor) -> None:
        """A forward pass begins (the input embedding's pre-hook): tell the hooks and the supply."""
        with self.lock:
            for hook in self.step_hooks:
                hook.start_step(input_ids.numel())
            token_ids = input_ids.reshape(-1).tolist()
            if self.trace is not None:
                self.trace.start_step(token_ids)
            self.supply.start_step(token_ids, input_ids)

    def run(
        self, module, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """One experts call: `hidden` [T, H], the router's `top_k_index` and `top_k_weights` [T, k] -> [T, H]."""
        with self.lock:
            if self.trace is not None:
                self.trace.record(layer, top_k_index, top_k_weights)
            tokens, k = top_k_index.shape
            single = tokens == 1  # decode: no sort, no tensors of positions; expert -> its choice j
            if single:
                rows = dict(sorted(zip(top_k_index.reshape(-1).tolist(), range(k))))
                single = len(rows) == k  # an expert chosen twice (no router does) takes the general path
            if not single:
                flat = top_k_index.reshape(-1)
                order = torch.argsort(flat, stable=True)
                ids, counts = torch.unique_consecutive(flat[order], return_counts=True)
                rows, start = {}, 0
                for e, c in zip(ids.tolist(), counts.tolist()):
                    rows[e] = order[start : start + c]  # positions t*k + j routed to expert e
                    start += c
            call = _LayerCall(self, module, layer, hidden, rows, top_k_weights, tokens, k, single)
            try:
                self.supply.provide(layer, list(rows), hidden, call.compute)
            finally:
                for hook in self.step_hooks:
                    hook.end_layer(layer)
            return call.result()

    def one_token_kernel(self, module, layer: int, x: torch.Tensor) -> tuple | None:
        """The fused one-token experts kernel for this layer and activation dtype (its plan's), or None."""
        return self.plans[layer].one_token_kernel(module, x)

    # -- reporting --------------------------------------------------------------------------------------

    def stats(self) -> dict:
        """The supply's statistics with the fast paths and the process's peak RSS; waits for no read."""
        return {**self.supply.snapshot(), "fast_paths": [asdict(p) for p in self.fast_paths], "peak_rss_bytes": peak_rss_bytes()}

    def reset_stats(self) -> None:
        self.supply.reset_stats()

    def close(self) -> None:
        self.supply.close()


class _LayerCall:
    """The compute of one experts call: the experts the supply hands over, run on the tokens routed to
    them (`compute`), and the call's output (`result`).

    Each (token t, choice j) output lands in its own row, so the sum over j runs in the same order
    whichever experts were cached and whenever their reads landed. One token (decode): the experts'
    outputs are kept as they are and weighted and summed at the end, in three ops. Several: each expert
    writes its weighted output into rows t*k + j of `out` [T*k, H]."""

    __slots__ = (
        "engine", "module", "layer", "hidden", "rows", "weights", "k", "single", "x", "fmt", "plan", "first", "ys",
        "out", "fused", "total",
    )  # fmt: skip

    def __init__(self, engine: ExpertEngine, module, layer: int, hidden, rows, top_k_weights, tokens: int, k: int, single: bool):
        self.engine, self.module, self.layer, self.hidden, self.rows, self.k = engine, module, layer, hidden, rows, k
        self.single = single
        self.plan = engine.plans[layer]  # how this layer's experts compute (compute/plan.py)
        self.fmt = self.plan.fmt
        self.first = "gate_up_proj" if module.has_gate else "up_proj"
        # Float records compute in their own dtype, quantized ones in the model's activation dtype: cast once
        # per call, not per expert.
        dtype = hidden.dtype if self.fmt else engine.record_dtypes[layer][self.first]
        self.x = hidden if hidden.dtype == dtype else hidden.to(dtype)
        if single and not self.x.is_contiguous():  # the general path's gather copies; the kernels need rows
            self.x = self.x.contiguous()
        # The fused kernels compute in the hidden states' dtype (quantized records), as `result` sums: one token
        # (`experts_decode`), or many (`experts_prefill`, each expert on its rows, with the general path's ops).
        if self.x.dtype != hidden.dtype:
            self.fused = None
        elif single:
            self.fused = engine.one_token_kernel(module, layer, self.x)
        else:
            self.fused = engine.plans[layer].prefill_kernel(module, self.x)
        self.total = None  # the result itself, when the fused kernel computed every choice at once
        if self.single:
            self.weights = top_k_weights.reshape(k, 1)
            self.ys = [None] * k
        else:
            self.weights = top_k_weights.reshape(-1)
            self.out = hidden.new_empty(tokens * k, hidden.shape[-1])  # every row is written once

    def compute(self, experts: list[tuple[int, dict[str, torch.Tensor]]]) -> None:
        """Experts (id, record tensors), ready, on the tokens routed to them, with the module's own
        gate/activation semantics. With one token, quantized experts run through the fused kernel where it
        applies (`ExpertEngine.one_token_kernel`), one call for all of them; otherwise experts computed
        together share one gate over their stacked rows where that gives the same bits
        (`SHARED_GATE_WIDTH`): the gate is row-wise, and at decode the small ops between the matmuls cost as
        much as the matmuls (docs/DECISIONS.md, "One gate for a token's cached experts")."""
        if self.single and self.fused is not None:
            kernel, (q1, p1, q2, p2), bits, group, first_kernel, second_kernel, table = self.fused
            experts = sorted(experts, key=lambda item: self.rows[item[0]])  # in k order
            whole = len(experts) == self.k  # every choice at once: the kernel also sums them, as `result` would
            out = kernel(self.x, [w[q1] for _, w in experts], [w[p1] for _, w in experts],
                         [w[q2] for _, w in experts], [w[p2] for _, w in experts], bits, group, first_kernel, second_kernel,
                         self.weights if whole else None, table)  # fmt: skip
            if whole:
                self.total = out
            else:
                for j, (expert, _) in enumerate(experts):
                    self.ys[self.rows[expert]] = out[j : j + 1]
            return
        if self.single:
            hs = [_first_matmul(self, self.x, w) for _, w in experts]
            if len(hs) > 1 and hs[0].shape[-1] % SHARED_GATE_WIDTH == 0:
                stacked = _gate(self.module, torch.cat(hs))
                hs = [stacked[j : j + 1] for j in range(len(hs))]
            else:
                hs = [_gate(self.module, h) for h in hs]
            for (expert, w), h in zip(experts, hs):
                # weighted and summed in k order once every expert is done (`result`)
                self.ys[self.rows[expert]] = _second_matmul(self, h, w)
            return
        if self.fused is not None:  # the loop below in C++, the experts spread over the threads
            kernel, (q1, p1, q2, p2), bits, group, first_kernel, second_kernel, table = self.fused
            kernel(self.x, [self.rows[e] for e, _ in experts], [w[q1] for _, w in experts], [w[p1] for _, w in experts],
                   [w[q2] for _, w in experts], [w[p2] for _, w in experts], bits, group, first_kernel, second_kernel,
                   self.weights, self.out, self.k, table)  # fmt: skip
            return
        for expert, w in experts:
            pos = self.rows[expert]
            y = _second_matmul(self, _gate(self.module, _first_matmul(self, self.x[pos // self.k], w)), w)
            self.out[pos] = (y * self.weights[pos, None]).to(self.out.dtype)

    def result(self) -> torch.Tensor:
        """[T, H]: the weighted outputs summed over k, in k order."""
        if self.total is not None:
            return self.total
        dtype = self.hidden.dtype
        if self.single:
            out = torch.cat(self.ys)  # [k, H]; cat upcasts (exactly) to a common dtype
            # In place where the result keeps out's dtype: computed in the promoted dtype (float32 router
            # weights) and rounded once, as (out * weights).to(dtype) is, with one op and buffer less.
            out = out.mul_(self.weights) if out.dtype == dtype else (out * self.weights).to(dtype)
            return out.view(1, self.k, -1).sum(dim=1)
        return self.out.view(-1, self.k, self.out.shape[-1]).sum(dim=1).to(dtype)


class PrefillProgress:
    """A progress bar over the MoE layers for a long prompt (on a terminal only): its reads can take
    seconds per layer when little of it is cached."""

    def __init__(self, layers: int):
        self.layers = layers
        self.bar = None

    def start_step(self, tokens: int) -> None:
        if tokens >= PREFILL_PROGRESS_TOKENS:
            self.bar = tqdm(total=self.layers, desc=f"prefill {tokens} tokens", unit="layer", disable=None, leave=False)

    def end_layer(self, layer: int) -> None:
        if self.bar is not None:
            self.bar.update(1)
            if layer == self.layers - 1:
                self.bar.close()
                self.bar = None


def _first_matmul(call: _LayerCall, x: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
    h = call.plan.linear(x, w, call.first, call.module.is_transposed)
    return h + w[call.first + "_bias"] if call.module.has_bias else h


def _gate(module, h: torch.Tensor) -> torch.Tensor:
    return module._apply_gate(h) if module.has_gate else module.act_fn(h)


def _second_matmul(call: _LayerCall, h: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
    module = call.module
    y = call.plan.linear(h, w, "down_proj", module.is_transposed)
    if module.has_bias:
        y = y + w["down_proj_bias"]
    return module.post_expert_norm(y) if module.has_post_expert_norm else y


def engine_of(model) -> ExpertEngine:
    """The engine of a model that moestream.load() returned (generation and tools use runtime.py's Runtime)."""
    engine = getattr(model, "_moestream_engine", None)
    if engine is None:
        raise UsageError("this model was not loaded with moestream.load()")
    return engine


def streaming_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """The ExpertsInterface entry point: transformers calls this instead of its own experts math."""
    return self._moestream_engine.run(self, self._moestream_layer, hidden_states, top_k_index, top_k_weights)


def register() -> None:
    """Make "moestream" an experts implementation transformers can dispatch to (idempotent)."""
    ExpertsInterface.register(IMPLEMENTATION, streaming_experts_forward)
