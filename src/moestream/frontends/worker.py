"""The generation worker: the one thread that runs the model for every request, in arrival order.

The model is not thread-safe, so a single thread runs it: it takes jobs from a first-in first-out queue
into a `batching.BatchGenerator`, which decodes up to `max_batch` of them together (each step reads and
computes every needed expert once for all of them) and prefills each newcomer between steps. Async code
(the HTTP handlers) submits a job and awaits its output; the worker hands each piece of text to the
job's event loop as it is produced. Nothing here knows about HTTP or OpenAI: a handler learns how its
job ended from what `Job.output` yields or raises.

A job joins the batch when a row is free and the running sequences' KV budget holds with it (prompt plus
max tokens of every row); until then it waits in the queue. A job whose KV could never fit that budget
is refused at submission (`KVBudgetExceeded`).

Cancellation and deadlines: every job has a cancel flag and a deadline (time.monotonic()). A job
cancelled while queued leaves the queue at once; a running one stops after its current token
(`generate.Decoding` checks both after every token). A waiter whose deadline passes cancels the job
itself, so a job never outlives its deadline by more than one step, queued or running.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from ..core.loading import engine_of
from .batching import BatchGenerator
from .generate import Decoding, GenerationResult
from .kv_cache import PrefixCache

# How often a waiter checks whether its client is still connected.
DISCONNECT_POLL_SECONDS = 0.2


@dataclass(frozen=True)
class GenerationParams:
    """What to generate: the arguments of one `generate.stream` call."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop: list[str]
    ignore_eos: bool = False


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
    """`generate.stream` raised (a disk error, a damaged record): this job fails, the worker goes on."""

    def __init__(self, cause: Exception):
        super().__init__(str(cause))
        self.cause = cause


class ClientGone(Exception):
    """The client disconnected while its job waited or ran: nobody reads the output any more. Not a
    WorkerError: nothing went wrong, and nobody is left to answer."""


Disconnected = Callable[[], Awaitable[bool]]


@dataclass(eq=False)  # a job is equal only to itself (the queue removes jobs by identity)
class Job:
    """One submitted generation: its parameters, its deadline, and the events the worker posts to it.

    Events, in order: ("start",) when the worker takes the job, ("text", piece) for each piece of text,
    then ("done", GenerationResult) or ("error", exception). The worker posts nothing for a job it
    skips because it was cancelled or past its deadline before its turn: its waiter has given up already,
    or gives up at the deadline.
    """

    params: GenerationParams
    timeout: float  # seconds from submission to the last token, queueing included
    deadline: float  # time.monotonic()
    _worker: Worker
    _loop: asyncio.AbstractEventLoop
    _events: asyncio.Queue = field(default_factory=asyncio.Queue)
    _cancel: threading.Event = field(default_factory=threading.Event)
    started: bool = False  # set by the worker thread before it posts "start"
    submitted: float = field(default_factory=time.perf_counter)
    decoding: Decoding | None = None  # made when the worker takes the job

    def cancel(self) -> None:
        """Stop the job: out of the queue at once if it waits, after the current token if it runs.
        Harmless on a job that has ended."""
        self._worker._cancel(self)

    async def wait_until_started(self, disconnected: Disconnected | None = None) -> None:
        """Return once the worker has taken the job; raises TimedOut (queued) or ClientGone."""
        kind, _ = await self._next_event(disconnected)
        assert kind == "start", kind  # the worker posts nothing before it

    async def output(self, disconnected: Disconnected | None = None) -> AsyncIterator[str | GenerationResult]:
        """The job's text, piece by piece as it is generated, then its GenerationResult.

        Raises TimedOut, ClientGone (when `disconnected()` turns true), ShuttingDown or GenerationFailed;
        each of them has cancelled the job, so the worker is free for the next one by the next token.
        """
        while True:
            kind, value = await self._next_event(disconnected)
            if kind == "text":
                yield value
            elif kind == "error":
                raise GenerationFailed(value)
            elif kind == "done":
                # Only the worker's closing cancels a job whose waiter is still there: a waiter that
                # leaves cancels its own job and reads no more.
                if value.finish_reason == "cancelled":
                    raise ShuttingDown("the worker is closing")
                if value.finish_reason == "timeout":
                    raise TimedOut(self.timeout, queued=False)
                yield value
                return
            # "start": the output begins after it

    async def _next_event(self, disconnected: Disconnected | None):
        while True:
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                self.cancel()
                raise TimedOut(self.timeout, queued=not self.started)
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
    ended_early: dict[str, int] = field(default_factory=lambda: {"cancelled": 0, "timeout": 0, "error": 0})
    started: int = 0  # jobs taken from the queue, and their seconds in it
    queue_seconds: float = 0.0
    first_tokens: int = 0  # jobs that got a first token, and the seconds from submission to it
    first_token_seconds: float = 0.0
    last_time_to_first_token: float = 0.0
    batch_steps: int = 0  # decode steps, and the sequences summed over them (their ratio: the mean batch)
    batch_rows: int = 0
    batch_kv_bytes: int = 0  # KV the running sequences hold, after the last step
    batch_kv_peak_bytes: int = 0  # the most they held after any step


class Worker:
    """The one thread that runs the model, fed in arrival order from a bounded queue; see the module's doc."""

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
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.max_queue = max_queue
        self._batch_options = dict(
            max_batch=max_batch, prefix_cache=prefix_cache, kv_budget_bytes=kv_budget_bytes, prefill_chunk=prefill_chunk
        )
        self.batch: BatchGenerator | None = None  # made by start(): it runs one forward pass
        self._pending: deque[Job] = deque()
        self._cond = threading.Condition()  # guards _pending, _running, _closed and _stats
        self._closed = False
        self._running: dict[Decoding, Job] = {}
        self._stats = WorkerStats()
        self._thread = threading.Thread(target=self._loop, name="moestream-generate", daemon=True)

    def start(self) -> None:
        self.batch = BatchGenerator(self.model, **self._batch_options)
        engine_of(self.model).reset_stats()  # the batch's one-token probe is no request's
        self._thread.start()

    def close(self) -> None:
        """Cancel every job, queued or running, and wait for the thread to end."""
        with self._cond:
            self._closed = True
            for job in self._pending:
                job._cancel.set()
            for job in self._running.values():
                job._cancel.set()
            self._cond.notify_all()
        self._thread.join(timeout=30)

    def submit(self, params: GenerationParams, timeout: float) -> Job:
        """Queue a generation from the running event loop; raises QueueFull when `max_queue` jobs wait,
        KVBudgetExceeded when its KV could never fit."""
        if self.batch is not None:
            self.batch.check(len(params.prompt_ids) + params.max_tokens)
        job = Job(params, timeout, time.monotonic() + timeout, self, asyncio.get_running_loop())
        with self._cond:
            if len(self._pending) >= self.max_queue:
                raise QueueFull(self.max_queue)
            self._pending.append(job)
            self._cond.notify()
        return job

    def queued(self) -> int:
        with self._cond:
            return len(self._pending)

    def running(self) -> int:
        with self._cond:
            return len(self._running)

    def stats(self) -> WorkerStats:
        """A consistent copy of the totals, safe to read from any thread."""
        with self._cond:
            s = self._stats
            return WorkerStats(**{**s.__dict__, "ended_early": dict(s.ended_early)})

    def _cancel(self, job: Job) -> None:
        job._cancel.set()
        with self._cond:
            if job in self._pending:
                self._pending.remove(job)
                self._stats.ended_early["cancelled"] += 1

    def _loop(self) -> None:
        batch = self.batch
        while True:
            with self._cond:
                while not self._pending and not self._running and not self._closed:
                    self._cond.wait()
                if self._closed:
                    break
            while (job := self._next_joining()) is not None:
                self._admit(job)
            self._prefill_step()
            try:
                ended = batch.decode()
            except Exception as e:  # a disk error, a damaged record: the running jobs fail, the worker goes on
                for job in self._take_all():
                    self._fail(job, e)
                continue
            for decoding in ended:
                self._finish(decoding)
            with self._cond:
                s = self._stats
                s.batch_steps, s.batch_rows, s.batch_kv_bytes = batch.stats.steps, batch.stats.rows, batch.kv_bytes()
                s.batch_kv_peak_bytes = max(s.batch_kv_peak_bytes, s.batch_kv_bytes)
        for job in self._take_all():  # closing: the running jobs end as cancelled
            job.decoding.finish_reason = "cancelled"
            job._post("done", job.decoding.result())

    def _next_joining(self) -> Job | None:
        """The first queued job if it may join the batch now (FIFO: a job that must wait holds back the rest)."""
        with self._cond:
            if not self._pending or self._closed:
                return None
            p = self._pending[0].params
            return self._pending.popleft() if self.batch.has_room(len(p.prompt_ids) + p.max_tokens) else None

    def _admit(self, job: Job) -> None:
        """Start a job taken from the queue: its prefill and first token (it may end right there)."""
        if job._cancel.is_set() or time.monotonic() >= job.deadline:
            return  # its waiter has given up, or gives up at the deadline (timed out in the queue)
        p = job.params
        job.decoding = Decoding(
            self.model,
            self.tokenizer,
            p.prompt_ids,
            p.max_tokens,
            temperature=p.temperature,
            top_p=p.top_p,
            seed=p.seed,
            stop=p.stop,
            ignore_eos=p.ignore_eos,
            on_text=lambda text: job._post("text", text),
            on_first_token=lambda: self._first_token(job),
            cancel=job._cancel,
            deadline=job.deadline,
        )
        with self._cond:
            self._stats.started += 1
            self._stats.queue_seconds += time.perf_counter() - job.submitted
            self._running[job.decoding] = job
        job.started = True
        job._post("start")
        try:
            ended = self.batch.admit(job.decoding)
        except Exception as e:  # this job fails; the batch is unchanged
            with self._cond:
                del self._running[job.decoding]
            self._fail(job, e)
            return
        if ended:
            self._finish(job.decoding)

    def _prefill_step(self) -> None:
        """The next part of a newcomer's prompt, between two steps of the batch (--prefill-chunk)."""
        prefilling = self.batch.prefilling
        if prefilling is None:
            return
        try:
            ended = self.batch.prefill_step()
        except Exception as e:  # this job fails; the batch is unchanged
            with self._cond:
                job = self._running.pop(prefilling.decoding)
            self._fail(job, e)
            return
        for decoding in ended:
            self._finish(decoding)

    def _first_token(self, job: Job) -> None:
        seconds = time.perf_counter() - job.submitted
        with self._cond:
            s = self._stats
            s.first_tokens += 1
            s.first_token_seconds += seconds
            s.last_time_to_first_token = seconds

    def _finish(self, decoding: Decoding) -> None:
        result = decoding.result()
        with self._cond:
            job = self._running.pop(decoding)
            s = self._stats
            s.prompt_tokens += result.prompt_tokens
            s.completion_tokens += len(result.token_ids)
            s.generation_seconds += result.seconds
            if len(result.token_ids) > 1:
                s.last_decode_tps = result.decode_tokens_per_second
            if result.finish_reason in ("cancelled", "timeout"):
                s.ended_early[result.finish_reason] += 1
        job._post("done", result)

    def _fail(self, job: Job, e: Exception) -> None:
        with self._cond:
            self._stats.ended_early["error"] += 1
        job._post("error", e)

    def _take_all(self) -> list[Job]:
        """Every running job, out of the batch."""
        with self._cond:
            jobs = list(self._running.values())
            self._running.clear()
        for job in jobs:
            prefilling = self.batch.prefilling is not None and self.batch.prefilling.decoding is job.decoding
            if prefilling or job.decoding in self.batch.running:
                self.batch.drop(job.decoding)
        return jobs
