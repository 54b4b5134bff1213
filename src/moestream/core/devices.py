"""Where the model computes, as the expert cache's accelerator tier needs it: memory for slots, a copy
queue of its own, and events that say when queued work is over.

`CudaDevice` is one CUDA GPU: host-to-device copies run on their own stream, kernels on the current
(default) stream, and `torch.cuda.Event`s mark both. `StandInDevice` does the same with CPU tensors and
events that complete only when told to (`FakeEvent`, or at once by default): the tests drive the tier's
slot lifetimes with it, and a whole model runs through the tier's code path on a machine without a GPU.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..errors import UsageError


class Event(Protocol):
    def query(self) -> bool:
        """Whether the work queued before this event is over."""

    def synchronize(self) -> None:
        """Block until it is."""


class Device(Protocol):
    def empty(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer of `nbytes` in the device's memory."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Event:
        """Queue a copy of `src` (pinned host memory) into `dst` (device memory) on the copy queue, make
        later compute wait for it, and return the event that marks its end (then `src` may be reused)."""

    def record(self) -> Event:
        """An event after the compute queued so far (then the slots it read may be reused)."""

    def pin(self, buffer: torch.Tensor) -> None:
        """Make a host buffer usable for asynchronous copies (page-locked)."""


class CudaDevice:
    def __init__(self, index: int | None = None):
        if not torch.cuda.is_available():
            raise UsageError(
                "device cuda: no CUDA GPU is visible to torch (torch.cuda.is_available() is False); install a CUDA "
                "build of PyTorch on a machine with an NVIDIA GPU, or run with --device cpu"
            )
        self.device = torch.device("cuda", torch.cuda.current_device() if index is None else index)
        self.copy_stream = torch.cuda.Stream(self.device)

    def empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> torch.cuda.Event:
        # No wait for the compute stream: the tier hands out only slots whose readers' events are over, so
        # copies overlap the kernels of other experts.
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.copy_stream):
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.copy_stream)
        compute.wait_event(done)
        return done

    def record(self) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def pin(self, buffer: torch.Tensor) -> None:
        # The host tier's arena is one anonymous mapping (page-aligned for O_DIRECT); registering it with the
        # driver page-locks it in place, so reads land in it and copies leave from it without a staging copy.
        err = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel() * buffer.element_size(), 0)
        if int(err) != 0:
            raise UsageError(
                f"cannot page-lock the {buffer.numel() / 2**30:.1f} GiB host expert cache (CUDA error {int(err)}): "
                "lower --memory, or raise the locked-memory limit (ulimit -l)"
            )


class FakeEvent:
    """An event that completes when `complete()` is called (or at creation, if `done`)."""

    def __init__(self, done: bool = True):
        self.done = done
        self.waited = 0  # how often someone blocked on it

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited += 1
        self.done = True

    def complete(self) -> None:
        self.done = True


class StandInDevice:
    """A device for tests and CPU-only machines: slots are CPU tensors, copies happen at once, and events
    complete at once unless `manual` (then they complete when a test calls `complete()` or when someone
    synchronizes on them). It keeps every event it made, so a test can inspect them."""

    def __init__(self, manual: bool = False):
        self.manual = manual
        self.copies: list[FakeEvent] = []
        self.computes: list[FakeEvent] = []

    def empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> FakeEvent:
        dst.copy_(src)
        self.copies.append(FakeEvent(done=not self.manual))
        return self.copies[-1]

    def record(self) -> FakeEvent:
        self.computes.append(FakeEvent(done=not self.manual))
        return self.computes[-1]

    def pin(self, buffer: torch.Tensor) -> None:
        pass
