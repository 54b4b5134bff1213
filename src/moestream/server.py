"""`moestream serve`: an OpenAI-compatible HTTP API (FastAPI + uvicorn, the `moestream[server]` extra).

Endpoints: GET /v1/models, POST /v1/chat/completions, POST /v1/completions (both with `stream` true:
server-sent events ending in `data: [DONE]`, or false), GET /health, GET /metrics (Prometheus text).

How requests run: the model is not thread-safe and one sequence at a time is what a streamed-expert
machine affords, so a single worker thread runs generations one after another, taking requests from a
first-in first-out queue. The async endpoints only parse, validate, tokenize and wait: a request's
text reaches its handler through an asyncio queue as the worker produces it. Each generation seeds
torch's generator right before it starts (a random seed when the request has none), and the expert
cache never changes results (docs/ARCHITECTURE.md, "One decode step"), so an answer is the same
whether the request ran alone or behind nineteen others. A client that disconnects, or a request past
its timeout, sets its cancel flag: a queued request leaves the queue at once, a running one stops after
the current token. Every failure is an OpenAI-style error object with a 4xx/5xx status; nothing a
client sends can stop the server.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import socket
import threading
import time
import uuid
from collections import deque
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from .generate import GenerationResult, chat_prompt, context_length, encode, stream
from .memory import current_rss_bytes, peak_rss_bytes
from .loading import engine_of

# A request body larger than this is refused (413) before it is parsed: prompts are text, and a body
# of gigabytes would otherwise be read into memory.
MAX_BODY_BYTES = 16 * 2**20
# OpenAI's limit on stop sequences per request.
MAX_STOP_SEQUENCES = 4
# How often a waiting non-streaming handler checks whether its client is still connected.
DISCONNECT_POLL_SECONDS = 0.2


class APIError(Exception):
    """An error answered as OpenAI does: {"error": {"message", "type", "param", "code"}} with `status`."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.body = {"error": {"message": message, "type": type, "param": param, "code": code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body, status_code=self.status)


# -- requests ---------------------------------------------------------------------------------------------


class _Strict(BaseModel):
    # Strict types: "10" is not a number and 1.5 is not an integer, as in OpenAI's API. Fields we do not
    # know (presence_penalty, user, ...) are ignored so that existing clients work unchanged.
    model_config = ConfigDict(strict=True, extra="ignore")


class _ContentPart(_Strict):
    type: str
    text: str | None = None


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[_ContentPart] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise APIError(400, f"message content of type {part.type!r} is not supported; send text", param="messages")
            parts.append(part.text)
        return "".join(parts)


class _StreamOptions(_Strict):
    include_usage: bool = False


class _Common(_Strict):
    model: str
    max_tokens: int | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: _StreamOptions | None = None
    n: int | None = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None  # newer clients send this instead of max_tokens


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int]
    echo: bool | None = None


# -- the generation worker ----------------------------------------------------------------------------------


@dataclass(eq=False)  # a job is equal only to itself (the queue removes jobs by identity)
class Job:
    """One request's generation: what to run, and where its events go."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop: list[str]
    deadline: float  # time.monotonic()
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)
    started: bool = False
    stream: bool = False  # answer with server-sent events
    stream_usage: bool = False  # stream_options.include_usage: one more event with token counts

    def post(self, kind: str, value=None) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:
            pass  # the event loop has closed: the server is shutting down and nobody waits any more


class QueueFull(Exception):
    pass


class ClientGone(Exception):
    """The client disconnected while its request waited: nobody reads an answer any more."""


class Worker:
    """The one thread that runs the model, fed in arrival order."""

    def __init__(self, model, tokenizer, max_queue: int):
        self.model = model
        self.tokenizer = tokenizer
        self.max_queue = max_queue
        self._pending: deque[Job] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self.running: Job | None = None
        self.counters = {"cancelled": 0, "timeout": 0, "error": 0}
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.generation_seconds = 0.0
        self.last_decode_tps = 0.0
        self._thread = threading.Thread(target=self._loop, name="moestream-generate", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            for job in self._pending:
                job.cancel.set()
            if self.running is not None:
                self.running.cancel.set()
            self._cond.notify_all()
        self._thread.join(timeout=30)

    def queued(self) -> int:
        return len(self._pending)

    def submit(self, job: Job) -> int:
        """Queue `job`; returns how many requests are ahead of it."""
        with self._cond:
            if len(self._pending) >= self.max_queue:
                raise QueueFull
            ahead = len(self._pending) + (self.running is not None)
            self._pending.append(job)
            self._cond.notify()
            return ahead

    def cancel(self, job: Job) -> None:
        """Stop `job`: out of the queue at once if it waits, after the current token if it runs."""
        job.cancel.set()
        with self._cond:
            if job in self._pending:
                self._pending.remove(job)
                self.counters["cancelled"] += 1

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                job = self._pending.popleft()
                self.running = job
            try:
                self._run(job)
            finally:
                with self._cond:
                    self.running = None

    def _run(self, job: Job) -> None:
        if job.cancel.is_set() or time.monotonic() >= job.deadline:
            return  # its handler answers (or has answered) 503: it timed out in the queue
        job.started = True
        job.post("start")
        try:
            result = stream(
                self.model,
                self.tokenizer,
                job.prompt_ids,
                job.max_tokens,
                temperature=job.temperature,
                top_p=job.top_p,
                seed=job.seed,
                stop=job.stop,
                on_text=lambda text: job.post("text", text),
                cancel=job.cancel,
                deadline=job.deadline,
            )
        except Exception as e:  # a disk error, a damaged record: this request fails, the server goes on
            with self._cond:
                self.counters["error"] += 1
            job.post("error", APIError(500, f"generation failed: {e}", type="server_error"))
            return
        self.prompt_tokens += result.prompt_tokens
        self.completion_tokens += len(result.token_ids)
        self.generation_seconds += result.seconds
        if len(result.token_ids) > 1:
            self.last_decode_tps = result.decode_tokens_per_second
        if result.finish_reason in ("cancelled", "timeout"):
            with self._cond:
                self.counters[result.finish_reason] += 1
        job.post("done", result)


# -- the app ------------------------------------------------------------------------------------------------


@dataclass
class ServerConfig:
    model_name: str
    max_queue: int = 64
    request_timeout: float = 600.0  # seconds from arrival to the last token, queueing included
    default_max_tokens: int = 512  # for a chat request that names no limit (completions: OpenAI's 16)


def _error_from_validation(e: ValidationError) -> APIError:
    first = e.errors()[0]
    loc = [str(x) for x in first.get("loc", ())]
    # pydantic names the union branch it tried last ("stop.str"): report the field the client sent.
    param = ".".join(x for x in loc if x not in ("str", "list[str]", "list[int]", "list[_ContentPart]", "float", "int"))
    return APIError(400, f"invalid value for '{param}': {first.get('msg')}", param=param or None, code="invalid_value")


async def _read_json(request: Request) -> dict:
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise APIError(413, f"the request body is larger than {MAX_BODY_BYTES // 2**20} MiB", code="request_too_large")
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as e:  # RecursionError: arrays nested thousands deep
        raise APIError(400, f"the request body is not valid JSON ({type(e).__name__}: {e}); send a JSON object", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    return data


def create_app(model, tokenizer, config: ServerConfig) -> FastAPI:
    """The FastAPI app serving `model` (loaded by moestream.load) under the name `config.model_name`."""
    worker = Worker(model, tokenizer, config.max_queue)
    engine = engine_of(model)
    context = context_length(model)
    created = int(time.time())
    counts: dict[tuple[str, str], int] = {}

    @asynccontextmanager
    async def lifespan(app):
        worker.start()
        try:
            yield
        finally:
            await asyncio.to_thread(worker.close)

    app = FastAPI(title="moestream", version="1", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.worker = worker

    def count(endpoint: str, outcome: str) -> None:
        counts[(endpoint, outcome)] = counts.get((endpoint, outcome), 0) + 1

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return e.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e: StarletteHTTPException):
        return APIError(e.status_code, str(e.detail), code="not_found" if e.status_code == 404 else None).response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, e: RequestValidationError):
        return APIError(400, f"invalid request: {e.errors()[:1]}").response()

    @app.exception_handler(Exception)
    async def _unexpected(request, e: Exception):
        return APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error").response()

    def check_model(name: str) -> None:
        if name != config.model_name:
            raise APIError(
                404,
                f"the model '{name}' does not exist; this server serves '{config.model_name}' (GET /v1/models)",
                param="model",
                code="model_not_found",
            )

    def tokenize(text: str, templated: bool, param: str) -> list[int]:
        try:
            return encode(tokenizer, text, templated=templated)
        except Exception as e:  # e.g. a lone UTF-16 surrogate ("\ud800") that JSON allows and no tokenizer takes
            raise APIError(400, f"the text cannot be tokenized ({type(e).__name__}: {e}); send valid Unicode text", param=param) from None

    def make_job(req: _Common, prompt_ids: list[int], default_max: int) -> Job:
        if req.n not in (None, 1):
            raise APIError(400, "only n=1 is supported: send one request per answer", param="n")
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if len(stops) > MAX_STOP_SEQUENCES or any(not s for s in stops):
            raise APIError(400, f"'stop' takes up to {MAX_STOP_SEQUENCES} non-empty strings", param="stop")
        if req.seed is not None and not -(2**63) <= req.seed < 2**64:
            raise APIError(400, "'seed' must fit in 64 bits", param="seed")
        if not prompt_ids:
            raise APIError(400, "the prompt is empty: send at least one character", param="prompt")
        limit = context or 2**31
        requested = getattr(req, "max_completion_tokens", None)
        requested = req.max_tokens if requested is None else requested
        if requested is not None and not 1 <= requested <= limit:
            raise APIError(
                400, f"'max_tokens' must be between 1 and {limit} (the model's context length), not {requested}",
                param="max_tokens", code="invalid_value",
            )
        if len(prompt_ids) >= limit or (requested is not None and len(prompt_ids) + requested > limit):
            raise APIError(
                400,
                f"this model's maximum context length is {limit} tokens; the request has {len(prompt_ids)} in the "
                f"prompt and asks for {requested or 1} more: shorten the prompt or lower max_tokens",
                param="messages" if isinstance(req, ChatCompletionRequest) else "prompt",
                code="context_length_exceeded",
            )
        max_tokens = requested or min(default_max, limit - len(prompt_ids))
        return Job(
            prompt_ids=prompt_ids,
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            # A request without a seed gets a fresh one, so it never depends on what ran before it.
            seed=secrets.randbits(63) if req.seed is None else req.seed % 2**64,
            stop=stops,
            deadline=time.monotonic() + config.request_timeout,
            loop=asyncio.get_running_loop(),
        )

    async def next_event(job: Job, request: Request | None):
        """The job's next event; gives up (and cancels the job) when the client leaves or time is up."""
        while True:
            remaining = job.deadline - time.monotonic()
            if remaining <= 0:
                worker.cancel(job)
                if job.started:
                    raise APIError(504, f"the request ran longer than the server's timeout ({config.request_timeout:g} s)", type="timeout", code="timeout")
                raise APIError(503, f"the request waited longer than the server's timeout ({config.request_timeout:g} s) in the queue: the server is busy, retry later", type="server_busy", code="timeout")
            try:
                return await asyncio.wait_for(job.events.get(), min(remaining, DISCONNECT_POLL_SECONDS))
            except asyncio.TimeoutError:
                if request is not None and await request.is_disconnected():
                    worker.cancel(job)
                    raise ClientGone from None

    def submit(job: Job) -> None:
        try:
            worker.submit(job)
        except QueueFull:
            raise APIError(429, f"{worker.max_queue} requests are already queued; retry later", type="server_busy", code="queue_full") from None

    def usage(result: GenerationResult) -> dict:
        n = len(result.token_ids)
        return {"prompt_tokens": result.prompt_tokens, "completion_tokens": n, "total_tokens": result.prompt_tokens + n}

    async def run(endpoint: str, request: Request, job: Job, chunk, final):
        """Queue `job` and answer: one JSON object made by `final(text, result)`, or server-sent events of
        `chunk(text, None)` pieces (`chunk("", None)` opens the stream; None skips it) and `chunk(None, result)`."""
        submit(job)
        try:
            if not job.stream:
                pieces = []
                while True:
                    kind, value = await next_event(job, request)
                    if kind == "text":
                        pieces.append(value)
                    elif kind == "error":
                        raise value
                    elif kind == "done":
                        if value.finish_reason == "cancelled":  # only the server's shutdown cancels a request here
                            raise APIError(503, "the server is shutting down", type="server_error")
                        if value.finish_reason == "timeout":
                            raise APIError(504, f"the request ran longer than the server's timeout ({config.request_timeout:g} s)", type="timeout", code="timeout")
                        count(endpoint, "ok")
                        return JSONResponse(final("".join(pieces), value))
            # Streaming: wait until the worker takes the request, so that a request refused or timed out in
            # the queue still gets an error status instead of a 200 stream.
            await next_event(job, request)  # "start": the worker posts nothing before it
        except ClientGone:
            count(endpoint, "cancelled")
            return Response(status_code=499)  # nobody reads it; nginx's code for "client closed request"
        except asyncio.CancelledError:
            count(endpoint, "cancelled")
            worker.cancel(job)
            raise
        except APIError:
            count(endpoint, "error")
            worker.cancel(job)
            raise

        async def events():
            outcome = "cancelled"
            try:
                opening = chunk("", None)
                if opening is not None:
                    yield _sse(opening)
                while True:
                    kind, value = await next_event(job, None)
                    if kind == "text":
                        yield _sse(chunk(value, None))
                    elif kind == "error":
                        raise value
                    elif kind == "done":
                        if value.finish_reason == "cancelled":
                            raise APIError(503, "the server is shutting down", type="server_error")
                        if value.finish_reason == "timeout":
                            raise APIError(504, f"the request ran longer than the server's timeout ({config.request_timeout:g} s)", type="timeout", code="timeout")
                        yield _sse(chunk(None, value))
                        if job.stream_usage:
                            yield _sse({**chunk(None, None), "choices": [], "usage": usage(value)})
                        outcome = "ok"
                        break
            except APIError as e:  # the status line went out already: the error travels as an event
                outcome = "error"
                yield _sse(e.body)
            finally:
                # Also reached when the client disconnects: starlette cancels this generator's task.
                worker.cancel(job)
                count(endpoint, outcome)
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": config.model_name, "queued": worker.queued(), "running": worker.running is not None}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model_card(config.model_name, created)]}

    @app.get("/v1/models/{name:path}")
    async def model_card(name: str):
        check_model(name)
        return _model_card(config.model_name, created)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        try:
            req = ChatCompletionRequest.model_validate(await _read_json(request))
            check_model(req.model)
            messages = [{"role": m.role, "content": m.text()} for m in req.messages]
            try:
                prompt = chat_prompt(tokenizer, messages)
            except Exception as e:  # a template that rejects these messages (roles out of order, ...)
                raise APIError(400, f"the chat template cannot format these messages: {e}", param="messages") from None
            job = make_job(req, tokenize(prompt, True, "messages"), config.default_max_tokens)
        except ValidationError as e:
            count("chat", "error")
            raise _error_from_validation(e) from None
        except APIError:
            count("chat", "error")
            raise
        job.stream = req.stream
        job.stream_usage = bool(req.stream_options and req.stream_options.include_usage)
        ident, now = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(text, result):
            delta = {} if text is None else {"content": text}
            if text == "" and result is None:
                delta = {"role": "assistant", "content": ""}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": _finish(result) if result else None}
            return {"id": ident, "object": "chat.completion.chunk", "created": now, "model": config.model_name, "choices": [choice]}

        def final(text, result):
            return {
                "id": ident,
                "object": "chat.completion",
                "created": now,
                "model": config.model_name,
                "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": _finish(result)}
                ],
                "usage": usage(result),
            }

        return await run("chat", request, job, chunk, final)

    @app.post("/v1/completions")
    async def completions(request: Request):
        try:
            req = CompletionRequest.model_validate(await _read_json(request))
            check_model(req.model)
            if req.echo:
                raise APIError(400, "echo is not supported", param="echo")
            prompt = req.prompt
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
                if len(prompt) != 1:
                    raise APIError(400, "send one prompt per request", param="prompt")
                prompt = prompt[0]
            if isinstance(prompt, str):
                ids = tokenize(prompt, False, "prompt")
            else:
                vocab = len(tokenizer)
                if any(not 0 <= i < vocab for i in prompt):
                    raise APIError(400, f"token ids must lie in [0, {vocab})", param="prompt")
                ids = list(prompt)
            job = make_job(req, ids, 16)  # OpenAI's default for completions
        except ValidationError as e:
            count("completions", "error")
            raise _error_from_validation(e) from None
        except APIError:
            count("completions", "error")
            raise
        job.stream = req.stream
        job.stream_usage = bool(req.stream_options and req.stream_options.include_usage)
        ident, now = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(text, result):
            if text == "" and result is None:
                return None  # OpenAI opens a completions stream with the first piece of text
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": _finish(result) if result else None}
            return {"id": ident, "object": "text_completion", "created": now, "model": config.model_name, "choices": [choice]}

        def final(text, result):
            return {
                "id": ident,
                "object": "text_completion",
                "created": now,
                "model": config.model_name,
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": _finish(result)}],
                "usage": usage(result),
            }

        return await run("completions", request, job, chunk, final)

    def engine_stats() -> dict:
        # Read from the event loop while the worker thread updates them: a dict or set that changes size
        # mid-iteration raises RuntimeError, and the next try sees it settled.
        for _ in range(9):
            try:
                return engine.stats()
            except RuntimeError:
                time.sleep(0.001)
        return engine.stats()

    @app.get("/metrics")
    async def metrics():
        s = engine_stats()
        lines = []

        def metric(name: str, kind: str, help: str, samples) -> None:
            lines.append(f"# HELP moestream_{name} {help}")
            lines.append(f"# TYPE moestream_{name} {kind}")
            for labels, value in samples:
                label = "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else ""
                lines.append(f"moestream_{name}{label} {value}")

        metric("requests_total", "counter", "Requests answered, by endpoint and outcome (ok, error, cancelled).",
               [({"endpoint": e, "outcome": o}, n) for (e, o), n in sorted(counts.items())])
        metric("requests_queued", "gauge", "Requests waiting for the model.", [({}, worker.queued())])
        metric("requests_running", "gauge", "Requests being generated (0 or 1).", [({}, int(worker.running is not None))])
        metric("generations_ended_early_total", "counter", "Requests dropped from the queue or stopped while generating: "
               "by a client that left (cancelled), the timeout, or an error.",
               [({"reason": r}, n) for r, n in sorted(worker.counters.items())])
        metric("prompt_tokens_total", "counter", "Prompt tokens processed.", [({}, worker.prompt_tokens)])
        metric("completion_tokens_total", "counter", "Tokens generated.", [({}, worker.completion_tokens)])
        metric("generation_seconds_total", "counter", "Seconds spent generating (prefill and decode).", [({}, f"{worker.generation_seconds:.6f}")])
        metric("decode_tokens_per_second", "gauge", "Decode speed of the last request that generated more than one token.",
               [({}, f"{worker.last_decode_tps:.3f}")])
        metric("expert_hits_total", "counter", "Expert lookups served from the cache.", [({}, s["hits"])])
        metric("expert_misses_total", "counter", "Expert lookups read from disk.", [({}, s["misses"])])
        metric("expert_hit_rate", "gauge", "Hits over lookups since the model was loaded.", [({}, f"{s['hit_rate']:.6f}")])
        metric("expert_bytes_read_total", "counter", "Bytes of expert records read from disk.", [({}, s["bytes_read"])])
        metric("expert_cache_budget_bytes", "gauge", "The expert cache budget (--memory).", [({}, s["cache_budget_bytes"])])
        metric("resident_memory_bytes", "gauge", "Resident set size of the server process.", [({}, current_rss_bytes())])
        metric("peak_resident_memory_bytes", "gauge", "Peak resident set size of the server process.", [({}, peak_rss_bytes())])
        return Response("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def _model_card(name: str, created: int) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "moestream"}


def _finish(result: GenerationResult) -> str:
    # OpenAI knows "stop" and "length"; a cancelled or timed-out request never reaches a client as done.
    return "length" if result.finish_reason == "length" else "stop"


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def serve(app: FastAPI, host: str, port: int, *, log_level: str = "info", on_ready=None) -> None:
    """Run `app` with uvicorn on host:port (port 0: any free port). The socket is bound and listening
    before `on_ready(actual_port)` is called, so a client may connect as soon as it hears of the port."""
    import uvicorn

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    sock.set_inheritable(True)
    if on_ready is not None:
        on_ready(sock.getsockname()[1])
    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5))
    server.run(sockets=[sock])
