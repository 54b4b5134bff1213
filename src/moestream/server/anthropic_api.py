"""Anthropic's Messages API (POST /v1/messages, POST /v1/messages/count_tokens), stateless, over the chat
completions machinery.

Agent CLIs that speak only this API resend the whole conversation every turn, so, as for the Responses
API, a server that keeps nothing serves them: a request is translated into a chat completions request
(`system` and the message blocks into chat messages, `tools` and `tool_choice` into chat's, `thinking` and
`output_config.effort` into the template's thinking switch, `output_format` into a JSON-schema grammar),
prompted and constrained by the same code (openai_api.ChatCompletions), decoded by the same worker, and its
answer (AnswerStream: reasoning, content, tool calls) shaped as Anthropic's content blocks: `thinking`,
`text`, `tool_use`. A streamed answer is Anthropic's event sequence (`message_start`, per block
`content_block_start`, its deltas and `content_block_stop`, then `message_delta` and `message_stop`, with a
`ping` while a long prompt is prefilled); a tool call's input streams as `input_json_delta` pieces.

Where Anthropic's API and chat completions differ:
- `max_tokens` is a cap: an answer gets at most the room the context window leaves after the prompt (agents
  send 32,000 whatever the model), and only a prompt that does not fit is refused, with Anthropic's
  wording ("prompt is too long: N tokens > M maximum"), which agents answer by compacting the conversation.
- `usage.input_tokens` counts the prompt tokens that were prefilled, `cache_read_input_tokens` those whose
  KV came from the prefix cache: their sum is the prompt, as in Anthropic's accounting.
- A request may name any model: agents ask for their vendor's names (a main and a small model), and a
  server of one model answers each with it, saying which in the answer's `model`.
- A system text block that instructs nothing and changes from request to request (an agent's attribution
  line, `x-anthropic-billing-header: ...`) is left out of the prompt: left in, its first hundred tokens would
  differ every turn and no prefix would ever be reused.
- A `system` message inside `messages` is passed to the template where it stands; a template that refuses a
  system message there gets its text at the start of the next user turn instead.

What cannot be served (images, documents, server tools, MCP servers) is refused with a 400 that names it;
errors on these paths have Anthropic's shape (`anthropic_error`).
"""

from __future__ import annotations

import json
import uuid
from typing import Any, ClassVar, Literal

from pydantic import Field, ValidationError

from ..generation.generate import GenerationResult
from ..generation.worker import Done, Piece
from .answer_stream import AnswerStream, ArgumentsDelta, CallStarted, ContentDelta, Delta, FinalAnswer, ReasoningDelta
from .openai_api import (
    APIError,
    ChatCompletionRequest,
    ChatCompletions,
    ContextTooLong,
    OneAnswerReply,
    _error_from_validation,
    _Strict,
)

# The system block an agent CLI puts first to attribute its requests: no instruction to the model, and it
# may change on every request, so it is not part of the prompt.
ATTRIBUTION_PREFIX = "x-anthropic-billing-header:"
# Tools that Anthropic's service runs itself: not offered to a model here (agents send them with every
# request; the model only asks for them).
SERVER_TOOLS = ("web_search_", "web_fetch_", "code_execution_", "tool_search_tool_")
# Tools whose schema Anthropic's own models know without being told: a model here would not know them.
BUILT_IN_CLIENT_TOOLS = ("bash_", "text_editor_", "computer_", "memory_")
# Keys a custom tool may carry besides its name, description and schema; none changes what is done here
# (`strict`: a forced call always follows its schema).
TOOL_KEYS = frozenset(
    {"type", "name", "description", "input_schema", "cache_control", "strict", "input_examples", "defer_loading"}
    | {"allowed_callers", "eager_input_streaming"}
)
# Keys of a message. An agent sets `output_config` on a turn of its own (a per-turn effort): the request's
# applies to the whole prompt here, so a turn's is accepted and changes nothing.
MESSAGE_KEYS = frozenset({"role", "content", "output_config"})
# Anthropic's efforts, as the chat templates that take one name them.
EFFORTS = {"low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": "high"}
# An Anthropic error's type by HTTP status.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def anthropic_error(e: APIError) -> dict:
    """An error's body as Anthropic's API has it: {"type": "error", "error": {"type", "message"}}."""
    error_type = ERROR_TYPES.get(e.status, "api_error" if e.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": error_type, "message": e.body["error"]["message"]}}


class _Thinking(_Strict):
    # adaptive and between_tools leave thinking to the model: here, to the template's default
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = Field(default=None, ge=1)  # the template's reasoning has no budget: accepted
    display: Literal["summarized", "omitted"] | None = None  # omitted: thinking blocks come back empty


class _OutputFormat(_Strict):
    type: Literal["json_schema"]
    schema_: dict = Field(alias="schema")


class _OutputConfig(_Strict):
    effort: str | None = None
    format: _OutputFormat | None = None


class MessagesRequest(_Strict):
    model: str | None = None  # any name: the served model answers (the module's docstring says why)
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    max_tokens: int = Field(ge=0)  # 0: prefill the prompt for the prefix cache, answer nothing
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: _Thinking | None = None
    output_format: _OutputFormat | None = None
    output_config: _OutputConfig | None = None
    seed: int | None = None  # moestream's extension (as chat's): a reproducible sampled answer
    # Who asks, how and where Anthropic's service runs, bills, caches or trims it: accepted, changes nothing
    # here (the prefix cache reuses any shared prefix without being asked).
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    context_management: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None
    diagnostics: dict[str, Any] | None = None
    inference_geo: str | None = None
    speed: str | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    # Refused when set: this server runs no MCP servers and no code containers.
    mcp_servers: list[Any] | None = None
    container: Any = None

    def refused(self) -> None:
        for name, why in (
            ("mcp_servers", "MCP servers are not run by this server: give their tools as `tools` and run them in the client"),
            ("container", "code execution containers are not supported"),
        ):
            if getattr(self, name):
                raise APIError(400, why, param=name, code="unsupported_parameter")


class CountTokensRequest(MessagesRequest):
    max_tokens: int = 1  # (count_tokens takes no answer length)


class _Translated(ChatCompletionRequest):
    """The chat request a messages request becomes, with the request itself for the answer's shape."""

    source: MessagesRequest
    top_k: int | None = None


class Messages(ChatCompletions):
    """POST /v1/messages: a messages request translated into a chat request (the same template, tool formats
    and grammars), answered as Anthropic's content blocks."""

    name = "messages"
    request_model = MessagesRequest
    prompt_param = "messages"
    max_stop_sequences = 64  # Anthropic sets no small limit; agents send a few
    max_tokens_is_a_cap = True

    def parse(self, data: dict):
        try:
            parsed = super().parse(data)
        except ContextTooLong as e:  # Anthropic's wording, which agents recognise
            raise APIError(
                400, f"prompt is too long: {e.prompt_tokens} tokens > {e.limit - 1} maximum", param="messages"
            ) from None
        except APIError as e:  # errors found by the chat code name chat's fields: name the request's own
            message = e.body["error"]["message"]
            for chat, own in (("response_format", "output_format"), ("'stop'", "'stop_sequences'")):
                message = message.replace(chat, own)
            e.body["error"]["message"] = message
            raise
        reply = parsed.reply
        # an answer cut where the context window ends, not at the max_tokens asked for, says so
        reply.window_cap = parsed.choices[0].params.max_tokens < data["max_tokens"]
        reply.warm_only = data["max_tokens"] == 0
        return parsed

    def validate(self, data: dict, request_model: type[MessagesRequest] = MessagesRequest) -> _Translated:
        """The request, validated as a MessagesRequest, then as the chat request it becomes."""
        try:
            req = request_model.model_validate(data)
        except ValidationError as e:
            raise _error_from_validation(e) from None
        req.refused()
        tools = _chat_tools(req.tools or [])
        choice = req.tool_choice or {"type": "auto"}
        fmt = req.output_format or (req.output_config.format if req.output_config else None)
        chat: dict[str, Any] = {
            "messages": _chat_messages(req),
            "stream": req.stream,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "top_k": req.top_k,
            "seed": req.seed,
            "max_tokens": max(1, req.max_tokens),
            "stop": req.stop_sequences or None,
            "parallel_tool_calls": not choice.get("disable_parallel_tool_use", False),
        }
        if fmt is not None:
            chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.schema_}}
        if tools:
            chat["tools"] = tools
            chat["tool_choice"] = _chat_tool_choice(choice)
        elif choice.get("type") not in ("auto", "none"):
            raise APIError(400, "tool_choice asks for a tool call but the request has no tools", param="tool_choice")
        thinking = None if req.thinking is None or req.thinking.type == "adaptive" else req.thinking.type == "enabled"
        effort = req.output_config.effort if req.output_config else None
        if effort is not None and effort not in EFFORTS:
            raise APIError(400, f"output_config.effort must be one of {sorted(EFFORTS)}, not {effort!r}", param="output_config")
        chat.update(self.thinking_options(thinking, EFFORTS.get(effort)))
        try:
            translated = _Translated.model_validate({**chat, "source": req})
        except ValidationError as e:
            raise _error_from_validation(e) from None
        translated.refused()
        return translated

    def prompts(self, req: _Translated, reply: MessagesReply) -> list[list[int]]:
        try:
            return super().prompts(req, reply)
        except APIError:
            inner_system = any(m.role == "system" for m in req.messages[1:])
            if not inner_system:
                raise
            # A template that allows a system message only first: its text opens the next user turn.
            return super().prompts(req.model_copy(update={"messages": _system_into_user(req.messages)}), reply)

    def count_tokens(self, data: dict) -> dict:
        """POST /v1/messages/count_tokens: the tokens of the prompt a messages request would be given."""
        req = self.validate(data, CountTokensRequest)
        return {"input_tokens": len(self.prompts(req, self.reply(req))[0])}

    def reply(self, req: _Translated) -> MessagesReply:
        return MessagesReply(
            self.model_name,
            self.fingerprint,
            self.tokenizer,
            self.vocabulary,
            tool_format=self.tool_format(req),
            parallel_tool_calls=req.parallel_tool_calls is not False,
            show_thinking=not (req.source.thinking is not None and req.source.thinking.display == "omitted"),
        )


# -- requests into chat requests ----------------------------------------------------------------------------


def _text_blocks(content: Any, where: str) -> str:
    """The text of a string or of a list of text blocks."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where} must be a string or a list of content blocks", param=where)
    texts = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind != "text" or not isinstance(block.get("text"), str):
            raise _unsupported_block(kind, f"{where}.{j}")
        texts.append(block["text"])
    return "".join(texts)


def _unsupported_block(kind: Any, where: str) -> APIError:
    return APIError(
        400,
        f"{where}: content blocks of type {kind!r} are not supported here; this server's models read text "
        "(send text, tool_use, tool_result and thinking blocks)",
        param=where,
    )


def _system_text(system: str | list[dict] | None) -> str:
    """The request's `system`, without the attribution block an agent sends first (it instructs nothing)."""
    if not isinstance(system, list):
        return system or ""
    kept = [b for b in system if not (isinstance(b, dict) and str(b.get("text", "")).startswith(ATTRIBUTION_PREFIX))]
    return "\n\n".join(t for t in (_text_blocks([b], "system") for b in kept) if t)


def _chat_messages(req: MessagesRequest) -> list[dict]:
    """The conversation as chat messages: `system` first, then each message's blocks: a user turn's tool
    results as tool messages (in the order given) and then its text; an assistant turn's thinking as its
    reasoning, its text as content and its tool_use blocks as tool calls."""
    messages: list[dict] = []
    if system := _system_text(req.system):
        messages.append({"role": "system", "content": system})
    if req.messages[-1].get("role") == "assistant":
        raise APIError(
            400,
            "the last message is an assistant turn to be continued (a prefill), which this server does not do: "
            "end the conversation with a user message",
            param="messages",
        )
    for i, message in enumerate(req.messages):
        where = f"messages.{i}"
        extra = set(message) - MESSAGE_KEYS
        if extra:
            raise APIError(400, f"{where}.{sorted(extra)[0]}: Extra inputs are not permitted", param=where)
        role, content = message.get("role"), message.get("content")
        if role == "system":
            text = _text_blocks(content, f"{where}.content")
            if messages and all(m["role"] == "system" for m in messages):  # before the conversation: one system turn
                messages[0]["content"] += "\n\n" + text
            else:
                messages.append({"role": "system", "content": text})
        elif role == "user":
            messages += _user_turn(content, f"{where}.content")
        elif role == "assistant":
            messages.append(_assistant_turn(content, f"{where}.content"))
        else:
            raise APIError(400, f"{where}.role must be user, assistant or system, not {role!r}", param=f"{where}.role")
    if not any(m["role"] != "system" for m in messages):
        raise APIError(400, "messages: send at least one user message", param="messages")
    return messages


def _user_turn(content: Any, where: str) -> list[dict]:
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    if not isinstance(content, list):
        raise APIError(400, f"{where} must be a string or a list of content blocks", param=where)
    turn, texts = [], []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_result":
            if not isinstance(block.get("tool_use_id"), str):
                raise APIError(400, f"{where}.{j}.tool_use_id: a tool_result needs the id of its tool_use", param=where)
            result = _text_blocks(block.get("content") or "", f"{where}.{j}.content")
            if block.get("is_error"):  # chat templates have no error flag: the text says it
                result = f"Error: {result}"
            turn.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": result})
        else:
            raise _unsupported_block(kind, f"{where}.{j}")
    if texts:
        turn.append({"role": "user", "content": "".join(texts)})
    return turn


def _assistant_turn(content: Any, where: str) -> dict:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    if not isinstance(content, list):
        raise APIError(400, f"{where} must be a string or a list of content blocks", param=where)
    texts, reasoning, calls = [], [], []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "thinking" and isinstance(block.get("thinking"), str):
            reasoning.append(block["thinking"])
        elif kind == "redacted_thinking":
            pass  # encrypted by Anthropic's service: nothing a model here can read
        elif kind == "tool_use":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise APIError(400, f"{where}.{j}: a tool_use block needs an id and a name", param=where)
            arguments = json.dumps(block.get("input") or {}, ensure_ascii=False)
            calls.append({"id": block["id"], "type": "function", "function": {"name": block["name"], "arguments": arguments}})
        else:
            raise _unsupported_block(kind, f"{where}.{j}")
    turn: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
    if reasoning and any(reasoning):
        turn["reasoning_content"] = "\n".join(reasoning)
    if calls:
        turn["tool_calls"] = calls
    return turn


def _system_into_user(messages: list) -> list:
    """Chat messages where each system message but the first is put at the start of the next user message
    (or is a user message of its own, where none follows)."""
    out, pending = [], []
    for k, m in enumerate(messages):
        if m.role == "system" and k > 0:
            pending.append(m.text())
        elif m.role == "user" and pending:
            out.append(m.model_copy(update={"content": "\n\n".join([*pending, m.text()])}))
            pending = []
        else:
            out.append(m)
    if pending:
        out.append(messages[0].model_copy(update={"role": "user", "content": "\n\n".join(pending)}))
    return out


def _chat_tools(tools: list[dict]) -> list[dict]:
    chat = []
    for i, tool in enumerate(tools):
        where, kind = f"tools.{i}", tool.get("type")
        if isinstance(kind, str) and kind.startswith(SERVER_TOOLS):
            continue
        if isinstance(kind, str) and kind.startswith(BUILT_IN_CLIENT_TOOLS):
            raise APIError(
                400,
                f"{where}: the tool type {kind!r} is defined by Anthropic's models, which know it without a schema; "
                "send it as a custom tool with an input_schema",
                param=where,
            )
        if kind not in (None, "custom"):
            raise APIError(400, f"{where}: tools of type {kind!r} are not supported: send custom tools", param=where)
        extra = set(tool) - TOOL_KEYS
        if extra:
            raise APIError(400, f"{where}.{sorted(extra)[0]}: Extra inputs are not permitted", param=where)
        if not isinstance(tool.get("name"), str) or not isinstance(tool.get("input_schema"), dict):
            raise APIError(400, f"{where}: a tool needs a name and an input_schema object", param=where)
        function = {"name": tool["name"], "parameters": tool["input_schema"]}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        chat.append({"type": "function", "function": function})
    return chat


def _chat_tool_choice(choice: dict) -> str | dict:
    kind = choice.get("type")
    extra = set(choice) - {"type", "name", "disable_parallel_tool_use"}
    if extra:
        raise APIError(400, f"tool_choice.{sorted(extra)[0]}: Extra inputs are not permitted", param="tool_choice")
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise APIError(400, "tool_choice.type must be auto, any, tool (with a name) or none", param="tool_choice")


# -- answers into messages ----------------------------------------------------------------------------------


def stop_reason(result: GenerationResult, final: FinalAnswer, window_cap: bool = False) -> str:
    if result.finish_reason == "length":
        return "model_context_window_exceeded" if window_cap else "max_tokens"
    if final.calls:
        return "tool_use"
    return "stop_sequence" if result.stop_sequence is not None else "end_turn"


class MessagesReply(OneAnswerReply):
    """One answer as an Anthropic message, or as its event stream. Its content blocks are built as the answer
    streams (thinking, then text, then each tool call); a non-streamed answer builds the same blocks at once."""

    id_prefix = "msg"
    response_object = "message"
    chunk_object = "message"
    done_marker = False  # the stream ends with message_stop
    keepalive_seconds: ClassVar[float | None] = 5.0

    def __init__(
        self,
        model_name: str,
        fingerprint: str,
        tokenizer,
        vocabulary=None,
        *,
        tool_format=None,
        parallel_tool_calls: bool = True,
        show_thinking: bool = True,
    ):
        super().__init__(model_name, fingerprint, tokenizer, vocabulary)
        self.id = f"msg_{uuid.uuid4().hex[:24]}"
        self.tool_format = tool_format
        self.parallel_tool_calls = parallel_tool_calls
        self.show_thinking = show_thinking
        self.thinking = None  # set with the prompt (ChatCompletions.prompts)
        self.prompt_tokens = 0
        self.stream: AnswerStream | None = None
        self.blocks: list[dict] = []  # content blocks, the last one possibly still open
        self.open = False
        self.call_blocks: dict[int, int] = {}  # call index -> its block's index
        self.window_cap = False  # max_tokens was lowered to the room the context window leaves
        self.warm_only = False  # max_tokens 0: the prompt is prefilled (its KV kept for reuse), nothing answered
        self.arguments: dict[int, str] = {}  # call index -> the input's JSON text streamed so far

    @property
    def special_tokens(self) -> bool:
        return self.tool_format is not None

    def start(self, prompts: list[list[int]], n: int) -> None:
        super().start(prompts, n)
        self.prompt_tokens = len(prompts[0])

    def _answer_stream(self) -> AnswerStream:
        return AnswerStream(self.tool_format, self.thinking, None if self.parallel_tool_calls else 1)

    def _message(self, content: list[dict], reason: str | None, sequence: str | None, usage: dict) -> dict:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model_name,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": usage,
        }

    def _usage(self, result: GenerationResult | None) -> dict:
        cached = result.cached_tokens if result is not None else 0
        prompt = result.prompt_tokens if result is not None else self.prompt_tokens
        return {
            "input_tokens": prompt - cached,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached,
            "output_tokens": len(result.token_ids) if result is not None and not self.warm_only else 0,
        }

    def response(self, results: dict[int, GenerationResult]) -> dict:
        result = results[0]
        deltas, final = self._answer_stream().finish(result.text, result.finish_reason == "length")
        self._events(deltas)  # builds the blocks (the events are not sent)
        self._close()
        self._finish_calls(final)
        return self._message(self.blocks, self._stop_reason(result, final), result.stop_sequence, self._usage(result))

    def _stop_reason(self, result: GenerationResult, final: FinalAnswer) -> str:
        return "max_tokens" if self.warm_only else stop_reason(result, final, self.window_cap)

    # -- the event stream ----------------------------------------------------------------------------------

    def sse(self, payload: dict) -> str:
        return f"event: {payload['type']}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def error_event(self, body: dict) -> dict:
        status = {"server_busy": 503, "timeout": 504}.get(body["error"].get("type"), 500)
        return anthropic_error(APIError(status, body["error"]["message"]))

    def keepalive(self) -> list[dict]:
        return [{"type": "ping"}]

    def opening(self, index: int) -> list[dict]:
        self.stream = self._answer_stream()
        return [{"type": "message_start", "message": self._message([], None, None, self._usage(None))}, {"type": "ping"}]

    def chunk(self, piece: Piece) -> list[dict]:
        return self._events(self.stream.update(piece.text))

    def last_chunks(self, done: Done) -> list[dict]:
        result = done.result
        deltas, final = self.stream.finish(result.text, result.finish_reason == "length")
        events = self._events(deltas) + self._close()
        delta = {"stop_reason": self._stop_reason(result, final), "stop_sequence": result.stop_sequence}
        return [*events, {"type": "message_delta", "delta": delta, "usage": self._usage(result)}, {"type": "message_stop"}]

    # -- blocks ----------------------------------------------------------------------------------------------

    def _events(self, deltas: list[Delta]) -> list[dict]:
        events: list[dict] = []
        for delta in [] if self.warm_only else deltas:
            if isinstance(delta, ReasoningDelta):
                events += self._text_delta("thinking", delta.text if self.show_thinking else "")
            elif isinstance(delta, ContentDelta):
                events += self._text_delta("text", delta.text)
            elif isinstance(delta, CallStarted):
                events += self._close()
                self.call_blocks[delta.index] = len(self.blocks)
                self.arguments[delta.index] = ""
                events += self._open({"type": "tool_use", "id": delta.id, "name": delta.name, "input": {}})
            elif isinstance(delta, ArgumentsDelta):
                index = self.call_blocks[delta.index]
                self.arguments[delta.index] += delta.text
                if self.open and index == len(self.blocks) - 1:  # (a closed block takes no more deltas)
                    events.append(self._delta(index, {"type": "input_json_delta", "partial_json": delta.text}))
        return events

    def _delta(self, index: int, delta: dict) -> dict:
        return {"type": "content_block_delta", "index": index, "delta": delta}

    def _open(self, block: dict) -> list[dict]:
        self.blocks.append(block)
        self.open = True
        return [{"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": dict(block)}]

    def _text_delta(self, kind: str, text: str) -> list[dict]:
        events: list[dict] = []
        current = self.blocks[-1] if self.open else None
        if current is None or current["type"] != kind:
            events += self._close()
            events += self._open(
                {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else {"type": "text", "text": ""}
            )
            current = self.blocks[-1]
        if text:
            current[kind] += text
            delta_type = "thinking_delta" if kind == "thinking" else "text_delta"
            events.append(self._delta(len(self.blocks) - 1, {"type": delta_type, kind: text}))
        return events

    def _close(self) -> list[dict]:
        if not self.open:
            return []
        self.open = False
        return [{"type": "content_block_stop", "index": len(self.blocks) - 1}]

    def _finish_calls(self, final: FinalAnswer) -> None:
        """Each tool_use block's input: the final arguments, parsed (the same as streamed, but for a call the
        model wrote malformed after its start went out, which keeps what it streamed)."""
        by_id = {c.id: c for c in final.calls}
        for call_index, block_index in self.call_blocks.items():
            block = self.blocks[block_index]
            call = by_id.get(block["id"])
            block["input"] = _input_of(call.arguments if call is not None else self.arguments[call_index])


def _input_of(arguments: str) -> Any:
    try:
        return json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return {}
