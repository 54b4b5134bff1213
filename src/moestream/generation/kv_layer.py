"""A KV cache layer that grows into room it keeps ahead, instead of copying its history at every step.

transformers' `DynamicLayer` appends a step's keys and values with `torch.cat`, which copies every
position it holds: at 4,096 positions of Qwen3-30B-A3B's attention shape one such copy costs about 40
times writing the new position in place (docs/DECISIONS.md, "Growing KV layers"), and it
grows with the context. `GrowingLayer` holds its keys
and values as views into buffers with room for up to ROOM more positions, writes each step's positions
into that room, and copies its history only when the room runs out (once every ROOM steps of decode).
The views hold the same numbers as the concatenated tensors would, and attention over them computes the
same bits (tests/test_kv_layer.py).

Layer objects that share buffers stay apart. The prefix cache keeps a layer whose tensors a continuation
goes on using (kv_cache.py), so the buffers record how many positions they hold (their frontier), and
only a layer whose views end at the frontier writes beyond it; any other layer copies into buffers of
its own first. Whatever replaces a layer's tensors (batching rows together, cropping, selecting rows)
leaves tensors that are not views at the frontier, and the next update copies them once; batching does
so through `replace`, which also lets the old buffers go at once.
"""

from __future__ import annotations

from collections.abc import Collection

import torch
from transformers.cache_utils import DynamicLayer

from ..core.compute.attention import pack_int8

ROOM = 256  # positions of room per reallocation: a copy of the history every 256 decode steps


class _Buffers:
    """The keys' and values' buffers [batch, heads, capacity, head_dim] and how many positions are written."""

    __slots__ = ("keys", "values", "length")

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int):
        self.keys, self.values, self.length = keys, values, length


class GrowingLayer(DynamicLayer):
    """A DynamicLayer whose `update` writes into room kept ahead (see the module's doc)."""

    _buffers: _Buffers | None = None
    # Set on a layer read back from the disk tier whose bytes may still be arriving (kv_disk.load): called
    # once, before the first update, it waits for them (and raises kv_disk.TierFileError if they proved
    # damaged).
    arriving = None

    @classmethod
    def adopt(cls, layer: DynamicLayer) -> GrowingLayer:
        """This kind of layer with `layer`'s state (its tensors become the history of the first update)."""
        grown = cls.__new__(cls)
        grown.__dict__.update(layer.__dict__)
        grown._buffers = None
        return grown

    def hold(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        """Hold the first `length` positions of these buffers [batch, heads, capacity, head_dim] (any strides
        but the last), the rest being room this layer may write: a prefix read back from disk into them
        (kv_disk.load). No other layer may hold views of them past `length`."""
        self.keys, self.values = keys[..., :length, :], values[..., :length, :]
        self._buffers = _Buffers(keys, values, length)

    def plain(self) -> DynamicLayer:
        """A plain DynamicLayer over this layer's tensors (views into the buffers, not copied)."""
        plain = DynamicLayer.__new__(DynamicLayer)
        plain.__dict__.update(self.__dict__)
        plain.__dict__.pop("_buffers", None)  # (set once a layer has grown)
        plain.__dict__.pop("arriving", None)
        return plain

    def compact(self) -> DynamicLayer:
        """A plain DynamicLayer of this layer's positions, copied out of the buffers (whose room a kept
        copy would otherwise hold on to)."""
        plain = self.plain()
        if self.is_initialized:
            plain.keys, plain.values = self.keys.clone(), self.values.clone()
        return plain

    def replace(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Hold these tensors instead (rows joined, left, or cut by batching): the buffers are let go now,
        and the next update copies the new tensors into buffers of their own."""
        self.keys, self.values = keys, values
        self._buffers = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        return self._append(key_states, value_states)

    def _append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The update: these positions written after the held ones, into room; the whole keys and values."""
        if self.arriving is not None:
            self.arriving()
            del self.arriving
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        held = self.keys.shape[-2] if self.keys.numel() else 0
        end = held + key_states.shape[-2]
        buffers = self._buffers
        if buffers is None or not self._at_frontier(buffers, held, key_states, value_states) or end > buffers.keys.shape[-2]:
            buffers = self._buffers = self._allocate(held, end + ROOM, key_states, value_states)
        buffers.keys[..., held:end, :].copy_(key_states)
        buffers.values[..., held:end, :].copy_(value_states)
        buffers.length = end
        self.keys, self.values = buffers.keys[..., :end, :], buffers.values[..., :end, :]
        return self.keys, self.values

    def _at_frontier(self, buffers: _Buffers, held: int, key_states: torch.Tensor, value_states: torch.Tensor) -> bool:
        """Whether this layer's tensors are the buffers' first `held` positions and nothing lies beyond
        them, so that writing the new positions in place changes no one else's view."""
        if buffers.length != held or held == 0:
            return False
        for mine, buffer, new in ((self.keys, buffers.keys, key_states), (self.values, buffers.values, value_states)):
            if (
                mine.data_ptr() != buffer.data_ptr()
                or mine.stride() != buffer.stride()
                or mine.shape[:-2] != buffer.shape[:-2]
                or new.shape[:-2] != buffer.shape[:-2]
                or new.shape[-1] != buffer.shape[-1]
                or new.dtype != buffer.dtype
                or new.device != buffer.device
            ):
                return False
        return True

    def _allocate(self, held: int, capacity: int, key_states: torch.Tensor, value_states: torch.Tensor) -> _Buffers:
        """Buffers of `capacity` positions holding this layer's first `held` positions."""
        made = []
        for mine, new in ((self.keys, key_states), (self.values, value_states)):
            buffer = new.new_empty(*new.shape[:-2], capacity, new.shape[-1])
            if held:
                buffer[..., :held, :].copy_(mine)
            made.append(buffer)
        return _Buffers(made[0], made[1], held)


class Int8Layer(GrowingLayer):
    """A GrowingLayer of an 8-bit KV cache: its keys and values are packed rows (core/compute/attention.py,
    `pack_int8`: each position's row of a head as int8 codes and its scale), which the attention kernel
    reads as they are; each update packs the new positions, and returns the packed whole. Cutting, joining
    and copying rows (kv_cache.py) moves codes and scales together, so it stays such a layer throughout:
    its plain and compact copies are Int8Layers too, which pack what later updates bring."""

    @classmethod
    def adopt(cls, layer: DynamicLayer) -> Int8Layer:
        """An Int8Layer with `layer`'s state, its float keys and values packed (packed ones kept)."""
        packed = super().adopt(layer)
        if packed.is_initialized and packed.keys.dtype != torch.int8:
            packed.keys, packed.values = pack_int8(packed.keys), pack_int8(packed.values)
        return packed

    def plain(self) -> Int8Layer:
        plain = Int8Layer.__new__(Int8Layer)
        plain.__dict__.update(self.__dict__)
        plain.__dict__.pop("arriving", None)
        plain._buffers = None
        return plain

    def compact(self) -> Int8Layer:
        plain = self.plain()
        if self.is_initialized:
            plain.keys, plain.values = self.keys.clone(), self.values.clone()
        return plain

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        return self._append(pack_int8(key_states), pack_int8(value_states))


def grow_in_place(cache, packed: Collection[int] = ()) -> None:
    """Make each plain DynamicLayer of `cache` (a transformers Cache) a GrowingLayer, or an Int8Layer (a
    growing one too) where its index is in `packed`; other kinds of layers (sliding windows, compressed or
    quantized caches) keep their own update."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        return
    for i, layer in enumerate(layers):
        if i in packed and type(layer) in (DynamicLayer, GrowingLayer):
            layers[i] = Int8Layer.adopt(layer)
        elif type(layer) is DynamicLayer:
            layers[i] = GrowingLayer.adopt(layer)
