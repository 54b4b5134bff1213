"""The serving scheduler: every sequence the model generates for requests, queued, prefilling or running,
in one place, in the shape of vLLM's engine core: `add(request)`, `abort(request)`, `step() -> events`.

A request asks for one or more answers ("choices": OpenAI's n, and a completions request's list of
prompts). The answers to one prompt are a group: they join the batch together, sharing that prompt's
prefill (`BatchGenerator.admit`'s siblings), once rows are free and the running sequences' KV budget
holds with them (prompt plus max tokens of every row). Groups join first come, first served: one that
must wait holds back those behind it. A request whose KV could never fit the budget, or whose group
needs more rows than the batch has, is refused by `add` (`KVBudgetExceeded`, `TooManyChoices`).

Each answer is a `generate.Decoding`, made when its group joins (`Request.make`; a grammar is compiled
then, on the thread that steps). Its text reaches the caller through the decoding's own callbacks, as it
is produced; `step` returns what else happened: `Started` (a request's first group joined), `Finished`
(an answer ended: its decoding's result says how), `Failed` (the request met an error; once per request).

Cancellation, deadlines and errors, handled here once:
- a request's cancel flag and deadline are its decodings' (checked after every token), and a request
  that is cancelled or past its deadline before its turn is skipped when it comes up;
- `abort` takes a queued request out of the queue at once (a running one stops after its token);
- an error while a group prefills fails that request, the batch unchanged; an error in a batched step
  fails every running request (the batch's KV is then incomplete); a failed request's other answers stop.

A step is three parts, each testable alone, in the shape of vLLM's engine core: `schedule()` decides it from
the queue and the batch (a `StepPlan`: which group joins, whether and how much of the newcomer's prompt is
fed, which rows decode), `run(plan)` does its model work (forward passes, tokens chosen: a `StepOutput`),
`update(plan, output)` applies it (tokens accepted, so text flows; rows joined and retired; events; only a
request's `Started` is sent by `run`, as its prefill begins). A group
that joins this step prefills now, and its rows decode from the next step on.

One thread steps the scheduler (the model is not thread-safe); `add`, `abort` and the counts may be
called from any thread.

This is the one loop that generates: the server's worker and `chat` step a scheduler of their own,
`generate_batch` (the Python API) one for its prompts, and `stream` a one-row one for a single sequence,
which `generate`, `timed` (bench, plan, demo, the benchmarks) and `teacher_forced` (trace, eval) run.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from ..core.runtime import runtime_of
from .batching import BatchGenerator, Part
from .generate import Decoding, GenerationResult, SamplingParams, encode, token_list
from .kv_cache import PrefixCache


class TooManyChoices(Exception):
    """A request whose answers to one prompt need more rows than the batch has (they run together)."""

    def __init__(self, rows: int, max_batch: int):
        super().__init__(f"{rows} answers to one prompt need {rows} batch rows; the server decodes at most {max_batch} together")
        self.rows, self.max_batch = rows, max_batch


@dataclass(eq=False)  # a request is equal only to itself (the queue removes requests by identity)
class Request:
    """What to generate: `make(i)` builds answer i's decoding (with this request's `cancel` flag and
    `deadline`); `prompts[i]` and `positions[i]` (prompt plus max new tokens) size it before it exists.
    `tag` is the caller's (the server's job)."""

    make: Callable[[int], Decoding]
    prompts: list[list[int]]
    positions: list[int]
    cancel: threading.Event = field(default_factory=threading.Event)
    deadline: float | None = None  # time.monotonic()
    tag: object = None
    groups: list[list[int]] = field(init=False)  # answers that share a prompt, in order
    index: dict[Decoding, int] = field(default_factory=dict)  # each made decoding -> its answer's index
    joined: int = 0  # groups taken from the queue so far
    started: bool = False
    failed: bool = False

    def __post_init__(self) -> None:
        self.groups, start = [], 0
        while start < len(self.prompts):
            end = start + 1
            while end < len(self.prompts) and self.prompts[end] == self.prompts[start]:
                end += 1
            self.groups.append(list(range(start, end)))
            start = end

    @staticmethod
    def of(decoding: Decoding) -> Request:
        """A request for one answer, `decoding` (made already), with its cancel flag and deadline."""
        return Request(
            lambda _: decoding,
            [decoding.prompt_ids],
            [len(decoding.prompt_ids) + decoding.params.max_tokens],
            cancel=decoding.cancel if decoding.cancel is not None else threading.Event(),
            deadline=decoding.deadline,
        )

    def expired(self) -> bool:
        return self.cancel.is_set() or (self.deadline is not None and time.monotonic() >= self.deadline)


@dataclass(frozen=True)
class Started:
    """The request's first answers joined the batch."""

    request: Request


@dataclass(frozen=True)
class Finished:
    """An answer ended; `decoding.result()` says how (its finish_reason: stop, length, cancelled, timeout)."""

    request: Request
    decoding: Decoding


@dataclass(frozen=True)
class Failed:
    """The request met an error: it ends, and its other answers stop."""

    request: Request
    error: Exception


Event = Started | Finished | Failed


@dataclass
class StepPlan:
    """What one step does, decided before any of it runs (`Scheduler.schedule`)."""

    join: tuple[Request, list[int]] | None = None  # a group whose prefill starts now: (its request, its answers)
    prefill: bool = False  # the newcomer's next part is fed (the joining group's, or the one already prefilling)
    prefill_tokens: int | None = None  # how many prompt tokens that part is (None: the rest of the prompt)
    decode: list[Decoding] = field(default_factory=list)  # the running rows, one token each


@dataclass
class StepOutput:
    """What running a plan gave (`Scheduler.run`): tokens chosen, not yet accepted, and errors met."""

    joined: list[Decoding] = field(default_factory=list)  # the joining group's decodings, as made
    join_error: Exception | None = None  # making them failed (a grammar that does not compile)
    prefilled: object = None  # the newcomer that was fed (batching._Prefill)
    part: Part | None = None  # what feeding it gave
    prefill_error: Exception | None = None  # its prefill failed: it is dropped, the batch unchanged
    tokens: list[int] | None = None  # one per planned decode row
    decode_error: Exception | None = None  # the batched step failed: every running row is dropped
    events: list = field(default_factory=list)  # sent while running: a joining request's Started


class Closed(Exception):
    """The error of a request that was still queued when the scheduler closed: it never ran."""


class Scheduler:
    """Queued requests, the newcomer being prefilled and the running sequences (with their KV budget, in
    `batch`); see the module's doc. Options are `BatchGenerator`'s."""

    def __init__(self, model, *, listener: Callable[[Event], None] | None = None, **batch_options):
        """`listener`, if given, hears each event as it happens, before `step` goes on: a request's
        `Started` comes before the text its first token posts (through its decoding's callbacks).
        `batch_options`: BatchGenerator's (max_batch, prefix_cache, kv_budget_bytes, prefill_chunk)."""
        self.listener = listener
        self.batch = BatchGenerator(model, **batch_options)
        self._lock = threading.Lock()  # guards _waiting (add and abort come from other threads)
        self._waiting: deque[Request] = deque()
        self._owner: dict[Decoding, Request] = {}  # every answer prefilling or running -> its request

    # -- any thread -------------------------------------------------------------------------------------

    def check(self, request: Request) -> None:
        """Raise KVBudgetExceeded or TooManyChoices if the request could never run."""
        for positions in request.positions:
            self.batch.check(positions)
        for group in request.groups:
            if len(group) > self.batch.max_batch:
                raise TooManyChoices(len(group), self.batch.max_batch)

    def add(self, request: Request) -> None:
        """Queue a request, `check`ed first (a caller with checks of its own to order, as the server's queue
        bound, may call `check` before; it costs a comparison per answer)."""
        self.check(request)
        with self._lock:
            self._waiting.append(request)

    def abort(self, request: Request) -> bool:
        """Stop a request: out of the queue at once if it waits (True), after the current token if it runs."""
        request.cancel.set()
        with self._lock:
            if request in self._waiting:
                self._waiting.remove(request)
                return True
        return False

    def queued(self) -> int:
        with self._lock:
            return len(self._waiting)

    def running(self) -> int:
        return len(self._owner)

    def idle(self) -> bool:
        return not self._owner and not self.queued()

    # -- the stepping thread ----------------------------------------------------------------------------

    def step(self) -> list[Event]:
        """One step: `schedule` it, `run` it, `update` from what it gave."""
        plan = self.schedule()
        return self.update(plan, self.run(plan))

    def schedule(self) -> StepPlan:
        """What the next step does, decided from the queue and the batch alone (no model call): the first
        queued group that may join does (its prompt fed whole when nobody is running, else `prefill_chunk`
        tokens a step), the newcomer's next part is fed, and every running sequence takes one token.
        Requests cancelled or past their deadline before their turn leave the queue unrun."""
        batch = self.batch
        join = None
        while batch.prefilling is None and (candidate := self._next_group()) is not None:
            if not (candidate[0].expired() or candidate[0].failed):  # (else its caller has given up)
                join = candidate
                break
        prefilling = join is not None or batch.prefilling is not None
        return StepPlan(
            join=join,
            prefill=prefilling,
            prefill_tokens=batch.prefill_chunk if batch.running else None,
            decode=list(batch.running),
        )

    def run(self, plan: StepPlan) -> StepOutput:
        """Run a plan's model work: the joining group's decodings made and its prefill started, the
        newcomer's part fed (and its first tokens chosen once its prompt is in), the running rows' next
        tokens chosen. Nothing is accepted here (`update` does that); an error is kept in the output, the
        batch left as each part's doc says. The one event sent here is a joining request's `Started`, as its
        prefill begins."""
        out = StepOutput()
        batch = self.batch
        if plan.join is not None:
            request, group = plan.join
            try:
                out.joined = [request.make(i) for i in group]
            except Exception as e:  # a grammar that fails to compile against the vocabulary
                out.join_error = e
            else:
                for i, decoding in zip(group, out.joined):
                    request.index[decoding] = i
                    self._owner[decoding] = request
                if not request.started:  # now, not at `update`: its caller learns it runs before a long prefill ends
                    request.started = True
                    self._emit(Started(request), out.events)
                try:
                    batch.start(out.joined[0], out.joined[1:])
                except Exception as e:
                    out.prefill_error = e
        if plan.prefill and batch.prefilling is not None and out.prefill_error is None:
            out.prefilled = batch.prefilling
            try:
                out.part = batch.feed(plan.prefill_tokens)
            except Exception as e:  # the newcomer is dropped; the batch is unchanged
                out.prefill_error = e
        if plan.decode:
            try:
                out.tokens = batch.choose_next()
            except Exception as e:  # a disk error, a damaged record: every running row fails
                out.decode_error = e
        return out

    def update(self, plan: StepPlan, out: StepOutput) -> list[Event]:
        """Apply what a step gave (after the `Started` that `run` sent): every running row's token accepted,
        then the newcomer's first tokens (it joins the batch, or ends); `Finished` for each answer that ended,
        `Failed` for each request that met an error."""
        events = out.events
        if out.join_error is not None:
            self._fail(plan.join[0], out.join_error, events)
        # The running rows first: the newcomer joins their batch after their step (its row is not in it).
        if out.decode_error is not None:
            failed = {id(r): r for d in plan.decode if (r := self._owner.pop(d, None)) is not None}
            for request in failed.values():
                self._fail(request, out.decode_error, events)
        elif out.tokens is not None:
            self._finished(self.batch.accept_next(out.tokens), events)
        if out.prefill_error is not None:
            newcomer = out.prefilled
            decodings = [newcomer.decoding, *newcomer.siblings] if newcomer is not None else out.joined
            request = self._owner[decodings[0]]
            for decoding in decodings:
                del self._owner[decoding]
            self._fail(request, out.prefill_error, events)
        elif out.part is not None:
            ended = out.part.interrupted if out.part.first_tokens is None else self.batch.join(out.part.first_tokens)
            self._finished(ended, events)
        return events

    def close(self) -> list[Event]:
        """Stop everything: queued requests fail with Closed (`Failed`: their waiters hear it), running answers
        end as cancelled (`Finished`)."""
        with self._lock:
            queued = list(self._waiting)
            self._waiting.clear()
        events: list[Event] = []
        for request in queued:
            if not request.started:  # (a request partly joined fails with its running answers below)
                self._fail(request, Closed("the scheduler closed before the request ran"), events)
        for decoding, request in self._take_all():
            request.cancel.set()
            decoding.finish_reason = "cancelled"
            self._emit(Finished(request, decoding), events)
        return events

    def _next_group(self) -> tuple[Request, list[int]] | None:
        """The first queued request's next group, if it may join the batch now; the request leaves the
        queue with its last group."""
        with self._lock:
            if not self._waiting:
                return None
            request = self._waiting[0]
            group = request.groups[request.joined]
            if not self.batch.has_room(request.positions[group[0]], len(group)):
                return None
            request.joined += 1
            if request.joined == len(request.groups):
                self._waiting.popleft()
            return request, group

    def _emit(self, event: Event, events: list[Event]) -> None:
        if self.listener is not None:
            self.listener(event)
        events.append(event)

    def _finished(self, ended: list[Decoding], events: list[Event]) -> None:
        for decoding in ended:
            self._emit(Finished(self._owner.pop(decoding), decoding), events)

    def _fail(self, request: Request, error: Exception, events: list[Event]) -> None:
        """End the request with an error, once, whichever of its answers met it; its other answers stop
        (queued groups leave the queue, running answers end after their current token)."""
        request.cancel.set()
        with self._lock:
            if request in self._waiting:
                self._waiting.remove(request)
        if request.failed:
            return
        request.failed = True
        self._emit(Failed(request, error), events)

    def _take_all(self) -> list[tuple[Decoding, Request]]:
        """Every prefilling or running answer and its request, out of the batch."""
        running = list(self._owner.items())
        self._owner.clear()
        for decoding, _ in running:
            prefilling = self.batch.prefilling
            if decoding in self.batch.running or (prefilling is not None and prefilling.decoding is decoding):
                self.batch.drop(decoding)  # (a newcomer's siblings join only with it)
        return running


def generate_batch(
    model,
    tokenizer,
    prompts: Sequence[str | Sequence[int]],
    params: SamplingParams | int = 64,
    *,
    max_batch: int = 8,
    prefix_cache: PrefixCache | None = None,
    seeds: Sequence[int | None] | None = None,
) -> list[GenerationResult]:
    """Generate a continuation of every prompt (text, or token ids), up to `max_batch` at a time, and
    return their results in the prompts' order. `params`: how (a number is max_tokens, sampled at
    temperature 1); `seeds`, one per prompt, replace its seed for each, so a seeded prompt gets the text it
    would get alone. Each prompt is one request of a `Scheduler`, stepped here until every one has
    ended; an error ends them all and is raised."""
    params = SamplingParams(params) if isinstance(params, int) else params
    seeds = list(seeds) if seeds is not None else [params.seed] * len(prompts)
    if len(seeds) != len(prompts):
        raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
    decodings = [
        Decoding(model, tokenizer, encode(tokenizer, p) if isinstance(p, str) else list(p), replace(params, seed=s))
        for p, s in zip(prompts, seeds)
    ]
    scheduler = Scheduler(model, max_batch=max_batch, prefix_cache=prefix_cache)
    for d in decodings:
        scheduler.add(Request.of(d))
    run_until_idle(scheduler)
    return [d.result() for d in decodings]


def stream(
    model, tokenizer, prompt_ids: Sequence[int], params: SamplingParams, *, prefix_cache: PrefixCache | None = None, **callbacks
) -> GenerationResult:
    """One sequence, alone: the prompt in one forward pass, then each new token with the KV cache, through
    a one-row scheduler (the loop every generation runs). `callbacks` are `Decoding`'s (on_text,
    on_first_token, on_logits, cancel, deadline). `prefix_cache`: start from the longest prefix it holds,
    and keep this sequence's KV there. The model is not touched otherwise: statistics keep accumulating."""
    decoding = Decoding(model, tokenizer, prompt_ids, params, **callbacks)
    scheduler = Scheduler(model, max_batch=1, prefix_cache=prefix_cache)
    scheduler.add(Request.of(decoding))
    run_until_idle(scheduler)
    return decoding.result()


def timed(
    model, prompt_ids, new_tokens: int, *, forced: Sequence[int] | None = None, on_first_token: Callable[[], None] | None = None
) -> GenerationResult:
    """Greedy (or the `forced` tokens: teacher forcing), exactly `new_tokens` tokens, no text: the run that
    `bench` (and its peers), `plan --compute measure` and the benchmarks time."""
    return stream(model, None, prompt_ids, SamplingParams.timed(new_tokens, forced), on_first_token=on_first_token)


def teacher_forced(model, ids: Sequence[int], prefill: int = 0, on_logits: Callable | None = None) -> int:
    """Feed the given token ids through the model as generating exactly them would: the first `prefill`
    ids (at least one) as the prompt, every later id alone with the KV cache, whatever the model would
    have chosen. `on_logits` sees each forward pass's next-token logits [vocab] (`eval --decode`); a
    routing trace wants only the passes' side effects. Returns the number of forward passes."""
    ids = token_list(ids)
    prompt = max(1, min(prefill, len(ids)))
    forced = ids[prompt:] + [0]  # the last token is chosen, never fed: any will do
    passes = len(forced)
    stream(model, None, ids[:prompt], SamplingParams.timed(passes, forced), on_logits=on_logits)
    return passes


def generate(model, tokenizer, prompt: str, params: SamplingParams, *, echo: bool = False) -> GenerationResult:
    """`moestream generate`: one prompt, statistics of this run only, text printed as it comes if `echo`."""
    runtime = runtime_of(model)
    runtime.reset_stats()

    def show(piece: str) -> None:
        print(piece, end="", flush=True)

    result = stream(model, tokenizer, encode(tokenizer, prompt), params, on_text=show if echo else None)
    if echo:
        print(flush=True)
    result.stats = runtime.stats()
    return result


def run_until_idle(scheduler: Scheduler) -> None:
    """Step `scheduler` until every request it holds has ended (`generate_batch`, `chat`: callers that wait
    for their answers on the stepping thread). The first request to fail stops everything (`close`), and
    its error is raised."""
    while not scheduler.idle():
        for event in scheduler.step():
            if isinstance(event, Failed):
                scheduler.close()
                raise event.error
