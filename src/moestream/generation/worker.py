"""The generation worker: the one thread that steps the serving scheduler, and the bridge to asyncio.

The model is not thread-safe, so a single thread runs it: it steps a `serving.Scheduler`, which owns the
queue, the newcomer being prefilled and the running sequences (up to `max_batch` decoded together: each
step reads and computes every needed expert once for all of them), and turns its events into each job's
events on the job's event loop. Async code (the HTTP handlers) submits a job and awaits its output; the
worker hands each piece of text to the job's event loop as it is produced. Nothing here knows about HTTP
or OpenAI: a handler learns how its job ended from what `Job.output` yields or raises.

A job is one scheduler request: one or more answers ("choices": OpenAI's n, and a completions request's
list of prompts); the scheduler's doc says how they join the batch, and how cancellation, deadlines and
errors end them. A job whose KV could never fit the running sequences' budget, or that needs more rows
than the batch has, is refused at submission (`KVBudgetExceeded`, `TooManyChoices`); one that finds
`max_queue` jobs waiting, too (`QueueFull`). A waiter whose deadline passes cancels the job itself, so a
job never outlives its deadline by more than one step, queued or running.
"""

from __future__ import annotations

import asyncio
import math
import queue
import sys
import threading
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

from ..core.memory import release_freed_heap
from ..core.runtime import runtime_of
from ..errors import ExpertReadError
from .constraints import Vocabulary
from .generate import Decoding, GenerationResult, SamplingParams, TokenLogprob, vocabulary_of
from .kv_cache import PrefixCache
from .serving import Failed, Finished, Request, Scheduler, Started

# How often a waiter checks whether its client is still connected.
DISCONNECT_POLL_SECONDS = 0.2
# How often the worker hands the freed heap back to the OS while it steps, and how soon again once idle
# (core.memory.release_freed_heap: 1-15 ms, against steps of 40 ms to seconds).
RELEASE_HEAP_EVERY_SECONDS = 10.0
RELEASE_HEAP_IDLE_SECONDS = 1.0


@dataclass(frozen=True)
class Choice:
    """One answer a request asks for: its prompt's token ids and how to generate it."""

    prompt_ids: list[int]
    params: SamplingParams


class WorkerError(Exception):
    """A job that could not be queued or did not finish."""


class QueueFull(WorkerError):
    def __init__(self, max_queue: int):
        super().__init__(f"{max_queue} requests are already queued")
        self.max_queue = max_queue


class TimedOut(WorkerError):
    """The job's deadline passed: while it waited in the queue (`queued`), or while it ran."""

    def __init__(self, timeout: float, queued: bool):
        super().__init__(f"the job ran past its timeout ({timeout:g} s){' in the queue' if queued else ''}")
        self.timeout = timeout
        self.queued = queued


class ShuttingDown(WorkerError):
    """The worker stopped the job because it is closing."""


class GenerationFailed(WorkerError):
    """The scheduler's step raised (a disk error, a damaged record): this job fails, the worker goes on."""

    def __init__(self, cause: Exception):
        super().__init__(str(cause))
        self.cause = cause


class ClientGone(Exception):
    """The client disconnected while its job waited or ran: nobody reads the output any more. Not a
    WorkerError: nothing went wrong, and nobody is left to answer."""


def _raised(error: Exception) -> WorkerError:
    """What a waiter raises for an "error" event: the worker's own ShuttingDown as it is, a step's error as the
    job's GenerationFailed."""
    return error if isinstance(error, ShuttingDown) else GenerationFailed(error)


Disconnected = Callable[[], Awaitable[bool]]


@dataclass(frozen=True)
class Piece:
    """New final text of choice `index`, with the log-probabilities of the tokens that made it (when
    they were asked for; a token whose text is held back comes with a later piece)."""

    index: int
    text: str
    logprobs: list[TokenLogprob]


@dataclass(frozen=True)
class Done:
    """Choice `index` has ended."""

    index: int
    result: GenerationResult


@dataclass(frozen=True)
class Quiet:
    """Nothing has come for a while (a long prompt is being prefilled): a stream may tell its client it
    is alive (Anthropic's `ping`)."""


@dataclass(eq=False)  # a job is equal only to itself
class Job:
    """One submitted request: its choices (one Choice each), its deadline, its scheduler request,
    and the events the worker posts to it.

    Events, in order: ("start",) when the worker takes the job's first choices, then per choice
    ("text", Piece) for each piece of text and ("done", Done) at its end; or ("error", exception), which
    ends the job. The worker posts nothing for a job it skips because it was cancelled or past its
    deadline before its turn: its waiter has given up already, or gives up at the deadline.
    """

    choices: list[Choice]
    timeout: float | None  # seconds from submission to the last token, queueing included (None: no limit)
    deadline: float  # time.monotonic(); infinite without a timeout (no step ever reaches it)
    _worker: Worker
    _loop: asyncio.AbstractEventLoop
    request: Request | None = None  # the scheduler's, made by submit
    _events: asyncio.Queue = field(default_factory=asyncio.Queue)
    submitted: float = field(default_factory=time.perf_counter)
    first_token: bool = False  # any of its choices has a token

    def cancel(self) -> None:
        """Stop the job: out of the queue at once if it waits, after the current token if it runs.
        Harmless on a job that has ended."""
        self._worker._cancel(self)

    async def wait_until_started(self, disconnected: Disconnected | None = None) -> None:
        """Return once the worker has taken the job; raises TimedOut (queued), ClientGone, or ShuttingDown (the
        worker closed first)."""
        kind, value = await self._next_event(disconnected)
        if kind == "error":  # (the worker closed while the job waited in the queue)
            raise _raised(value)
        assert kind == "start", kind  # the worker posts nothing else before it

    async def output(
        self, disconnected: Disconnected | None = None, quiet_after: float | None = None
    ) -> AsyncIterator[Piece | Done | Quiet]:
        """The job's text, piece by piece as it is generated (choices interleaved), and a Done as each
        choice ends; it returns after the last one. With `quiet_after`, a Quiet whenever nothing has come
        for that many seconds.

        Raises TimedOut, ClientGone (when `disconnected()` turns true), ShuttingDown or GenerationFailed;
        each of them has cancelled the job, so the worker is free for the next one by the next token.
        """
        left = len(self.choices)
        while left:
            kind, value = await self._next_event(disconnected, quiet_after)
            if kind == "quiet":
                yield Quiet()
            elif kind == "text":
                yield value
            elif kind == "error":
                raise _raised(value)
            elif kind == "done":
                # Only the worker's closing cancels a job whose waiter is still there: a waiter that
                # leaves cancels its own job and reads no more.
                if value.result.finish_reason == "cancelled":
                    raise ShuttingDown("the worker is closing")
                if value.result.finish_reason == "timeout":
                    raise TimedOut(self.timeout, queued=False)
                left -= 1
                yield value
            # "start": the output begins after it

    async def _next_event(self, disconnected: Disconnected | None, quiet_after: float | None = None):
        waited_since = time.monotonic()
        while True:
            now = time.monotonic()
            remaining = self.deadline - now
            if remaining <= 0:
                self.cancel()
                raise TimedOut(self.timeout, queued=not self.request.started)
            if quiet_after is not None and now - waited_since >= quiet_after:
                return "quiet", None
            try:
                return await asyncio.wait_for(self._events.get(), min(remaining, DISCONNECT_POLL_SECONDS))
            except TimeoutError:
                if disconnected is not None and await disconnected():
                    self.cancel()
                    raise ClientGone from None

    def _post(self, kind: str, value=None) -> None:
        """Called on the worker thread: hand an event to the job's event loop."""
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, (kind, value))
        except RuntimeError:
            pass  # the event loop has closed: the server is shutting down and nobody waits any more


@dataclass
class WorkerStats:
    """Totals over every generation the worker has run."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    generation_seconds: float = 0.0
    last_decode_tps: float = 0.0  # of the last generation with more than one token
    # Jobs dropped from the queue or stopped while generating, by reason.
    ended_early: dict[str, int] = field(default_factory=lambda: {"cancelled": 0, "timeout": 0, "error": 0, "disk": 0})
    started: int = 0  # jobs taken from the queue, and their seconds in it
    queue_seconds: float = 0.0
    first_tokens: int = 0  # jobs that got a first token, and the seconds from submission to it
    first_token_seconds: float = 0.0
    last_time_to_first_token: float = 0.0
    batch_steps: int = 0  # decode steps, and the sequences summed over them (their ratio: the mean batch)
    batch_rows: int = 0
    batch_kv_bytes: int = 0  # KV the running sequences hold, after the last step
    batch_kv_peak_bytes: int = 0  # the most they held after any step


class ModelThread:
    """One thread that makes every call on a model, in order: its load, its scheduler, its steps.

    Why one: torch's CPU kernels run their parallel regions on OpenMP, which keeps a pool of threads for
    each thread that ever started one. A model loaded on one thread (its load runs the kernels' checks)
    and stepped on another leaves two pools on the cores, and OpenMP then stops spinning between regions
    (more threads than cores): each kernel waits for sleeping threads to wake, and the server decoded at
    a third of `generate`'s speed (docs/DECISIONS.md, "The server's model thread").

    Not a ThreadPoolExecutor: its thread is joined at the interpreter's exit, and a step that never ends
    (a stalled disk) would then keep the process from exiting; this one is a daemon."""

    def __init__(self, name: str = "moestream-model"):
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, function: Callable, *args, **kwargs) -> Future:
        """Run `function(*args, **kwargs)` on the thread, after what was submitted before."""
        future: Future = Future()
        self._calls.put((future, function, args, kwargs))
        return future

    def call(self, function: Callable, *args, **kwargs):
        """`submit`, then wait for its result (its exception is raised here)."""
        return self.submit(function, *args, **kwargs).result()

    def stop(self) -> None:
        """End the thread once what was submitted has run."""
        self._calls.put(None)

    def _run(self) -> None:
        while (item := self._calls.get()) is not None:
            future, function, args, kwargs = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(function(*args, **kwargs))
                except BaseException as e:  # the caller's to handle
                    future.set_exception(e)


def _said_if_failed(looping: Future) -> None:
    # The loop handles a step's errors itself (the requests fail); anything else is a bug, said, not lost.
    if looping.exception() is not None:
        traceback.print_exception(looping.exception(), file=sys.stderr)


class Worker:
    """The one thread that runs the model, stepping the serving scheduler; see the module's doc."""

    def __init__(
        self,
        model,
        tokenizer,
        max_queue: int,
        *,
        max_batch: int = 1,
        prefix_cache: PrefixCache | None = None,
        kv_budget_bytes: int | None = None,
        prefill_chunk: int | None = None,
        model_thread: ModelThread | None = None,
    ):
        """`model_thread`: the thread that loaded the model, which then steps it (a thread of its own if None)."""
        self.model = model
        self.tokenizer = tokenizer
        self.max_queue = max_queue
        self._batch_options = dict(
            max_batch=max_batch, prefix_cache=prefix_cache, kv_budget_bytes=kv_budget_bytes, prefill_chunk=prefill_chunk
        )
        self.scheduler: Scheduler | None = None  # made by start(): its batch runs one forward pass
        self._cond = threading.Condition()  # wakes the thread; guards _closed and _stats
        self._closed = False
        self._heap_released_at = time.monotonic()
        self._stats = WorkerStats()
        self._own_thread = model_thread is None
        self._thread = model_thread or ModelThread("moestream-generate")
        self._looping: Future | None = None

    def start(self) -> None:
        # Made on the model's thread: the batch's one-token probe is a forward pass (ModelThread says why).
        self.scheduler = self._thread.call(Scheduler, self.model, **self._batch_options, listener=self._handle)
        runtime_of(self.model).reset_stats()  # the probe is no request's
        self._looping = self._thread.submit(self._loop)
        self._looping.add_done_callback(_said_if_failed)

    def close(self) -> None:
        """Cancel every job, queued or running, and wait for the thread to end. A step that waits for a
        stalled disk ends at once (its jobs with ShuttingDown), not at the read timeout."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._looping is not None:
            runtime = runtime_of(self.model)
            runtime.interrupt_reads()
            try:
                self._looping.result(timeout=30)
            except FutureTimeout:
                pass  # a step that does not end (a kernel that hangs): the thread is a daemon
            finally:
                runtime.interrupt_reads(False)  # the model may serve another worker
        if self._own_thread:
            self._thread.stop()

    def submit(self, choices: list[Choice], timeout: float | None) -> Job:
        """Queue a request's choices from the running event loop; raises QueueFull when `max_queue` jobs
        wait, KVBudgetExceeded when a choice's KV could never fit, TooManyChoices when the answers to one
        prompt need more rows than the batch has."""
        deadline = math.inf if timeout is None else time.monotonic() + timeout
        job = Job(list(choices), timeout, deadline, self, asyncio.get_running_loop())
        job.request = Request(
            lambda index: self._decoding(job, index),
            [c.prompt_ids for c in choices],
            [len(c.prompt_ids) + c.params.max_tokens for c in choices],
            deadline=job.deadline,
            tag=job,
        )
        self.scheduler.check(job.request)
        with self._cond:
            if self._closed:  # (a request that passed the server's drain check just before the close)
                raise ShuttingDown("the server is stopping")
            if self.scheduler.queued() >= self.max_queue:
                raise QueueFull(self.max_queue)
            self.scheduler.add(job.request)
            self._cond.notify()
        return job

    def queued(self) -> int:
        return self.scheduler.queued()

    def running(self) -> int:
        return self.scheduler.running()

    def stats(self) -> WorkerStats:
        """A consistent copy of the totals, safe to read from any thread."""
        with self._cond:
            s = self._stats
            return WorkerStats(**{**s.__dict__, "ended_early": dict(s.ended_early)})

    def _cancel(self, job: Job) -> None:
        if self.scheduler.abort(job.request):
            with self._cond:
                self._stats.ended_early["cancelled"] += 1

    def _loop(self) -> None:
        scheduler = self.scheduler
        while True:
            with self._cond:
                while scheduler.idle() and not self._closed:
                    self._cond.wait()
                if self._closed:
                    break
            scheduler.step()  # its events reach `_handle` as they happen
            batch = scheduler.batch
            with self._cond:
                s = self._stats
                s.batch_steps, s.batch_rows, s.batch_kv_bytes = batch.stats.steps, batch.stats.rows, batch.kv_bytes()
                s.batch_kv_peak_bytes = max(s.batch_kv_peak_bytes, s.batch_kv_bytes)
            # The steps' freed tensors go back to the OS now and then, and when the work runs out: RSS then
            # tracks what the server holds, not the most its steps ever needed (docs/DECISIONS.md).
            since = time.monotonic() - self._heap_released_at
            if since >= RELEASE_HEAP_EVERY_SECONDS or (since >= RELEASE_HEAP_IDLE_SECONDS and scheduler.idle()):
                release_freed_heap()
                self._heap_released_at = time.monotonic()
        scheduler.close()  # closing: the running jobs end as cancelled

    def _handle(self, event) -> None:
        """A scheduler event -> the statistics and the job's own events."""
        job: Job = event.request.tag
        if isinstance(event, Started):
            with self._cond:
                self._stats.started += 1
                self._stats.queue_seconds += time.perf_counter() - job.submitted
            job._post("start")
        elif isinstance(event, Finished):
            result = event.decoding.result()
            with self._cond:
                s = self._stats
                s.prompt_tokens += result.prompt_tokens
                s.completion_tokens += len(result.token_ids)
                s.generation_seconds += result.seconds
                if len(result.token_ids) > 1:
                    s.last_decode_tps = result.decode_tokens_per_second
                if result.finish_reason in ("cancelled", "timeout"):
                    s.ended_early[result.finish_reason] += 1
            job._post("done", Done(event.request.index[event.decoding], result))
        elif isinstance(event, Failed):
            # Once close() has begun, a job ends as cancelled, whatever the step met (a wait for reads that
            # close() interrupted, the queue closed, or no slot left because stalled reads still hold theirs).
            if self._closed:
                with self._cond:
                    self._stats.ended_early["cancelled"] += 1
                job._post("error", ShuttingDown("the server is stopping"))
                return
            with self._cond:  # (a disk that failed a read is told apart: /metrics names it)
                self._stats.ended_early["disk" if isinstance(event.error, ExpertReadError) else "error"] += 1
            job._post("error", event.error)

    def _decoding(self, job: Job, index: int) -> Decoding:
        choice = job.choices[index]
        decoding = Decoding(
            self.model,
            self.tokenizer,
            choice.prompt_ids,
            choice.params,
            on_text=lambda text: job._post("text", Piece(index, text, decoding.take_logprobs())),
            on_first_token=lambda: self._first_token(job),
            cancel=job.request.cancel,
            deadline=job.deadline,
        )
        return decoding

    def vocabulary(self) -> Vocabulary:
        """The grammar engine's view of this model's tokenizer (built once, on first use)."""
        return vocabulary_of(self.model, self.tokenizer)

    def _first_token(self, job: Job) -> None:
        if job.first_token:
            return  # the job's first token came already (from another of its choices)
        job.first_token = True
        seconds = time.perf_counter() - job.submitted
        with self._cond:
            s = self._stats
            s.first_tokens += 1
            s.first_token_seconds += seconds
            s.last_time_to_first_token = seconds
