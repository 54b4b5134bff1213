"""OpenAI's Responses API (POST /v1/responses), stateless, over the chat completions machinery.

Agents that speak only this API resend the whole conversation as `input` items every turn, so a server
that keeps nothing serves them: a request is translated into a chat completions request (its items into
chat messages, its tools and `text.format` into chat's), prompted and constrained by the same code
(openai_api.ChatCompletions), decoded by the same worker, and its answer (AnswerStream: reasoning,
content, tool calls) shaped as Responses output items: `reasoning`, `message`, `function_call`.
A streamed answer is OpenAI's event sequence (`response.created`, `response.output_item.added`, the
deltas, `response.output_item.done`, `response.completed`), each event with its `sequence_number`.

What an agent sends that this server cannot do is refused with a 400 that names it
(`previous_response_id`, `store: true`, images); what only shapes OpenAI's own service is accepted and
changes nothing (docs/guides/serving-and-agents.md, "The Responses API"). Hosted tools (web search, file search, ...) are not
offered to the model: this server runs none of them, and agents send them with every request.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import Field, ValidationError

from ..generation.generate import GenerationResult
from ..generation.worker import Done, Piece
from .answer_stream import AnswerStream, ArgumentsDelta, CallStarted, ContentDelta, Delta, FinalAnswer, ReasoningDelta
from .openai_api import (
    APIError,
    ChatCompletionRequest,
    ChatCompletions,
    OneAnswerReply,
    _error_from_validation,
    _Strict,
)

# Tools that OpenAI's service runs itself (the model only asks for them): not offered to a model here.
HOSTED_TOOLS = frozenset(
    {
        "web_search",
        "web_search_preview",
        "web_search_preview_2025_03_11",
        "file_search",
        "code_interpreter",
        "image_generation",
        "computer_use_preview",
        "mcp",
        "local_shell",
        "shell",
        "apply_patch",
        "tool_search",
    }
)
# `include` values: the reasoning comes back in the clear (a reasoning item's `content`), so asking for it
# encrypted changes nothing; nothing else can be included.
INCLUDABLE = frozenset({"reasoning.encrypted_content"})
# A custom (free-form) tool is offered to the model as a function with one string argument.
CUSTOM_INPUT = {
    "type": "object",
    "properties": {"input": {"type": "string"}},
    "required": ["input"],
    "additionalProperties": False,
}


class _TextOptions(_Strict):
    format: dict[str, Any] | None = None
    verbosity: str | None = None  # a hint for OpenAI's models about answer length: accepted, changes nothing


class _Reasoning(_Strict):
    effort: str | None = None
    summary: str | None = None  # reasoning comes back whole, as a reasoning item's content
    generate_summary: str | None = None


class ResponsesRequest(_Strict):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: _TextOptions | None = None
    reasoning: _Reasoning | None = None
    max_output_tokens: int | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: int | None = None  # moestream's extension (as chat's): a reproducible sampled answer
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    max_tool_calls: int | None = Field(default=None, ge=1)
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None
    # Refused when set: this server keeps no responses and runs nothing in the background.
    store: bool | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    prompt: Any = None
    top_logprobs: int | None = None
    # Who asks and how OpenAI bills or caches it: accepted, changes nothing.
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    client_metadata: dict[str, Any] | None = None

    def refused(self) -> None:
        if self.previous_response_id is not None:
            raise APIError(
                400,
                "this server keeps no responses, so previous_response_id cannot be followed: send the whole "
                "conversation in `input` (earlier messages, function_call and function_call_output items)",
                param="previous_response_id",
                code="unsupported_parameter",
            )
        if self.store:
            raise APIError(
                400,
                "this server stores no responses: send store false and the whole conversation in `input` every turn",
                param="store",
                code="unsupported_parameter",
            )
        for name, why in (
            ("conversation", "conversations are not stored here: send the whole conversation in `input`"),
            ("background", "background responses are not supported: send background false or leave it out"),
            ("prompt", "stored prompt templates are not supported: send the instructions and input"),
            ("top_logprobs", "top_logprobs is not supported by /v1/responses here; /v1/chat/completions has logprobs"),
        ):
            if getattr(self, name) not in (None, False):
                raise APIError(400, why, param=name, code="unsupported_parameter")
        for value in self.include or []:
            if value not in INCLUDABLE:
                raise APIError(400, f"include value {value!r} is not supported", param="include", code="unsupported_parameter")


class _Translated(ChatCompletionRequest):
    """The chat request a responses request becomes, with the request itself for the answer's shape."""

    source: ResponsesRequest
    custom_tools: list[str] = Field(default_factory=list)  # the names of free-form tools
    namespaces: dict[str, str] = Field(default_factory=dict)  # a namespaced function's name -> its namespace


class Responses(ChatCompletions):
    """POST /v1/responses: a responses request translated into a chat request (the same template, tool
    formats and grammars), answered as Responses output items."""

    name = "responses"
    request_model = ResponsesRequest
    prompt_param = "input"

    def parse(self, data: dict):
        try:
            return super().parse(data)
        except APIError as e:  # errors found by the chat code name chat's fields: name the request's own
            param = e.body["error"]["param"] or ""
            for chat, own in (("messages", "input"), ("response_format", "text.format"), ("max_tokens", "max_output_tokens")):
                if param.startswith(chat):
                    e.body["error"]["param"] = own + param[len(chat) :]
            raise

    def validate(self, data: dict) -> _Translated:
        """The request, validated as a ResponsesRequest (Endpoint.validate), then as the chat request it becomes."""
        req = super().validate(data)
        tools, custom, namespaces = _chat_tools(req.tools or [])
        chat: dict[str, Any] = {
            "messages": _chat_messages(req),
            "stream": req.stream,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "seed": req.seed,
            "max_completion_tokens": req.max_output_tokens,
            "parallel_tool_calls": req.parallel_tool_calls,
            "response_format": _response_format(req.text.format if req.text else None),
        }
        if tools:
            chat["tools"] = tools
        if req.tool_choice is not None and (tools or req.tool_choice != "auto"):
            chat["tool_choice"] = _chat_tool_choice(req.tool_choice)
        effort = req.reasoning.effort if req.reasoning is not None else None
        chat.update(self.thinking_options(None if effort is None else effort not in ("none", "minimal"), effort))
        try:
            translated = _Translated.model_validate({**chat, "source": req, "custom_tools": custom, "namespaces": namespaces})
        except ValidationError as e:
            error = _error_from_validation(e)
            raise APIError(400, error.body["error"]["message"].replace("messages", "input"), param="input") from None
        translated.refused()
        return translated

    def reply(self, req: _Translated) -> ResponsesReply:
        tool_format = self.tool_format(req)
        return ResponsesReply(
            self.model_name,
            self.fingerprint,
            self.tokenizer,
            self.vocabulary,
            source=req.source,
            tool_format=tool_format,
            custom_tools=req.custom_tools,
            namespaces=req.namespaces,
            parallel_tool_calls=req.parallel_tool_calls is not False,
        )


# -- requests into chat requests ----------------------------------------------------------------------------


def _text_of(content: Any, where: str) -> str:
    """The text of an item's content: a string, or parts of text (input_text, output_text, ...)."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise APIError(400, f"{where} must be a string or a list of content parts", param=where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text", "reasoning_text", "summary_text") and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        else:
            raise APIError(400, f"{where}[{j}] of type {kind!r} is not supported: send text", param=f"{where}[{j}]")
    return "".join(texts)


def _chat_messages(req: ResponsesRequest) -> list[dict]:
    """The conversation as chat messages: `instructions` as the system message, then the items in order.
    Calls join the assistant turn before them; reasoning passed back joins the assistant turn after it."""
    messages: list[dict] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        return [*messages, {"role": "user", "content": req.input}]
    reasoning: list[str] = []

    def assistant_turn() -> dict:
        last = messages[-1] if messages else None
        if last is None or last["role"] != "assistant":
            last = {"role": "assistant", "content": None}
            messages.append(last)
        if reasoning:
            last["reasoning_content"] = "\n".join(reasoning)
            reasoning.clear()
        return last

    for i, item in enumerate(req.input):
        kind = item.get("type", "message" if "role" in item else None)
        where = f"input[{i}]"
        if kind == "message":
            role = item.get("role")
            if role not in ("system", "developer", "user", "assistant"):
                raise APIError(400, f"{where}.role must be system, developer, user or assistant, not {role!r}", param=where)
            text = _text_of(item.get("content"), f"{where}.content")
            if role == "assistant":
                turn = assistant_turn()
                turn["content"] = (turn["content"] or "") + text
            else:
                messages.append({"role": role, "content": text})
        elif kind in ("function_call", "custom_tool_call"):
            if not isinstance(item.get("call_id"), str) or not isinstance(item.get("name"), str):
                raise APIError(400, f"{where} ({kind}) needs call_id and name", param=where)
            if kind == "function_call":
                arguments = item.get("arguments")
                if not isinstance(arguments, str):
                    raise APIError(400, f"{where}.arguments must be a string of JSON", param=f"{where}.arguments")
            else:
                arguments = json.dumps({"input": item.get("input") or ""}, ensure_ascii=False)
            call = {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": arguments}}
            turn = assistant_turn()
            turn.setdefault("tool_calls", []).append(call)
        elif kind in ("function_call_output", "custom_tool_call_output"):
            if not isinstance(item.get("call_id"), str):
                raise APIError(400, f"{where} ({kind}) needs call_id", param=where)
            messages.append(
                {"role": "tool", "tool_call_id": item["call_id"], "content": _text_of(item.get("output"), f"{where}.output")}
            )
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            text = _text_of(parts, f"{where}.content")
            if text:
                reasoning.append(text)
        else:
            raise APIError(
                400,
                f"{where} of type {kind!r} is not supported: send messages, function_call, function_call_output "
                "and reasoning items (item references need stored responses, which this server keeps none of)",
                param=where,
            )
    if not messages:
        raise APIError(400, "the input is empty: send at least one message", param="input")
    return messages


def _chat_tools(tools: list[dict]) -> tuple[list[dict], list[str], dict[str, str]]:
    """Responses tools as chat tools, the names of the free-form (custom) ones, and each namespaced
    function's namespace. A namespace's functions are offered by their own names; hosted tools are not
    offered."""
    chat, custom, namespaces = [], [], {}

    def function(tool: dict, where: str) -> dict:
        if not isinstance(tool.get("name"), str):
            raise APIError(400, f"{where} needs a name", param=where)
        described = {"name": tool["name"], "description": tool.get("description"), "parameters": tool.get("parameters")}
        return {"type": "function", "function": {k: v for k, v in described.items() if v is not None}}

    for i, tool in enumerate(tools):
        kind, where = tool.get("type"), f"tools[{i}]"
        if kind == "function":
            chat.append(function(tool, where))
        elif kind == "namespace":
            inner_tools = tool.get("tools") or []
            if not isinstance(inner_tools, list) or not all(isinstance(inner, dict) for inner in inner_tools):
                raise APIError(400, f"{where}.tools must be a list of tool objects", param=f"{where}.tools")
            for j, inner in enumerate(inner_tools):
                if inner.get("type", "function") == "function":
                    chat.append(function(inner, f"{where}.tools[{j}]"))
                    namespaces[inner["name"]] = tool.get("name")
        elif kind == "custom":
            chat.append(function({**tool, "parameters": CUSTOM_INPUT}, where))
            custom.append(tool.get("name"))
        elif kind not in HOSTED_TOOLS:
            raise APIError(400, f"{where} of type {kind!r} is not supported: send function tools", param=where)
    return chat, custom, namespaces


def _chat_tool_choice(choice: str | dict) -> str | dict:
    if isinstance(choice, str):
        return choice
    if choice.get("type") in ("function", "custom") and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise APIError(400, f"tool_choice {choice!r} is not supported: send none, auto, required or a function", param="tool_choice")


def _response_format(fmt: dict | None) -> dict | None:
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise APIError(400, "text.format of type json_schema needs a schema object", param="text.format")
        schema = {"name": fmt.get("name") or "response", "schema": fmt["schema"]}
        if fmt.get("strict") is not None:
            schema["strict"] = fmt["strict"]
        return {"type": "json_schema", "json_schema": schema}
    raise APIError(
        400,
        f"text.format of type {fmt.get('type')!r} is not supported: send text, json_object or json_schema",
        param="text.format",
    )


# -- answers into responses ---------------------------------------------------------------------------------


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesReply(OneAnswerReply):
    """One answer as a Responses object, or as its event stream. The items are built as the answer streams
    (reasoning, then the message, then each call); a non-streamed answer builds the same items at once."""

    id_prefix = "resp"
    response_object = "response"
    chunk_object = "response"

    def __init__(
        self,
        model_name: str,
        fingerprint: str,
        tokenizer,
        vocabulary=None,
        *,
        source: ResponsesRequest,
        tool_format=None,
        custom_tools: list[str] | None = None,
        namespaces: dict[str, str] | None = None,
        parallel_tool_calls: bool = True,
    ):
        super().__init__(model_name, fingerprint, tokenizer, vocabulary)
        self.id = _new_id("resp")
        self.created = int(time.time())
        self.source = source
        self.tool_format = tool_format
        self.custom_tools = set(custom_tools or [])
        self.namespaces = namespaces or {}
        self.parallel_tool_calls = parallel_tool_calls
        self.thinking = None  # set with the prompt (ChatCompletions.prompts)
        self.stream = None
        self.sequence = 0
        self.items: list[dict] = []  # output items, the last one possibly still open
        self.open = False  # whether the last item is still being written
        self.call_items: dict[int, dict] = {}  # call index -> its item
        self.cut = False  # the answer ended at max_output_tokens: its last item is incomplete

    @property
    def special_tokens(self) -> bool:
        return self.tool_format is not None

    def _answer_stream(self) -> AnswerStream:
        limit = self.source.max_tool_calls
        return AnswerStream(self.tool_format, self.thinking, limit if self.parallel_tool_calls else 1)

    # -- the response object --------------------------------------------------------------------------

    def _object(self, status: str, output: list[dict], usage: dict | None, result: GenerationResult | None = None) -> dict:
        src = self.source
        incomplete = None
        if result is not None and result.finish_reason == "length":
            incomplete = {"reason": "max_output_tokens"}
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "background": False,
            "error": None,
            "incomplete_details": incomplete,
            "instructions": src.instructions,
            "max_output_tokens": src.max_output_tokens,
            "max_tool_calls": src.max_tool_calls,
            "model": self.model_name,
            "output": output,
            "parallel_tool_calls": self.parallel_tool_calls,
            "previous_response_id": None,
            "reasoning": {"effort": src.reasoning.effort, "summary": src.reasoning.summary}
            if src.reasoning
            else {"effort": None, "summary": None},
            "store": False,
            "temperature": 1.0 if src.temperature is None else src.temperature,
            "text": {
                "format": src.text.format if src.text and src.text.format else {"type": "text"},
                **({"verbosity": src.text.verbosity} if src.text and src.text.verbosity else {}),
            },
            "tool_choice": src.tool_choice if src.tool_choice is not None else ("auto" if src.tools else "none"),
            "tools": src.tools or [],
            "top_p": 1.0 if src.top_p is None else src.top_p,
            "truncation": src.truncation or "disabled",
            "usage": usage,
            "user": src.user,
            "metadata": src.metadata or {},
        }

    def _usage(self, result: GenerationResult, final: FinalAnswer) -> dict:
        reasoning = len(self.tokenizer(final.reasoning, add_special_tokens=False)["input_ids"]) if final.reasoning else 0
        output = len(result.token_ids)
        return {
            "input_tokens": result.prompt_tokens,
            "input_tokens_details": {"cached_tokens": result.cached_tokens},
            "output_tokens": output,
            "output_tokens_details": {"reasoning_tokens": min(reasoning, output)},
            "total_tokens": result.prompt_tokens + output,
        }

    def _status(self, result: GenerationResult) -> str:
        return "incomplete" if result.finish_reason == "length" else "completed"

    def response(self, results: dict[int, GenerationResult]) -> dict:
        result = results[0]
        stream = self._answer_stream()
        deltas, final = stream.finish(result.text, result.finish_reason == "length")
        self.cut = result.finish_reason == "length"
        self._events(deltas)  # builds the items (the events are not sent)
        self._close()
        self._finish_calls(final)
        return self._object(self._status(result), self.items, self._usage(result, final), result)

    # -- the event stream ----------------------------------------------------------------------------------

    def sse(self, payload: dict) -> str:
        return f"event: {payload['type']}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    done_marker = False  # a responses stream ends with its response.completed event, no [DONE]

    def error_event(self, body: dict) -> dict:
        error = body["error"]
        return self._event("error", code=error.get("code"), message=error["message"], param=error.get("param"))

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def opening(self, index: int) -> list[dict]:
        self.stream = self._answer_stream()
        snapshot = self._object("in_progress", [], None)
        return [self._event("response.created", response=snapshot), self._event("response.in_progress", response=snapshot)]

    def chunk(self, piece: Piece) -> list[dict]:
        return self._events(self.stream.update(piece.text))

    def last_chunks(self, done: Done) -> list[dict]:
        result = done.result
        deltas, final = self.stream.finish(result.text, result.finish_reason == "length")
        self.cut = result.finish_reason == "length"
        events = self._events(deltas) + self._close()
        self._finish_calls(final)
        status = self._status(result)
        whole = self._object(status, self.items, self._usage(result, final), result)
        return [*events, self._event("response.completed" if status == "completed" else "response.incomplete", response=whole)]

    # -- items ------------------------------------------------------------------------------------------------

    def _events(self, deltas: list[Delta]) -> list[dict]:
        events: list[dict] = []
        for delta in deltas:
            if isinstance(delta, ReasoningDelta):
                events += self._text_delta("reasoning", delta.text)
            elif isinstance(delta, ContentDelta):
                events += self._text_delta("message", delta.text)
            elif isinstance(delta, CallStarted):
                events += self._close()
                custom = delta.name in self.custom_tools
                item = {
                    "type": "custom_tool_call" if custom else "function_call",
                    "id": _new_id("ctc" if custom else "fc"),
                    "call_id": delta.id,
                    "name": delta.name,
                    **({"input": ""} if custom else {"arguments": ""}),
                    "status": "in_progress",
                }
                if delta.name in self.namespaces:
                    item["namespace"] = self.namespaces[delta.name]
                self.call_items[delta.index] = item
                events += self._open(item)
            elif isinstance(delta, ArgumentsDelta):
                item = self.call_items[delta.index]
                if item["type"] == "function_call":
                    item["arguments"] += delta.text
                    events.append(
                        self._event(
                            "response.function_call_arguments.delta",
                            item_id=item["id"],
                            output_index=self._index(item),
                            delta=delta.text,
                        )
                    )
                else:  # a free-form tool's input is known once its JSON wrapper is whole
                    item.setdefault("_arguments", "")
                    item["_arguments"] += delta.text
        return events

    def _index(self, item: dict) -> int:
        return next(i for i, it in enumerate(self.items) if it is item)

    def _open(self, item: dict) -> list[dict]:
        self.items.append(item)
        self.open = True
        events = [self._event("response.output_item.added", output_index=len(self.items) - 1, item=_public(item))]
        if item["type"] == "message":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events.append(
                self._event(
                    "response.content_part.added",
                    item_id=item["id"],
                    output_index=len(self.items) - 1,
                    content_index=0,
                    part=part,
                )
            )
        return events

    def _text_delta(self, kind: str, text: str) -> list[dict]:
        events: list[dict] = []
        current = self.items[-1] if self.open else None
        if current is None or current["type"] != kind:
            events += self._close()
            if kind == "message":
                current = {"type": "message", "id": _new_id("msg"), "status": "in_progress", "role": "assistant", "content": []}
            else:
                current = {"type": "reasoning", "id": _new_id("rs"), "summary": [], "content": [], "status": "in_progress"}
            current["_text"] = ""
            events += self._open(current)
        current["_text"] += text
        where = dict(item_id=current["id"], output_index=len(self.items) - 1, content_index=0)
        if kind == "message":
            events.append(self._event("response.output_text.delta", **where, delta=text, logprobs=[]))
        else:
            events.append(self._event("response.reasoning_text.delta", **where, delta=text))
        return events

    def _close(self) -> list[dict]:
        """Close the item being written: its done events, and its final shape."""
        if not self.open:
            return []
        self.open = False
        item, index = self.items[-1], len(self.items) - 1
        events = []
        if item["type"] == "message":
            text = item.pop("_text")
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            item["content"] = [part]
            events.append(
                self._event(
                    "response.output_text.done", item_id=item["id"], output_index=index, content_index=0, text=text, logprobs=[]
                )
            )
            events.append(
                self._event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=part)
            )
        elif item["type"] == "reasoning":
            text = item.pop("_text")
            item["content"] = [{"type": "reasoning_text", "text": text}]
            events.append(
                self._event("response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0, text=text)
            )
        elif item["type"] == "function_call":
            events.append(
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
        else:  # a free-form tool's call: its input out of the JSON wrapper the model wrote
            item["input"] = _custom_input(item.pop("_arguments", ""))
        item["status"] = "incomplete" if self.cut else "completed"
        events.append(self._event("response.output_item.done", output_index=index, item=_public(item)))
        return events

    def _finish_calls(self, final: FinalAnswer) -> None:
        """The calls' items with the final arguments (the same as streamed, but for a call the model wrote
        malformed after its start went out)."""
        by_id = {c.id: c for c in final.calls}
        for item in self.call_items.values():
            call = by_id.get(item["call_id"])
            if call is not None and item["type"] == "function_call":
                item["arguments"] = call.arguments
            elif call is not None:
                item["input"] = _custom_input(call.arguments)


def _public(item: dict) -> dict:
    """An item as a client sees it (without what is kept only while it is written)."""
    return {k: v for k, v in item.items() if not k.startswith("_")}


def _custom_input(arguments: str) -> str:
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value.get("input", "") if isinstance(value, dict) and isinstance(value.get("input"), str) else arguments
