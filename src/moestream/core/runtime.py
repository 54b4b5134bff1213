"""A loaded model's runtime as generation, the server and tools see it: its store, statistics, fast paths, routing
and read recording, close. They go through this instead of the engine, its supply or its reader, so those
can change without them (import-linter forbids generation, the server, tools and commands the modules behind it:
pyproject.toml)."""

from __future__ import annotations

from ..conversion.store import Store
from . import fastpaths, shape_warmup
from .engine import ExpertEngine, engine_of


def warm_matmul_shapes(model, max_rows: int, seconds: float) -> shape_warmup.Warmed:
    """Build every bucketed matmul shape the model runs up to `max_rows` rows, within `seconds`
    (shape_warmup.py): a server's memory then stays where it starts."""
    return shape_warmup.warm(model, engine_of(model), max_rows, seconds)


def runtime_of(model) -> Runtime:
    """The runtime of a model that moestream.load() returned (a usage error for any other model)."""
    return Runtime(engine_of(model))


class Runtime:
    def __init__(self, engine: ExpertEngine):
        self._engine = engine

    @property
    def store(self) -> Store:
        return self._engine.store

    def stats(self) -> dict:
        """Cache hits, misses, hit rate, bytes read, read and wait seconds, overall and per layer, the fast
        paths and the peak RSS; waits for no read in flight (any thread may call it)."""
        return self._engine.stats()

    def reset_stats(self) -> None:
        self._engine.reset_stats()

    def fast_paths(self) -> str:
        """One line: which fast paths the model runs, and why the others are off (fastpaths.py)."""
        return fastpaths.describe(self._engine.fast_paths)

    def observe_routing(self, observer) -> None:
        """From now on `observer.start_step(token_ids)` hears each forward pass begin and
        `observer.record(layer, top_k_index, top_k_weights)` each experts call's routing; None stops."""
        if observer is not None and self._engine.trace is not None:
            raise RuntimeError("this model's routing is already being observed")
        self._engine.trace = observer

    def observing_routing(self) -> bool:
        return self._engine.trace is not None

    def record_reads(self) -> ReadRecording:
        """Record the expert reads from now until the recording's `stop()`."""
        return ReadRecording(self._engine)

    def interrupt_reads(self, interrupted: bool = True) -> None:
        """While interrupted, a forward pass raises errors.ReadsInterrupted at its next MoE layer, or at once
        where it waits for an expert read, instead of waiting up to the read timeout (any thread may call
        this; False: run again)."""
        self._engine.supply.interrupt_waits(interrupted)

    def close(self) -> None:
        """Stop the reader threads and release the cache; the model cannot run afterwards."""
        self._engine.close()


class ReadRecording:
    """The expert reads of a loaded model between its start and `stop()`: each read's (file index, offset,
    length) as issued, the bytes of the reads each forward pass started (reads ahead of need included: none is
    issued for a pass not yet begun), and the time at least one read was in flight (`moestream bench`'s
    floors)."""

    def __init__(self, engine: ExpertEngine):
        self._engine = engine
        self._reader = engine.supply.reader
        self.reads: list[tuple[int, int, int]] = []
        self._reader.log = self.reads
        self._step_starts: list[int] = []
        self._busy_at_start = self._reader.busy_seconds()
        self.busy_seconds = 0.0  # set by `stop`
        engine.step_hooks.append(self)

    # The engine's step hook: a forward pass begins, an experts call ends.
    def start_step(self, tokens: int) -> None:
        self._step_starts.append(len(self.reads))

    def end_layer(self, layer: int) -> None:
        pass

    def stop(self) -> ReadRecording:
        if self in self._engine.step_hooks:
            self._engine.step_hooks.remove(self)
            self._reader.log = None
            self.busy_seconds = self._reader.busy_seconds() - self._busy_at_start
        return self

    def step_bytes(self) -> list[int]:
        """Bytes of the reads each forward pass started, in order."""
        bounds = self._step_starts + [len(self.reads)]
        return [sum(length for _, _, length in self.reads[a:b]) for a, b in zip(bounds, bounds[1:])]
