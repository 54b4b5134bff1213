"""The HTTP app of `moestream serve` (FastAPI): routes, error handlers, server-sent events, metrics.

Endpoints: GET /v1/models, POST /v1/chat/completions, POST /v1/completions (both with `stream` true:
server-sent events ending in `data: [DONE]`, or false), POST /v1/responses, POST /v1/messages and
/v1/messages/count_tokens (Anthropic's API), the same without /v1, GET /props (llama.cpp's: the context
window and chat template front-ends read), GET /health, GET /metrics (Prometheus text), GET and HEAD /
(clients probe it). With an API key, all but /health, /metrics and / need it, as `Authorization: Bearer KEY`
or Anthropic's `x-api-key: KEY`. Errors on the Messages API's paths have Anthropic's shape, the rest OpenAI's.

The async handlers only read, validate and tokenize (openai_api), then submit the generation to the
one worker thread (worker), which decodes up to --max-batch requests together, and wait for its
output. Each generation samples from a generator of its own, seeded with the request's seed (a random
one when the request has none), and the expert cache never changes results (docs/ARCHITECTURE.md, "One
decode step"), so a seeded answer is the same whether the request ran alone or beside nineteen others. A client that disconnects, or a request past its timeout, cancels its job.
Every failure is an OpenAI-style error object with a 4xx/5xx status; nothing a client sends can stop
the server.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..conversion.store import MANIFEST, file_checksum
from ..core import loading
from ..core.memory import current_rss_bytes, heap_bytes, peak_rss_bytes
from ..core.runtime import runtime_of
from ..generation.batching import KVBudgetExceeded
from ..generation.generate import context_length
from ..generation.kv_cache import PrefixCache, PrefixStats
from ..generation.kv_disk import DiskStats, tier_for
from ..generation.serving import TooManyChoices
from ..generation.worker import ClientGone, Done, Job, ModelThread, Quiet, Worker, WorkerError, WorkerStats
from .anthropic_api import Messages, anthropic_error
from .openai_api import (
    APIError,
    ChatCompletions,
    Completions,
    Endpoint,
    ParsedRequest,
    error_for,
    model_card,
    model_not_found,
)
from .responses_api import Responses

# A request body larger than this is refused (413) before it is parsed: prompts are text, and a body
# of gigabytes would otherwise be read into memory.
MAX_BODY_BYTES = 16 * 2**20


@dataclass
class ServerConfig:
    model_name: str
    max_queue: int = 64
    request_timeout: float | None = None  # seconds from arrival to the last token, queueing included (None: no limit)
    default_max_tokens: int = 512  # for a chat request that names no limit (completions: OpenAI's 16)
    max_batch: int = 8  # sequences decoded together
    batch_kv_memory: int = 2 * 2**30  # bytes of KV the running sequences may hold together
    kv_memory: int = 2**30  # bytes of recent prefixes' KV kept for reuse (0: none)
    prefill_chunk: int | None = None  # a newcomer's prompt tokens per step while others decode (None: one pass)
    api_key: str | None = None  # when set, /v1 requests must carry `Authorization: Bearer <api_key>`
    cors_origins: tuple[str, ...] = ()  # origins whose browser pages may call the API ("*": any)
    context: int | None = None  # the context window served (--context); None: the model's own
    kv_disk: str | None = None  # the directory of the prefixes' tier on disk (None: none)
    kv_disk_memory: int = 8 * 2**30  # its budget in bytes


def create_app(model, tokenizer, config: ServerConfig, model_thread: ModelThread | None = None) -> FastAPI:
    """The FastAPI app serving `model` (loaded by moestream.load, on `model_thread` if given: the thread
    that will step it, worker.ModelThread) under the name `config.model_name`."""
    service = Service(model, tokenizer, config, model_thread)

    @asynccontextmanager
    async def lifespan(app):
        service.worker.start()
        try:
            yield
        finally:
            await asyncio.to_thread(service.worker.close)
            if service.prefix_cache is not None:  # what a restart finds: the prefixes in RAM go to the disk tier
                await asyncio.to_thread(service.prefix_cache.flush)

    app = FastAPI(title="moestream", version="1", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.service = service
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(Exception, _unexpected)
    app.add_api_route("/health", service.health, methods=["GET"])
    app.add_api_route("/metrics", service.metrics, methods=["GET"])
    app.add_api_route("/", service.health, methods=["GET", "HEAD"])
    app.add_api_route("/props", service.props, methods=["GET"])
    # The API under /v1 (OpenAI's base URL) and, as llama.cpp's server does, without the prefix, for clients
    # whose base URL is the bare host.
    for prefix in ("/v1", ""):
        app.add_api_route(f"{prefix}/responses", service.responses, methods=["POST"])
        app.add_api_route(f"{prefix}/messages", service.messages_api, methods=["POST"])
        app.add_api_route(f"{prefix}/messages/count_tokens", service.count_tokens, methods=["POST"])
        app.add_api_route(f"{prefix}/models", service.models, methods=["GET"])
        app.add_api_route(f"{prefix}/models/{{name:path}}", service.retrieve_model, methods=["GET"])
        app.add_api_route(f"{prefix}/chat/completions", service.chat_completions, methods=["POST"])
        app.add_api_route(f"{prefix}/completions", service.completions, methods=["POST"])
    app.add_middleware(_RefuseWhileDraining, service=service)
    if config.api_key:
        app.middleware("http")(_api_key_check(config.api_key))
    if config.cors_origins:
        # Added last, so it is the outermost layer: a browser's preflight (OPTIONS, without the key) is
        # answered before the key is checked, as browsers send no Authorization header with it.
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(config.cors_origins),
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["*"],
            expose_headers=["*"],
        )
    return app


# Paths anyone may read when the server has an API key: a load balancer's probe, a metrics scraper, and
# the root that clients probe before their first request.
OPEN_PATHS = ("/health", "/metrics", "/")


# Seconds a client is told to wait (Retry-After) when the server is stopping: about a restart's.
RETRY_AFTER_SECONDS = 30


class _RefuseWhileDraining:
    """Middleware: once the server is stopping (server.serve's first SIGTERM), a new generation request gets a
    503 with Retry-After instead of a place in the queue; the running ones go on. Plain ASGI: starlette's
    BaseHTTPMiddleware would hide a client's disconnect from the endpoints, which cancel on it."""

    def __init__(self, app, service: Service):
        self.app = app
        self.service = service

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self.service.draining and scope["method"] == "POST":
            error = APIError(503, "the server is shutting down; retry shortly", type="server_busy", code="shutting_down")
            response = _json_error(error, scope["path"])
            response.headers["Retry-After"] = str(RETRY_AFTER_SECONDS)
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _api_key_check(api_key: str):
    """Middleware that answers 401, as OpenAI and Anthropic do, to a request that carries neither
    `Authorization: Bearer <api_key>` (OpenAI's clients) nor `x-api-key: <api_key>` (Anthropic's)."""
    expected = f"Bearer {api_key}".encode()

    async def check(request: Request, call_next):
        if request.url.path not in OPEN_PATHS:
            bearer = request.headers.get("authorization", "").encode()
            key = request.headers.get("x-api-key", "").encode()
            # constant time: the key is not guessed byte by byte
            if not (hmac.compare_digest(bearer, expected) or hmac.compare_digest(key, api_key.encode())):
                told = "no API key was sent" if not (bearer or key) else "the API key is not this server's"
                error = APIError(
                    401,
                    f"{told}; send the server's key (moestream serve --api-key) as `Authorization: Bearer KEY` or "
                    "`x-api-key: KEY`, e.g. OpenAI(api_key=KEY) or Anthropic(api_key=KEY)",
                    code="invalid_api_key",
                )
                return _json_error(error, request.url.path)
        return await call_next(request)

    return check


class Service:
    """What the routes share: the worker, the two endpoints' translators, the request counts; and the one
    core that answers a generation request, whichever endpoint it came to."""

    def __init__(self, model, tokenizer, config: ServerConfig, model_thread: ModelThread | None = None):
        self.model = model
        self.config = config
        disk = tier_for(model, config.kv_disk, config.kv_disk_memory) if config.kv_disk and config.kv_memory > 0 else None
        self.prefix_cache = PrefixCache(config.kv_memory, disk=disk) if config.kv_memory > 0 else None
        self.worker = Worker(
            model,
            tokenizer,
            config.max_queue,
            max_batch=config.max_batch,
            prefix_cache=self.prefix_cache,
            kv_budget_bytes=config.batch_kv_memory,
            prefill_chunk=config.prefill_chunk,
            model_thread=model_thread,
        )
        self.context = config.context or context_length(model)
        context = self.context
        self.fingerprint = system_fingerprint(model)  # (a digest of the manifest file: computed once)
        shared = dict(vocabulary=self.worker.vocabulary, fingerprint=self.fingerprint)
        self.chat = ChatCompletions(tokenizer, config.model_name, context, config.default_max_tokens, **shared)
        self.completion = Completions(tokenizer, config.model_name, context, **shared)
        self.response = Responses(tokenizer, config.model_name, context, config.default_max_tokens, **shared)
        self.messages = Messages(tokenizer, config.model_name, context, config.default_max_tokens, **shared)
        self.tokenizer = tokenizer
        self.created = int(time.time())
        # (endpoint, outcome) -> requests answered; touched only on the event loop, so it needs no lock.
        self.requests: dict[tuple[str, str], int] = {}
        self.metrics_registry = metrics_registry(self)
        self.draining = False  # the server is stopping: no new generation requests (server.serve sets it)

    # -- generation requests -------------------------------------------------------------------------------

    async def chat_completions(self, request: Request) -> Response:
        return await self.answer(self.chat, request)

    async def completions(self, request: Request) -> Response:
        return await self.answer(self.completion, request)

    async def responses(self, request: Request) -> Response:
        return await self.answer(self.response, request)

    async def messages_api(self, request: Request) -> Response:
        return await self.answer(self.messages, request)

    async def count_tokens(self, request: Request) -> dict:
        data = await _read_json(request)
        return await asyncio.to_thread(self.messages.count_tokens, data)

    async def answer(self, endpoint: Endpoint, request: Request) -> Response:
        """Translate, queue and answer a request: one JSON object, or server-sent events. Every way it can
        end (answered, refused, timed out, failed, client gone) goes through `_end`, once."""
        job, outcome, streaming = None, "error", False
        try:
            data = await _read_json(request)
            # In a thread: the first request with a grammar builds the tokenizer's grammar vocabulary (seconds).
            parsed = await asyncio.to_thread(endpoint.parse, data)
            job = self.worker.submit(parsed.choices, self.config.request_timeout)
            if parsed.stream:
                # Wait until the worker takes the request, so that a request refused or timed out in the
                # queue still gets an error status instead of a 200 stream.
                await job.wait_until_started(request.is_disconnected)
                streaming = True  # from here on the event stream owns the request's end
                return StreamingResponse(
                    self._events(endpoint, job, parsed), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
                )
            results = {}
            async for item in job.output(request.is_disconnected):
                if isinstance(item, Done):
                    results[item.index] = item.result  # (each result holds its whole text)
            outcome = "ok"
            return JSONResponse(parsed.reply.response(results))
        except ClientGone:
            outcome = "cancelled"
            return Response(status_code=499)  # nobody reads it; nginx's code for "client closed request"
        except asyncio.CancelledError:  # the handler's task was cancelled: the server is shutting down
            outcome = "cancelled"
            raise
        except (WorkerError, KVBudgetExceeded, TooManyChoices) as e:
            raise error_for(e) from None
        finally:
            if not streaming:
                self._end(endpoint, job, outcome)

    async def _events(self, endpoint: Endpoint, job: Job, parsed: ParsedRequest):
        """The server-sent events of a streamed answer; the status line (200) has gone out already."""
        reply = parsed.reply
        outcome = "cancelled"  # when the client disconnects, starlette cancels this generator's task
        try:
            for index in range(reply.choices):
                for chunk in reply.opening(index):
                    yield reply.sse(chunk)
            results = {}
            async for item in job.output(quiet_after=reply.keepalive_seconds):
                if isinstance(item, Quiet):
                    chunks = reply.keepalive()
                elif isinstance(item, Done):
                    results[item.index] = item.result
                    chunks = reply.last_chunks(item)
                else:
                    chunks = reply.chunk(item)
                for chunk in chunks:
                    yield reply.sse(chunk)
            if parsed.include_usage:
                yield reply.sse(reply.usage_chunk(results))
            outcome = "ok"
        except Exception as e:  # too late for an error status: the error travels as an event
            outcome = "error"
            yield reply.sse(reply.error_event(error_for(e).body))
        finally:
            self._end(endpoint, job, outcome)
        if reply.done_marker:
            yield "data: [DONE]\n\n"

    def _end(self, endpoint: Endpoint, job: Job | None, outcome: str) -> None:
        """The end of every generation request: free its queue slot (or stop its generation) if it has a
        job still going, and count it by endpoint and outcome (ok, error, cancelled)."""
        if job is not None:
            job.cancel()
        key = (endpoint.name, outcome)
        self.requests[key] = self.requests.get(key, 0) + 1

    # -- the rest --------------------------------------------------------------------------------------------

    async def health(self) -> Response:
        body = {
            "status": "draining" if self.draining else "ok",
            "model": self.config.model_name,
            "queued": self.worker.queued(),
            "running": self.worker.running(),
        }
        # (a load balancer's probe sees a stopping server as unavailable)
        return JSONResponse(body, status_code=503 if self.draining else 200)

    async def models(self) -> dict:
        card = self._card()
        # OpenAI's list, with Anthropic's paging fields (one page)
        return {"object": "list", "data": [card], "has_more": False, "first_id": card["id"], "last_id": card["id"]}

    async def retrieve_model(self, name: str) -> dict:
        if name != self.config.model_name:
            raise model_not_found(name, self.config.model_name)
        return self._card()

    def _card(self) -> dict:
        card = model_card(self.config.model_name, self.created, self.context)
        # llama.cpp's server describes its model under `meta`: front-ends read the trained context from it
        card["meta"] = {"n_ctx_train": context_length(self.model), "n_ctx": self.context, "n_vocab": len(self.tokenizer)}
        return card

    async def props(self) -> dict:
        """llama.cpp's GET /props, the fields front-ends read: the context window, the chat template, the
        model's name and path, the slots (here: the batch)."""
        store = str(runtime_of(self.model).store.directory)
        return {
            "default_generation_settings": {"n_ctx": self.context, "params": {"n_predict": self.config.default_max_tokens}},
            "n_ctx": self.context,
            "total_slots": self.config.max_batch,
            "model_alias": self.config.model_name,
            "model_path": store,
            "chat_template": getattr(self.tokenizer, "chat_template", None) or "",
            "modalities": {"vision": False, "audio": False},
            "build_info": f"moestream {self.fingerprint}",
        }

    async def metrics(self) -> Response:
        # The engine reads its statistics under the lock it holds around each experts call, so this is
        # safe while the worker generates.
        return Response(generate_latest(self.metrics_registry), media_type=CONTENT_TYPE_LATEST)


def system_fingerprint(model) -> str:
    """OpenAI's `system_fingerprint`: what produced the answer, here moestream's version and the store
    (a digest of its manifest, which names every record's checksum), so a client sees when either changes."""
    from ..version import __version__

    manifest = runtime_of(model).store.directory / MANIFEST
    return f"moestream-{__version__}-{file_checksum(manifest)[:12]}"


class ServerCollector:
    """/metrics through prometheus_client: a collector that reads, at each scrape, the request counts, the
    worker's queue, batch and totals, the prefix cache, the engine's statistics, the three memory budgets
    and the process's memory (the numbers live where they are counted; nothing is kept twice)."""

    def __init__(self, service: Service):
        self.service = service

    def collect(self):
        service = self.service
        worker, config = service.worker, service.config
        w: WorkerStats = worker.stats()
        s = loading.stats(service.model)
        prefix = service.prefix_cache.stats() if service.prefix_cache is not None else PrefixStats()

        def counter(name: str, help: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(f"moestream_{name}", help, value=value)

        def gauge(name: str, help: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"moestream_{name}", help, value=value)

        requests = CounterMetricFamily(
            "moestream_requests",
            "Requests answered, by endpoint and outcome (ok, error, cancelled).",
            labels=["endpoint", "outcome"],
        )
        for (endpoint, outcome), n in sorted(service.requests.items()):
            requests.add_metric([endpoint, outcome], n)
        yield requests
        yield gauge("requests_queued", "Requests waiting for the model.", worker.queued())
        yield gauge("requests_running", "Requests being generated: the batch size now.", worker.running())
        yield gauge("max_batch", "The most requests decoded together (--max-batch).", config.max_batch)
        yield counter("decode_steps", "Decode steps of the batch.", w.batch_steps)
        yield counter(
            "decode_step_sequences",
            "Sequences summed over decode steps (over decode_steps_total: the mean batch size).",
            w.batch_rows,
        )
        yield SummaryMetricFamily(
            "moestream_queue_seconds",
            "Seconds requests waited in the queue before they started.",
            count_value=w.started,
            sum_value=w.queue_seconds,
        )
        yield SummaryMetricFamily(
            "moestream_time_to_first_token_seconds",
            "Seconds from a request's arrival to its first token (queueing and prefill).",
            count_value=w.first_tokens,
            sum_value=w.first_token_seconds,
        )
        yield gauge(
            "last_time_to_first_token_seconds",
            "Time to first token of the latest request that got one.",
            w.last_time_to_first_token,
        )
        yield counter(
            "prefix_tokens_reused",
            "Prompt tokens whose KV came from the prefix cache instead of a prefill.",
            prefix.tokens_reused,
        )
        yield gauge("prefix_cache_entries", "Sequences whose KV the prefix cache holds.", prefix.entries)
        yield gauge("prefix_cache_bytes", "KV bytes the prefix cache holds.", prefix.bytes)
        yield gauge("prefix_cache_budget_bytes", "The prefix cache's budget (--kv-memory).", config.kv_memory)
        tier = service.prefix_cache.disk if service.prefix_cache is not None else None
        disk = tier.stats() if tier is not None else DiskStats()
        yield gauge("kv_disk_entries", "Prefixes whose KV the tier on disk holds (--kv-disk).", disk.entries)
        yield gauge("kv_disk_bytes", "Bytes the KV tier on disk holds.", disk.bytes)
        yield gauge(
            "kv_disk_budget_bytes", "The KV tier's budget (--kv-disk-memory; 0: no tier).", tier.budget_bytes if tier else 0
        )
        yield counter("kv_disk_hits", "Prompts whose longest prefix came from the KV tier on disk.", disk.hits)
        yield counter("kv_disk_tokens_reused", "Prompt tokens whose KV came from the tier on disk.", disk.tokens_reused)
        yield counter("kv_disk_writes", "Prefixes written to the KV tier.", disk.writes)
        yield counter("kv_disk_written_bytes", "Bytes written to the KV tier.", disk.bytes_written)
        yield counter("kv_disk_reads", "Prefixes read from the KV tier.", disk.reads)
        yield counter("kv_disk_read_bytes", "Bytes read from the KV tier.", disk.bytes_read)
        yield counter(
            "kv_disk_dropped", "KV tier files found damaged or truncated, deleted, their prefix computed again.", disk.dropped
        )
        yield counter(
            "kv_disk_errors", "KV tier writes that failed (a full disk, an I/O error): the prefix stayed in RAM.", disk.errors
        )
        yield gauge("batch_kv_bytes", "KV bytes the running requests hold.", w.batch_kv_bytes)
        yield gauge("batch_kv_peak_bytes", "The most KV bytes the running requests have held.", w.batch_kv_peak_bytes)
        yield gauge("batch_kv_budget_bytes", "The running requests' KV budget (--batch-kv-memory).", config.batch_kv_memory)
        ended = CounterMetricFamily(
            "moestream_generations_ended_early",
            "Requests dropped from the queue or stopped while generating: "
            "by a client that left (cancelled), the timeout, a failed disk read (disk), or another error.",
            labels=["reason"],
        )
        for reason, n in sorted(w.ended_early.items()):
            ended.add_metric([reason], n)
        yield ended
        yield counter("prompt_tokens", "Prompt tokens processed.", w.prompt_tokens)
        yield counter("completion_tokens", "Tokens generated.", w.completion_tokens)
        yield counter("generation_seconds", "Seconds spent generating (prefill and decode).", w.generation_seconds)
        yield gauge(
            "decode_tokens_per_second", "Decode speed of the last request that generated more than one token.", w.last_decode_tps
        )
        yield counter("expert_hits", "Expert lookups served from the cache.", s["hits"])
        yield counter("expert_misses", "Expert lookups read from disk.", s["misses"])
        yield gauge("expert_hit_rate", "Hits over lookups since the model was loaded.", s["hit_rate"])
        yield counter("expert_bytes_read", "Bytes of expert records read from disk.", s["bytes_read"])
        yield gauge("expert_cache_budget_bytes", "The expert cache budget (--memory).", s["cache_budget_bytes"])
        yield gauge("resident_memory_bytes", "Resident set size of the server process.", current_rss_bytes())
        yield gauge("peak_resident_memory_bytes", "Peak resident set size of the server process.", peak_rss_bytes())
        if (heap := heap_bytes()) is not None:  # (glibc: what of the RSS the C heap has handed out, and keeps free)
            yield gauge("heap_in_use_bytes", "Bytes the C heap has handed out (tensors, Python objects).", heap[0])
            yield gauge("heap_free_bytes", "Bytes the C heap keeps free for later allocations.", heap[1])


def metrics_registry(service: Service):
    """The registry /metrics writes: the server's own metrics, and prometheus_client's process metrics
    (CPU seconds, open files, memory; Linux)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ServerCollector(service))
    ProcessCollector(registry=registry)
    return registry


async def _read_json(request: Request) -> dict:
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise APIError(413, f"the request body is larger than {MAX_BODY_BYTES // 2**20} MiB", code="request_too_large")
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as e:  # RecursionError: arrays nested thousands deep
        raise APIError(
            400, f"the request body is not valid JSON ({type(e).__name__}: {e}); send a JSON object", code="invalid_json"
        ) from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    return data


# -- error handlers: every error is an OpenAI error object, or Anthropic's on its API's paths ---------------


def _json_error(e: APIError, path: str) -> JSONResponse:
    anthropic = path.startswith(("/v1/messages", "/messages"))
    return JSONResponse(anthropic_error(e) if anthropic else e.body, status_code=e.status)


async def _api_error(request, e: APIError):
    return _json_error(e, request.url.path)


# What a client that asks for a path this server does not have is told (e.g. /v1/embeddings).
ENDPOINTS = (
    "POST /v1/chat/completions, POST /v1/completions, POST /v1/responses, POST /v1/messages, "
    "POST /v1/messages/count_tokens, GET /v1/models (each also without /v1), GET /props, GET /health, GET /metrics"
)


async def _http_error(request, e: StarletteHTTPException):
    if e.status_code == 404:
        message = f"{request.method} {request.url.path} does not exist on this server; it serves {ENDPOINTS}"
        return _json_error(APIError(404, message, code="not_found"), request.url.path)
    return _json_error(APIError(e.status_code, str(e.detail)), request.url.path)


async def _validation_error(request, e: RequestValidationError):
    return _json_error(APIError(400, f"invalid request: {e.errors()[:1]}"), request.url.path)


async def _unexpected(request, e: Exception):
    return _json_error(error_for(e), request.url.path)
