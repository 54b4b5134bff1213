"""KV caches beyond one sequence: the batch of sequences decoded together, and the cache of recent prefixes.

Both work on transformers' own `DynamicCache`, whose layers hold keys and values as tensors
[batch, heads, positions, head_dim] and grow by concatenation (a layer's `update` never writes into a
tensor it already holds). That is why a prefix's tensors can be shared by the prefix cache and by every
sequence that continues it, with no copy: a continuation concatenates into new tensors. Decoding
sequences' layers grow into room instead (kv_layer.py), alone or batched; the prefix cache keeps compact
copies of them.

`BatchKV` keeps the running sequences in one DynamicCache, row i for sequence i, right-aligned: each row
ends at the last position and has left padding where it is shorter than the longest. A decode step
then feeds one token per row with an attention mask that hides the padding and each row's own position
ids, which is what transformers' batched `generate` does with a left-padded batch. Rows join (a
sequence after its prefill) and leave (a finished one) between steps; the common left padding is cut
when rows leave.

Only full-attention and sliding-window layers (`DynamicLayer`, `DynamicSlidingWindowLayer`) are laid
out so; a model with other cache layers (DeepSeek-V4's compressed attention) decodes one sequence at a
time (`batchable` says why).
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Sequence

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

from .kv_disk import DiskTier, common_prefix
from .kv_layer import GrowingLayer, Int8Layer, grow_in_place

_LAYER_TYPES = (DynamicLayer, DynamicSlidingWindowLayer, GrowingLayer, Int8Layer)  # growing: a decoding sequence's


def batchable(cache) -> str | None:
    """None if `cache` (a model's cache after a prefill) can be batched and cut; else why not."""
    if type(cache) is not DynamicCache:
        return f"its KV cache is a {type(cache).__name__}, not a DynamicCache"
    for layer in cache.layers:
        if type(layer) not in _LAYER_TYPES:
            return f"its KV cache has {type(layer).__name__} layers, which moestream cannot batch or cut"
        if not layer.is_initialized or getattr(layer, "record_past", False):
            return "its KV cache has layers that a forward pass leaves empty"
    return None


def kv_bytes(cache) -> int:
    """Bytes of the keys and values `cache` holds."""
    return sum(t.numel() * t.element_size() for layer in cache.layers if layer.is_initialized for t in (layer.keys, layer.values))


def _held(layer, positions: int) -> int:
    """How many positions a layer holds once `positions` tokens went through it."""
    return min(positions, layer.sliding_window - 1) if layer.is_sliding else positions


def _left_pad(t: torch.Tensor, size: int) -> torch.Tensor:
    if size == t.shape[-2]:
        return t
    pad = t.new_zeros(*t.shape[:-2], size - t.shape[-2], t.shape[-1])
    return torch.cat([pad, t], dim=-2)


def _shallow(cache: DynamicCache) -> DynamicCache:
    """A cache object of its own over the same tensors (safe: layers update by concatenation, or, growing
    ones, write in place only past every other layer's view, kv_layer.py)."""
    out = copy.copy(cache)
    out.layers = [copy.copy(layer) for layer in cache.layers]
    return out


def _compact(cache: DynamicCache) -> DynamicCache:
    """`_shallow`, with each growing layer made a plain DynamicLayer of its views' positions, copied out of
    its buffers, whose room would otherwise stay held, uncounted, for as long as the copy is kept."""
    out = _shallow(cache)
    out.layers = [layer.compact() if isinstance(layer, GrowingLayer) else layer for layer in out.layers]
    return out


def _views(cache: DynamicCache) -> DynamicCache:
    """`_shallow`, with each growing layer made a plain layer over the same positions (no copy, no room of
    its own to write)."""
    out = _shallow(cache)
    out.layers = [layer.plain() if isinstance(layer, GrowingLayer) else layer for layer in out.layers]
    return out


def _replace(layer, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Give a batch's layer new tensors (rows joined, left or cut); a growing layer lets its buffers go."""
    if isinstance(layer, GrowingLayer):
        layer.replace(keys, values)
    else:
        layer.keys, layer.values = keys, values


def _set_positions(layer, positions: int) -> None:
    if layer.is_sliding:
        layer.cumulative_length = positions


class BatchKV:
    """The KV cache of the running sequences, one right-aligned row each (see the module's doc). Its
    full-attention layers grow into room (kv_layer.GrowingLayer): while the rows stay, a step writes its
    position in place, as a lone sequence's does; rows joining or leaving give the layers new tensors,
    which the next step copies into room once."""

    def __init__(self):
        self.cache: DynamicCache | None = None
        self.lengths: list[int] = []  # positions of each row's own tokens in the cache
        self.alone = False  # its one row's cache does not batch (`batchable`): kept as its prefill left it

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def width(self) -> int:
        """Positions of the padded batch: the longest row's."""
        return max(self.lengths, default=0)

    def add(self, cache: DynamicCache, length: int) -> None:
        """Append a sequence (a batch-1 cache of `length` positions, from its prefill) as the last row. A
        first row whose cache does not batch is the batch's only one (the scheduler admits no other)."""
        if self.cache is None:
            self.alone = batchable(cache) is not None
            self.cache, self.lengths = (cache if self.alone else _shallow(cache)), [length]
            grow_in_place(self.cache)
            return
        if self.alone:
            raise ValueError("this model's KV cache does not batch: one sequence at a time")
        width = max(self.width, length)
        for mine, theirs in zip(self.cache.layers, cache.layers):
            size = _held(mine, width)
            _replace(
                mine,
                torch.cat([_left_pad(mine.keys, size), _left_pad(theirs.keys, size)], dim=0),
                torch.cat([_left_pad(mine.values, size), _left_pad(theirs.values, size)], dim=0),
            )
            _set_positions(mine, width)
        self.lengths.append(length)

    def keep(self, rows: Sequence[int]) -> None:
        """Keep only `rows` (in that order), then cut the left padding every remaining row has."""
        rows = list(rows)
        if not rows:
            self.cache, self.lengths = None, []
            return
        if self.alone:
            return  # (one row, kept: nothing to cut)
        if rows != list(range(len(self.lengths))):
            for layer in self.cache.layers:
                index = torch.tensor(rows, dtype=torch.long, device=layer.keys.device)
                _replace(layer, layer.keys.index_select(0, index), layer.values.index_select(0, index))
            self.lengths = [self.lengths[r] for r in rows]
        width = self.width
        for layer in self.cache.layers:
            size = _held(layer, width)
            if layer.keys.shape[-2] > size:
                _replace(layer, layer.keys[..., -size:, :], layer.values[..., -size:, :])
            _set_positions(layer, width)

    def row(self, i: int) -> DynamicCache:
        """Row i as a batch-1 cache of plain layers holding its own tokens, copied out (the batch's tensors
        can then go); a lone row's cache is its own already."""
        if self.alone:
            return self.cache
        out = _shallow(self.cache)
        out.layers = [layer.plain() if isinstance(layer, GrowingLayer) else layer for layer in out.layers]
        for layer in out.layers:
            size = _held(layer, self.lengths[i])
            layer.keys = layer.keys[i : i + 1, :, -size:, :].clone()
            layer.values = layer.values[i : i + 1, :, -size:, :].clone()
            _set_positions(layer, self.lengths[i])
        return out

    def step_inputs(self) -> dict:
        """The forward arguments that feed one new token per row: the attention mask over the padded
        positions plus the new one, each row's own position ids, the cache. One row needs neither mask
        nor positions, so a batch of one runs exactly as a lone sequence does."""
        if len(self.lengths) == 1:
            return {}
        width = self.width
        lengths = torch.tensor(self.lengths, dtype=torch.long)
        mask = (torch.arange(width + 1).unsqueeze(0) >= (width - lengths).unsqueeze(1)).long()
        return {"attention_mask": mask, "position_ids": lengths.unsqueeze(1)}

    def advance(self) -> None:
        """After a step: every row holds one more token."""
        self.lengths = [n + 1 for n in self.lengths]

    def nbytes(self) -> int:
        return 0 if self.cache is None else kv_bytes(self.cache)


@dataclass
class PrefixStats:
    lookups: int = 0
    hits: int = 0
    tokens_reused: int = 0
    entries: int = 0  # filled in by `stats()`
    bytes: int = 0


class PrefixCache:
    """Recent sequences' KV by token ids, under a byte budget, least recently used out first.

    `put(ids, cache)` keeps a batch-1 cache that holds exactly the KV of `ids`; `match(prompt_ids)` finds
    the entry sharing the longest prefix with the prompt and returns a cache of that prefix, cut to it,
    always leaving at least one prompt token to feed (its logits choose the first new token). Feeding the
    rest after that cache computes the same as feeding the whole prompt. Thread-safe: the server's
    generation thread uses it while /metrics reads its statistics.

    With `disk` (kv_disk.DiskTier), an entry that leaves RAM for the budget goes to the disk, as every entry
    does at a clean stop (`flush`), and a prompt whose longest prefix is on disk, and longer than any in RAM,
    is read from there (and kept in RAM again)."""

    def __init__(self, budget_bytes: int, disk: DiskTier | None = None):
        self.budget_bytes = budget_bytes
        self.disk = disk
        self._entries: OrderedDict[tuple[int, ...], tuple[DynamicCache, int]] = OrderedDict()
        self._lock = threading.Lock()
        self._stats = PrefixStats()

    def match(self, prompt_ids: Sequence[int]) -> tuple[DynamicCache | None, int]:
        """(a cache of the longest reusable prefix, its length), or (None, 0)."""
        prompt = tuple(prompt_ids)
        with self._lock:
            self._stats.lookups += 1
            best, best_len = None, 0
            for ids in self._entries:
                n = common_prefix(ids, prompt, len(prompt) - 1)
                if n > best_len and _cuttable(self._entries[ids][0], len(ids), n):
                    best, best_len = ids, n
            cache = _shallow(self._entries[best][0]) if best is not None else None
            if best is not None:
                self._entries.move_to_end(best)
        if self.disk is not None:
            # Prefixes on their way to the disk are still in RAM (DiskTier.pending).
            for ids, queued in self.disk.pending():
                n = common_prefix(ids, prompt, len(prompt) - 1)
                if n > best_len and _cuttable(queued, len(ids), n):
                    cache, best, best_len = _shallow(queued), ids, n
            # Recently used again: back in RAM, once all of it has arrived from the disk and proved sound.
            found, n = self.disk.match(prompt, at_least=best_len + 1, when_checked=self._put_read_back)
            if found is not None:
                cache, best, best_len = _shallow(found), prompt[:n], n
        if best is None:
            return None, 0
        with self._lock:
            self._stats.hits += 1
            self._stats.tokens_reused += best_len
        if best_len < len(best):
            cache.crop(best_len - len(best))
        return cache, best_len

    def _put_read_back(self, ids: Sequence[int], cache: DynamicCache) -> None:
        self.put(ids, cache, read_back=True)

    def flush(self) -> None:
        """Write every entry in RAM to the disk tier, and wait for the writes (a clean stop)."""
        if self.disk is None:
            return
        with self._lock:
            entries = [(ids, cache) for ids, (cache, _) in self._entries.items()]
        for ids, cache in entries:
            self.disk.put(ids, cache)
        self.disk.flush()

    def put(self, ids: Sequence[int], cache: DynamicCache, *, read_back: bool = False) -> None:
        """Keep `cache` (the KV of exactly `ids`); evicts least recently used entries to fit. `read_back`:
        the cache was just read from the disk tier, into buffers whose room only its request writes: the
        entry keeps views of its positions, not a copy, and is not written to the disk again."""
        ids = tuple(ids)
        size = kv_bytes(cache)
        if not ids or batchable(cache) is not None:
            return
        if size > self.budget_bytes:  # more than RAM may hold (a long agent prompt): the disk tier may
            if self.disk is not None and not read_back:
                self.disk.put(ids, _compact(cache))
            return
        with self._lock:
            if read_back and any(len(old) > len(ids) and old[: len(ids)] == ids for old in self._entries):
                return  # (its request ended first, and kept more)
            # An entry that is a prefix of the new one is dominated by it.
            for old in [old for old in self._entries if old == ids[: len(old)]]:
                self._drop(old)
            self._entries[ids] = (_views(cache) if read_back else _compact(cache), size)
            self._stats.bytes += size
            while self._stats.bytes > self.budget_bytes:
                evicted = next(iter(self._entries))
                if self.disk is not None:
                    self.disk.put(evicted, self._entries[evicted][0])  # (written in the background)
                self._drop(evicted)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._stats.bytes = 0

    def stats(self) -> PrefixStats:
        with self._lock:
            return replace(self._stats, entries=len(self._entries))

    def _drop(self, ids: tuple[int, ...]) -> None:
        _, size = self._entries.pop(ids)
        self._stats.bytes -= size


def _cuttable(cache: DynamicCache, length: int, to: int) -> bool:
    """Whether a cache of `length` positions can be cut back to `to`: a sliding-window layer that has
    already dropped positions cannot give back the ones before its window."""
    return to == length or all(not layer.is_sliding or length < layer.sliding_window for layer in cache.layers)
