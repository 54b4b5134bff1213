"""Routing traces: which experts each token chose in each MoE layer, recorded once, replayed offline.

A trace is what the experts function saw: one entry per experts call (a prefill call carries all its
tokens, a decode call one), in call order, with the chosen expert ids and weights of every token. Call
boundaries are kept because they decide what the cache can evict: every expert of a call is pinned while
the call runs (simulate.py replays calls exactly as the runtime executes them).

File format (`.npz`, written by numpy, no pickles):
    experts      int32 [rows, top_k]   chosen expert ids, one row per token of each call
    weights      float32 [rows, top_k] their routing weights as the experts function received them
    call_layer   int32 [calls]         experts-layer index (0 .. layers-1, the store's layer table order)
    call_rows    int32 [calls]         tokens in the call (rows of `experts` it owns, in order)
    record_bytes int64 [layers]        bytes read per expert of each layer (the store's record stride)
    layer_experts int32 [layers]       experts per layer
    meta         str                   JSON: format, store_id, model_type, top_k, tokens, source text, ...
  since format version 2 (version 1 files still load, without them):
    step_tokens  int32 [step tokens]   the input token ids of every forward pass, in order
    step_rows    int32 [steps]         token ids per forward pass (rows of `step_tokens` it owns)
    call_step    int32 [calls]         the forward pass each experts call belongs to
The policy hears a step's token ids before its first call (policies.py `on_step`), in the runtime and in
a replay alike.
"""

from __future__ import annotations

import hashlib
import json
import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np
import torch

from ..conversion.sizes import ModelSizes
from ..errors import UsageError

TRACE_FORMAT = "moestream-trace"
TRACE_VERSION = 2
READABLE_VERSIONS = (1, 2)
STEP_ARRAYS = ("step_tokens", "step_rows", "call_step")


def store_identity(manifest) -> str:
    """A short hash of the store's layer table (modules, record layouts, per-record checksums): two stores
    with the same identity hold the same expert bytes in the same places."""
    table = json.dumps([layer.to_json() for layer in manifest.layers], sort_keys=True).encode()
    return hashlib.sha256(table).hexdigest()[:16]


@dataclass
class Trace:
    experts: np.ndarray
    weights: np.ndarray
    call_layer: np.ndarray
    call_rows: np.ndarray
    record_bytes: np.ndarray
    layer_experts: np.ndarray
    meta: dict = field(default_factory=dict)
    step_tokens: np.ndarray | None = None  # None: a version 1 trace, or routing without token ids
    step_rows: np.ndarray | None = None
    call_step: np.ndarray | None = None

    @property
    def layers(self) -> int:
        return len(self.record_bytes)

    @property
    def top_k(self) -> int:
        return int(self.experts.shape[1])

    @property
    def calls(self) -> int:
        return len(self.call_layer)

    @property
    def tokens(self) -> int:
        """Tokens that went through the model: every forward pass calls the first experts layer once."""
        return int(self.call_rows[self.call_layer == 0].sum())

    @property
    def slot_bytes(self) -> int:
        """The runtime's cache slot: the largest record (every slot must fit any layer's record)."""
        return int(self.record_bytes.max())

    @cached_property
    def step_starts(self) -> dict[int, list[int]]:
        """call index -> the token ids of the step that call begins (empty without token ids)."""
        if self.step_tokens is None:
            return {}
        bounds = np.concatenate([[0], np.cumsum(self.step_rows)]).tolist()
        starts, previous = {}, -1
        for c, step in enumerate(self.call_step.tolist()):
            if step != previous:
                starts[c] = self.step_tokens[bounds[step] : bounds[step + 1]].tolist()
                previous = step
        return starts

    @cached_property
    def call_experts(self) -> list[tuple[int, tuple[int, ...]]]:
        """(layer, distinct experts in ascending id order) per call: the order ExpertEngine.run looks them up."""
        out, start = [], 0
        for layer, rows in zip(self.call_layer.tolist(), self.call_rows.tolist()):
            ids = np.unique(self.experts[start : start + rows])
            out.append((layer, tuple(ids.tolist())))
            start += rows
        return out

    def save(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        if path.suffix != ".npz":
            raise UsageError(f"a trace file ends in .npz (numpy's format): {path}")
        meta = dict(self.meta, format=TRACE_FORMAT, format_version=TRACE_VERSION)
        tmp = path.with_name(path.name + ".partial.npz")
        steps = {} if self.step_tokens is None else {n: getattr(self, n).astype(np.int32) for n in STEP_ARRAYS}
        np.savez_compressed(
            tmp,
            **steps,
            experts=self.experts.astype(np.int32),
            weights=self.weights.astype(np.float32),
            call_layer=self.call_layer.astype(np.int32),
            call_rows=self.call_rows.astype(np.int32),
            record_bytes=self.record_bytes.astype(np.int64),
            layer_experts=self.layer_experts.astype(np.int32),
            meta=np.array(json.dumps(meta)),
        )
        os.replace(tmp, path)
        return path

    @staticmethod
    def of_decode(experts: np.ndarray, layer_experts: int, record_bytes: int = 4096, token_ids=None) -> "Trace":
        """A decode trace from routing alone, [tokens, layers, top_k] expert ids: one call per token and
        layer, equal weights, every record `record_bytes` (what simulate needs of synthetic routing); with
        `token_ids` [tokens], each token is its own step."""
        tokens, layers, k = experts.shape
        steps = {}
        if token_ids is not None:
            steps = dict(
                step_tokens=np.asarray(token_ids, np.int32),
                step_rows=np.ones(tokens, np.int32),
                call_step=np.repeat(np.arange(tokens, dtype=np.int32), layers),
            )
        return Trace(
            **steps,
            experts=experts.reshape(-1, k).astype(np.int32),
            weights=np.full((tokens * layers, k), 1.0 / k, np.float32),
            call_layer=np.tile(np.arange(layers, dtype=np.int32), tokens),
            call_rows=np.ones(tokens * layers, np.int32),
            record_bytes=np.full(layers, record_bytes, np.int64),
            layer_experts=np.full(layers, layer_experts, np.int32),
        )

    @staticmethod
    def load(path: str | os.PathLike) -> "Trace":
        path = Path(path)
        try:
            with np.load(path, allow_pickle=False) as z:
                arrays = {name: z[name] for name in z.files}
        except FileNotFoundError:
            raise UsageError(f"no trace file at {path}; record one with `moestream trace STORE --text FILE -o {path}`") from None
        except (OSError, ValueError) as e:
            raise UsageError(f"{path} is not a moestream trace ({e}); record one with `moestream trace`") from None
        needed = ("experts", "weights", "call_layer", "call_rows", "record_bytes", "layer_experts", "meta")
        missing = [n for n in needed if n not in arrays]
        if missing:
            raise UsageError(
                f"{path} is not a moestream trace (it lacks {', '.join(missing)}); record one with `moestream trace`"
            )
        try:
            meta = json.loads(str(arrays["meta"]))
        except ValueError:
            meta = None
        if not isinstance(meta, dict) or meta.get("format") != TRACE_FORMAT:
            raise UsageError(f"{path} is not a moestream trace; record one with `moestream trace`")
        if meta.get("format_version") not in READABLE_VERSIONS:
            raise UsageError(
                f"{path} is trace format version {meta.get('format_version')}; this moestream reads versions "
                f"{', '.join(map(str, READABLE_VERSIONS))}: record it again with this version"
            )
        steps = {n: arrays[n] for n in STEP_ARRAYS} if all(n in arrays for n in STEP_ARRAYS) else {}
        trace = Trace(**{n: arrays[n] for n in needed if n != "meta"}, meta=meta, **steps)
        trace.check(str(path))
        return trace

    def check(self, where: str) -> None:
        """Shapes and ranges that the simulator relies on; a damaged file is refused, not replayed."""
        ok = (
            self.experts.ndim == 2
            and self.weights.shape == self.experts.shape
            and self.call_layer.shape == self.call_rows.shape
            and int(self.call_rows.sum()) == self.experts.shape[0]
            and (self.call_rows > 0).all()
            and self.record_bytes.ndim == 1
            and self.layer_experts.shape == self.record_bytes.shape
            and (self.record_bytes > 0).all()
            and ((self.call_layer >= 0) & (self.call_layer < self.layers)).all()
        )
        if ok and len(self.experts):
            per_row_limit = self.layer_experts[np.repeat(self.call_layer, self.call_rows)]
            ok = bool(((self.experts >= 0) & (self.experts < per_row_limit[:, None])).all())
        if ok and self.step_tokens is not None:
            ok = (
                self.step_rows.ndim == 1
                and int(self.step_rows.sum()) == len(self.step_tokens)
                and self.call_step.shape == self.call_layer.shape
                and bool((np.diff(self.call_step) >= 0).all())
                and bool(((self.call_step >= 0) & (self.call_step < len(self.step_rows))).all())
            )
        if not ok:
            raise UsageError(f"{where}: the trace's arrays are inconsistent (damaged or edited); record it again")

    def describe(self) -> str:
        m = self.meta
        return (
            f"{m.get('model_type', '?')} store {m.get('store_id', '?')}: {self.tokens} tokens in {self.calls} experts calls, "
            f"{self.layers} MoE layers x {int(self.layer_experts.max())} experts, top-{self.top_k}"
        )


class TraceRecorder:
    """Collects the routing of every experts call, call by call (a runtime's routing observer)."""

    def __init__(self, store):
        manifest = store.manifest
        self.meta = {
            "store_id": store_identity(manifest),
            "store": str(store.directory),
            "model_type": manifest.model_config.get("model_type"),
            "experts_dtype": manifest.experts_dtype,
        }
        sizes = ModelSizes.of_store(manifest)
        self.record_bytes = np.array(sizes.layer_stride_bytes, dtype=np.int64)  # what a replay's reads cost: strides
        self.layer_experts = np.array(sizes.layer_experts, dtype=np.int32)
        self._experts: list[np.ndarray] = []
        self._weights: list[np.ndarray] = []
        self._layers: list[int] = []
        self._step_tokens: list[list[int]] = []
        self._call_step: list[int] = []

    def start_step(self, token_ids: list[int]) -> None:
        self._step_tokens.append(list(token_ids))

    def record(self, layer: int, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> None:
        self._experts.append(top_k_index.detach().to(torch.int32).cpu().numpy().copy())
        self._weights.append(top_k_weights.detach().to(torch.float32).cpu().numpy().copy())
        self._layers.append(layer)
        if not self._step_tokens:  # recording began inside a forward pass: its token ids are not known
            self._step_tokens.append([])
        self._call_step.append(len(self._step_tokens) - 1)

    def trace(self, **meta) -> Trace:
        k = self._experts[0].shape[1] if self._experts else 1
        return Trace(
            experts=np.concatenate(self._experts) if self._experts else np.zeros((0, k), np.int32),
            weights=np.concatenate(self._weights) if self._weights else np.zeros((0, k), np.float32),
            call_layer=np.array(self._layers, dtype=np.int32),
            call_rows=np.array([len(e) for e in self._experts], dtype=np.int32),
            record_bytes=self.record_bytes,
            layer_experts=self.layer_experts,
            meta=dict(self.meta, **meta),
            step_tokens=np.array([t for step in self._step_tokens for t in step], dtype=np.int32),
            step_rows=np.array([len(step) for step in self._step_tokens], dtype=np.int32),
            call_step=np.array(self._call_step, dtype=np.int32),
        )


def start_recording(model) -> TraceRecorder:
    """From now on every experts call of `model` is recorded; `stop_recording`, then `recorder.trace()`."""
    from ..core.runtime import runtime_of

    runtime = runtime_of(model)
    if runtime.observing_routing():
        raise UsageError("this model is already recording a trace")
    recorder = TraceRecorder(runtime.store)
    runtime.observe_routing(recorder)
    return recorder


def stop_recording(model) -> None:
    from ..core.runtime import runtime_of

    runtime_of(model).observe_routing(None)


@contextmanager
def recording(model):
    """`with recording(model) as rec: model.generate(...)`, then `rec.trace()`."""
    recorder = start_recording(model)
    try:
        yield recorder
    finally:
        stop_recording(model)


def record_text(
    store, text: str, *, max_tokens: int = 1024, prefill: int = 0, memory: str | int = "4GiB", io_threads: int = 4
) -> Trace:
    """Route `text` through the model the way generation would see it and return the trace.

    The first `prefill` tokens go in as one call per layer (a prompt); every later token is fed alone with
    the KV cache, as decoding does (teacher forcing: the routing of generating exactly this text;
    serving.teacher_forced).
    """
    from ..core.loading import close, load
    from ..generation.serving import teacher_forced

    if max_tokens < 1 or prefill < 0:
        raise UsageError("--max-tokens must be at least 1 and --prefill at least 0")
    model, tokenizer = load(store, memory, io_threads=io_threads)
    try:
        if tokenizer is None:
            raise UsageError(f"{store} has no tokenizer files; convert from a checkpoint that includes them")
        ids = tokenizer(text)["input_ids"][:max_tokens]
        if not ids:
            raise UsageError("the text has no tokens; pass a non-empty UTF-8 file")
        prefill = min(prefill, len(ids))
        with recording(model) as recorder:
            teacher_forced(model, ids, prefill)
        return recorder.trace(prefill_tokens=prefill, text_tokens=len(ids))
    finally:
        close(model)


def popularity(trace: Trace) -> np.ndarray:
    """Uses of each expert per layer, [layers, experts]: every (token, k) choice counts once."""
    counts = np.zeros((trace.layers, int(trace.layer_experts.max())), dtype=np.int64)
    layer_of_row = np.repeat(trace.call_layer, trace.call_rows)
    np.add.at(counts, (np.repeat(layer_of_row, trace.top_k), trace.experts.reshape(-1)), 1)
    return counts


def reuse_distances(trace: Trace) -> np.ndarray:
    """For each expert lookup, in the order the cache sees them (call by call, ascending expert ids), the
    number of distinct experts looked up since the previous lookup of the same (layer, expert); -1 for a
    first use. A cache of C slots under LRU hits about exactly the lookups with distance < C (pins aside),
    so the histogram is the hit-rate curve of every budget at once."""
    keys = [(layer, e) for layer, experts in trace.call_experts for e in experts]
    n = len(keys)
    tree = [0] * (n + 1)  # Fenwick tree over lookup times: 1 where a key was last looked up

    def add(i: int, v: int) -> None:
        i += 1
        while i <= n:
            tree[i] += v
            i += i & -i

    def prefix(i: int) -> int:  # sum over times [0, i)
        s = 0
        while i > 0:
            s += tree[i]
            i -= i & -i
        return s

    last: dict = {}
    out = np.empty(n, dtype=np.int64)
    for t, key in enumerate(keys):
        p = last.get(key)
        if p is None:
            out[t] = -1
        else:
            out[t] = prefix(t) - prefix(p + 1)
            add(p, -1)
        add(t, 1)
        last[key] = t
    return out
