"""The generation worker: the one thread that runs the model for every request, in arrival order.

The model is not thread-safe, so a single thread runs it: it takes jobs from a first-in first-out queue
into a `batching.BatchGenerator`, which decodes up to `max_batch` of them together (each step reads and
computes every needed expert once for all of them) and prefills each newcomer between steps. Async code
(the HTTP handlers) submits a job and awaits its output; the worker hands each piece of text to the
job's event loop as it is produced. Nothing here knows about HTTP or OpenAI: a handler learns how its
job ended from what `Job.output` yields or raises.

A job asks for one or more answers ("choices": OpenAI's n, and a completions request's list of
prompts); the answers to one prompt join the batch together, sharing that prompt's prefill, when rows
are free and the running sequences' KV budget holds with them (prompt plus max tokens of every row);
until then they wait in the queue. A job whose KV could never fit that budget, or that needs more rows
than the batch has, is refused at submission (`KVBudgetExceeded`, `TooManyChoices`).

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
from .constraints import Constraint, Grammar, Vocabulary
from .generate import Decoding, GenerationResult, TokenLogprob, vocabulary_of
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
    logit_bias: dict[int, float] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    grammar: Grammar | None = None  # the answer must follow it (structured outputs, forced tool calls)
    logprobs: int | None = None  # None: none; k: the chosen token's and the k most likely ones'
    prompt_logprobs: int | None = None  # the same for each prompt token (completions' echo with logprobs)


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


class TooManyChoices(WorkerError):
    """A job whose answers to one prompt need more rows than the batch has (they run together)."""

    def __init__(self, rows: int, max_batch: int):
        super().__init__(f"{rows} answers to one prompt need {rows} batch rows; the server decodes at most {max_batch} together")
        self.rows, self.max_batch = rows, max_batch


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


@dataclass(eq=False)  # a job is equal only to itself (the queue removes jobs by identity)
class Job:
    """One submitted request: its choices (one GenerationParams each), its deadline, and the events the
    worker posts to it.

    Events, in order: ("start",) when the worker takes the job's first choices, then per choice
    ("text", Piece) for each piece of text and ("done", Done) at its end; or ("error", exception), which
    ends the job. The worker posts nothing for a job it skips because it was cancelled or past its
    deadline before its turn: its waiter has given up already, or gives up at the deadline.
    """

    choices: list[GenerationParams]
    timeout: float  # seconds from submission to the last token, queueing included
    deadline: float  # time.monotonic()
    _worker: Worker
    _loop: asyncio.AbstractEventLoop
    _events: asyncio.Queue = field(default_factory=asyncio.Queue)
    _cancel: threading.Event = field(default_factory=threading.Event)
    started: bool = False  # set by the worker thread before it posts "start"
    submitted: float = field(default_factory=time.perf_counter)
    index: dict[Decoding, int] = field(default_factory=dict)  # each admitted choice's decoding -> its index
    admitted: int = 0  # choices taken into the batch so far (in order)
    first_token: bool = False  # any of its choices has a token
    failed: bool = False  # an error was posted: it ended the job

    def group_at(self, start: int) -> list[int]:
        """The choices admitted together from `start` on: that one and those after it with the same prompt."""
        end = start
        while end < len(self.choices) and self.choices[end].prompt_ids == self.choices[start].prompt_ids:
            end += 1
        return list(range(start, end))

    def cancel(self) -> None:
        """Stop the job: out of the queue at once if it waits, after the current token if it runs.
        Harmless on a job that has ended."""
        self._worker._cancel(self)

    async def wait_until_started(self, disconnected: Disconnected | None = None) -> None:
        """Return once the worker has taken the job; raises TimedOut (queued) or ClientGone."""
        kind, _ = await self._next_event(disconnected)
        assert kind == "start", kind  # the worker posts nothing before it

    async def output(self, disconnected: Disconnected | None = None) -> AsyncIterator[Piece | Done]:
        """The job's text, piece by piece as it is generated (choices interleaved), and a Done as each
        choice ends; it returns after the last one.

        Raises TimedOut, ClientGone (when `disconnected()` turns true), ShuttingDown or GenerationFailed;
        each of them has cancelled the job, so the worker is free for the next one by the next token.
        """
        left = len(self.choices)
        while left:
            kind, value = await self._next_event(disconnected)
            if kind == "text":
                yield value
            elif kind == "error":
                raise GenerationFailed(value)
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

    def submit(self, choices: list[GenerationParams], timeout: float) -> Job:
        """Queue a request's choices from the running event loop; raises QueueFull when `max_queue` jobs
        wait, KVBudgetExceeded when a choice's KV could never fit, TooManyChoices when the answers to one
        prompt need more rows than the batch has."""
        job = Job(list(choices), timeout, time.monotonic() + timeout, self, asyncio.get_running_loop())
        if self.batch is not None:
            for p in choices:
                self.batch.check(len(p.prompt_ids) + p.max_tokens)
            start = 0
            while start < len(choices):
                rows = len(job.group_at(start))
                if rows > self.batch.max_batch:
                    raise TooManyChoices(rows, self.batch.max_batch)
                start += rows
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
            while (joining := self._next_joining()) is not None:
                self._admit(*joining)
            self._prefill_step()
            try:
                ended = batch.decode()
            except Exception as e:  # a disk error, a damaged record: the running jobs fail, the worker goes on
                for job in {id(job): job for _, job in self._take_all()}.values():
                    self._fail(job, e)
                continue
            for decoding in ended:
                self._finish(decoding)
            with self._cond:
                s = self._stats
                s.batch_steps, s.batch_rows, s.batch_kv_bytes = batch.stats.steps, batch.stats.rows, batch.kv_bytes()
                s.batch_kv_peak_bytes = max(s.batch_kv_peak_bytes, s.batch_kv_bytes)
        for decoding, job in self._take_all():  # closing: the running jobs end as cancelled
            decoding.finish_reason = "cancelled"
            job._post("done", Done(job.index[decoding], decoding.result()))

    def _next_joining(self) -> tuple[Job, list[int]] | None:
        """The first queued job's next choices (those sharing a prompt) if they may join the batch now
        (FIFO: choices that must wait hold back the rest); the job leaves the queue with its last ones."""
        with self._cond:
            if not self._pending or self._closed:
                return None
            job = self._pending[0]
            group = job.group_at(job.admitted)
            p = job.choices[group[0]]
            if not self.batch.has_room(len(p.prompt_ids) + p.max_tokens, len(group)):
                return None
            job.admitted += len(group)
            if job.admitted == len(job.choices):
                self._pending.popleft()
            return job, group

    def _admit(self, job: Job, group: list[int]) -> None:
        """Start choices of a job taken from the queue: their prompt's prefill and their first tokens
        (they may end right there)."""
        if job._cancel.is_set() or time.monotonic() >= job.deadline:
            return  # its waiter has given up, or gives up at the deadline (timed out in the queue)
        try:
            decodings = [self._decoding(job, i) for i in group]
        except Exception as e:  # a grammar that fails to compile against the vocabulary
            self._fail(job, e)
            return
        with self._cond:
            if not job.started:
                self._stats.started += 1
                self._stats.queue_seconds += time.perf_counter() - job.submitted
            for decoding in decodings:
                self._running[decoding] = job
        if not job.started:
            job.started = True
            job._post("start")
        try:
            ended = self.batch.admit(decodings[0], decodings[1:])
        except Exception as e:  # this job fails; the batch is unchanged
            with self._cond:
                for decoding in decodings:
                    del self._running[decoding]
            self._fail(job, e)
            return
        for decoding in ended:
            self._finish(decoding)

    def _decoding(self, job: Job, index: int) -> Decoding:
        p = job.choices[index]
        constraint = None
        if p.grammar is not None:
            constraint = Constraint(p.grammar, self.vocabulary())
        decoding = Decoding(
            self.model,
            self.tokenizer,
            p.prompt_ids,
            p.max_tokens,
            temperature=p.temperature,
            top_p=p.top_p,
            seed=p.seed,
            stop=p.stop,
            ignore_eos=p.ignore_eos,
            logit_bias=p.logit_bias,
            presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty,
            constraint=constraint,
            logprobs=p.logprobs,
            prompt_logprobs=p.prompt_logprobs,
            on_text=lambda text: job._post("text", Piece(index, text, decoding.take_logprobs())),
            on_first_token=lambda: self._first_token(job),
            cancel=job._cancel,
            deadline=job.deadline,
        )
        job.index[decoding] = index
        return decoding

    def vocabulary(self) -> Vocabulary:
        """The grammar engine's view of this model's tokenizer (built once, on first use)."""
        return vocabulary_of(self.model, self.tokenizer)

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
                for sibling in prefilling.siblings:
                    del self._running[sibling]
            self._fail(job, e)
            return
        for decoding in ended:
            self._finish(decoding)

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
        job._post("done", Done(job.index[decoding], result))

    def _fail(self, job: Job, e: Exception) -> None:
        """End the job with an error: once, whichever of its choices met it; its other choices stop
        (queued ones leave the queue, running ones end after their current token)."""
        job._cancel.set()
        with self._cond:
            if job in self._pending:
                self._pending.remove(job)
            if job.failed:
                return
            job.failed = True
            self._stats.ended_early["error"] += 1
        job._post("error", e)

    def _take_all(self) -> list[tuple[Decoding, Job]]:
        """Every running choice and its job, out of the batch."""
        with self._cond:
            running = list(self._running.items())
            self._running.clear()
        for decoding, _ in running:
            prefilling = self.batch.prefilling
            if decoding in self.batch.running or (prefilling is not None and prefilling.decoding is decoding):
                self.batch.drop(decoding)  # (a newcomer's siblings join only with it)
        return running
