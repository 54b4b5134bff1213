"""POST /v1/messages (Anthropic's Messages API) through the real `anthropic` client on a served tiny model
(random weights, a Hermes-style tool template): greedy answers equal chat completions' and responses' on the
same conversation, system strings and blocks, a system message inside `messages`, stop sequences and the
max_tokens cut, the stream's event order, a forced tool call whose input validates and streams as
`input_json_delta` pieces, a tool_result round trip, structured output, count_tokens, errors in Anthropic's
shape; and, without a server, what an agent CLI sends, thinking blocks, the attribution line left out of the
prompt, and a template that takes a system message only first."""

import asyncio
import json
import threading

import anthropic
import jsonschema
import openai
import pytest
from test_openai_features import SCHEMA, TOOL_TEMPLATE, WEATHER, checkpoint, server  # noqa: F401 (fixtures)
from test_server import MODEL, Server

from moestream.cli import main
from moestream.conversion.synthetic import byte_tokenizer
from moestream.generation.generate import GenerationResult, SamplingParams
from moestream.generation.worker import Choice, Done, Job, Piece, Quiet
from moestream.server.anthropic_api import Messages

# The same function as an Anthropic tool.
WEATHER_TOOL = {
    "name": "get_weather",
    "description": WEATHER["function"]["description"],
    "input_schema": WEATHER["function"]["parameters"],
}


@pytest.fixture(scope="module")
def claude(server):  # noqa: F811
    return anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=120)


def _text(message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def test_a_greedy_answer_is_chat_and_responses_answer_to_the_same_conversation(server, claude):  # noqa: F811
    answer = claude.messages.create(
        model=MODEL,
        system="You help.",
        messages=[{"role": "user", "content": "Hello there"}],
        max_tokens=12,
        extra_body={"temperature": 0},
    )
    assert answer.id.startswith("msg_") and answer.type == "message" and answer.role == "assistant"
    assert answer.model == MODEL and answer.stop_reason == "max_tokens" and answer.usage.output_tokens == 12
    chat = server.client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "You help."}, {"role": "user", "content": "Hello there"}],
        max_tokens=12,
        temperature=0,
    )
    response = server.client.responses.create(
        model=MODEL, instructions="You help.", input="Hello there", max_output_tokens=12, temperature=0
    )
    assert _text(answer) == chat.choices[0].message.content == response.output_text
    prompt = chat.usage.prompt_tokens
    assert answer.usage.input_tokens + answer.usage.cache_read_input_tokens == prompt
    # system as blocks (with cache_control, and an agent's attribution line first) and content as blocks:
    # the same prompt, and the attribution line is not part of it
    blocks = claude.messages.create(
        model="claude-any-name",  # agents ask for their vendor's names: the served model answers
        system=[
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.0.abc; cc_entrypoint=cli;"},
            {"type": "text", "text": "You help.", "cache_control": {"type": "ephemeral"}},
        ],
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]}],
        max_tokens=12,
        metadata={"user_id": "u"},
        extra_body={"temperature": 0},
    )
    assert _text(blocks) == _text(answer) and blocks.model == MODEL
    assert blocks.usage.input_tokens + blocks.usage.cache_read_input_tokens == prompt
    # the second time, the prompt's KV comes from the prefix cache
    assert blocks.usage.cache_read_input_tokens > 0
    # a system message inside the conversation, as agents send it since 2026
    inner = [{"role": "user", "content": "Hi"}, {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Go"}]
    answer = claude.messages.create(model=MODEL, messages=inner, max_tokens=6, extra_body={"temperature": 0})
    chat = server.client.chat.completions.create(model=MODEL, messages=inner, max_tokens=6, temperature=0)
    assert _text(answer) == chat.choices[0].message.content


def test_stop_sequences_and_the_max_tokens_cut(claude):
    free = claude.messages.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Count"}],
        max_tokens=24,
        stop_sequences=[],
        extra_body={"temperature": 0},
    )
    text = _text(free)
    stop = text[5:8]
    assert len(stop) == 3 and free.stop_reason == "max_tokens"
    stopped = claude.messages.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Count"}],
        max_tokens=24,
        stop_sequences=["\x00\x01", stop],
        extra_body={"temperature": 0},
    )
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
    assert _text(stopped) == text[: text.index(stop)]


def test_a_stream_follows_anthropics_event_order(claude):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=10, extra_body={"seed": 2})
    with claude.messages.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds[1:3] == ["content_block_start", "text"] or kinds[1:3] == ["content_block_start", "content_block_delta"]
    assert "content_block_stop" in kinds and kinds.index("content_block_stop") < kinds.index("message_delta")
    streamed = "".join(e.text for e in events if e.type == "text")
    whole = claude.messages.create(**kwargs)
    assert streamed == _text(final) == _text(whole) and final.stop_reason == whole.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 10


def test_a_forced_tool_call_streams_its_input_and_its_result_round_trips(server, claude):  # noqa: F811
    kwargs = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather?"}],
        tools=[WEATHER_TOOL],
        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
        max_tokens=150,
        extra_body={"seed": 5},
    )
    with claude.messages.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_message()
    (call,) = final.content
    assert call.type == "tool_use" and call.name == "get_weather" and final.stop_reason == "tool_use"
    jsonschema.validate(call.input, WEATHER_TOOL["input_schema"])
    pieces = [e.delta.partial_json for e in events if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]
    assert len(pieces) > 1 and json.loads("".join(pieces)) == call.input
    whole = claude.messages.create(**kwargs)
    assert [(b.type, b.name, b.input) for b in whole.content] == [("tool_use", call.name, call.input)]
    # "any" forces a call too
    choice = {"type": "any", "disable_parallel_tool_use": True}
    anyone = claude.messages.create(**{**kwargs, "tool_choice": choice, "extra_body": {"seed": 6}})
    assert anyone.stop_reason == "tool_use" and [b.type for b in anyone.content] == ["tool_use"]
    # the next turn: the call and its result, as chat's tool_calls and tool message reach the template
    follow = claude.messages.create(
        model=MODEL,
        messages=[
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": call.id, "name": call.name, "input": call.input}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny, 21 C"}]},
        ],
        tools=[WEATHER_TOOL],
        max_tokens=4,
        extra_body={"temperature": 0},
    )
    arguments = json.dumps(call.input)
    chat = server.client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": call.id, "type": "function", "function": {"name": call.name, "arguments": arguments}}],
            },
            {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
        ],
        tools=[WEATHER],
        max_tokens=4,
        temperature=0,
    )
    assert follow.usage.input_tokens + follow.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert _text(follow) == (chat.choices[0].message.content or "")


def test_structured_output_validates_and_count_tokens_is_the_prompt(server, claude):  # noqa: F811
    answer = claude.messages.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Colors?"}],
        max_tokens=80,
        extra_body={"seed": 1, "output_config": {"format": {"type": "json_schema", "schema": SCHEMA}}},
    )
    jsonschema.validate(json.loads(_text(answer)), SCHEMA)
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Which city?"},
        {"role": "user", "content": "Oslo"},
    ]
    counted = claude.messages.count_tokens(model=MODEL, system="Be brief.", messages=messages, tools=[WEATHER_TOOL])
    chat = server.client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "Be brief."}, *messages], tools=[WEATHER], max_tokens=1
    )
    assert counted.input_tokens == chat.usage.prompt_tokens


def test_errors_have_anthropics_shape(server, claude):  # noqa: F811
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    refused = [
        ({"messages": [{"role": "user", "content": [image]}]}, "messages.0.content.0"),
        ({"unknown_field": 1}, "unknown_field"),
        ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools.0"),
        ({"mcp_servers": [{"type": "url", "url": "http://x"}]}, "MCP"),
        ({"thinking": {"type": "sometimes"}}, "thinking"),
        ({"tool_choice": {"type": "any"}}, "tool_choice"),
        ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The"}]}, "prefill"),
        ({"messages": [{"role": "user", "content": "Hi", "name": "x"}]}, "messages.0.name"),
    ]
    for fields, named in refused:
        body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}], **fields}
        response = server.http.post("/v1/messages", json=body)
        error = response.json()
        assert response.status_code == 400 and error["type"] == "error", (fields, error)
        assert error["error"]["type"] == "invalid_request_error" and named in error["error"]["message"], (fields, error)
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=MODEL, messages=[{"role": "user", "content": "x" * 300}], max_tokens=4)
    assert e.value.body["error"]["message"].startswith("prompt is too long: ")
    response = server.http.post("/v1/messages", content=b"{not json")
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"
    assert server.http.post("/v1/messages/batches", json={}).json()["error"]["type"] == "not_found_error"
    # the other APIs keep OpenAI's shape
    assert "type" not in server.http.post("/v1/chat/completions", content=b"{").json()


def test_the_context_window_is_where_clients_read_it_and_a_key_may_come_as_x_api_key(checkpoint, tmp_path):  # noqa: F811
    s = Server(checkpoint[1], tmp_path / "server.log", "--context", "128", "--api-key", "secret")
    try:
        assert s.http.head("/").status_code == 200 and s.http.get("/").status_code == 200
        headers = {"x-api-key": "secret"}
        (card,) = s.http.get("/v1/models", headers=headers).json()["data"]
        assert card["max_model_len"] == card["context_length"] == 128 and card["meta"]["n_ctx_train"] == 256
        assert card["id"] == MODEL and card["type"] == "model"
        props = s.http.get("/props", headers=headers).json()
        assert props["n_ctx"] == props["default_generation_settings"]["n_ctx"] == 128
        assert props["chat_template"] == TOOL_TEMPLATE and props["model_alias"] == MODEL
        client = anthropic.Anthropic(base_url=s.url, api_key="secret", max_retries=0, timeout=120)
        answer = client.messages.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=32000, extra_body={"temperature": 0}
        )
        # max_tokens is a cap: the answer gets the room the window leaves, and says where it was cut
        usage = answer.usage
        assert answer.stop_reason == "model_context_window_exceeded"
        assert usage.input_tokens + usage.cache_read_input_tokens + usage.output_tokens == 128
        # max_tokens 0 prefills the prompt for the prefix cache and answers nothing
        messages = [{"role": "user", "content": "Warm me up"}]
        warm = client.messages.create(model=MODEL, messages=messages, max_tokens=0)
        assert warm.content == [] and warm.usage.output_tokens == 0 and warm.stop_reason == "max_tokens"
        again = client.messages.create(model=MODEL, messages=messages, max_tokens=2)
        assert again.usage.cache_read_input_tokens >= warm.usage.input_tokens - 1
        with pytest.raises(anthropic.BadRequestError, match="prompt is too long"):
            client.messages.create(model=MODEL, messages=[{"role": "user", "content": "y" * 140}], max_tokens=8)
        # the Responses API's own error, which Responses-API agents answer by compacting
        keyed = openai.OpenAI(base_url=s.url + "/v1", api_key="secret", max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:
            keyed.responses.create(model=MODEL, input="y" * 140, max_output_tokens=8)
        assert e.value.code == "context_length_exceeded" and e.value.param == "input"
        with pytest.raises(anthropic.AuthenticationError) as e:
            anthropic.Anthropic(base_url=s.url, api_key="wrong", max_retries=0).messages.create(
                model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1
            )
        assert e.value.body["error"]["type"] == "authentication_error"
    finally:
        s.stop()


def test_a_context_beyond_the_models_is_refused(checkpoint, capsys):  # noqa: F811
    assert main(["serve", str(checkpoint[1]), "--context", "100000", "--port", "0"]) != 0
    assert "--context 100000 is beyond this model's context window (256 tokens" in capsys.readouterr().err


# -- without a server --------------------------------------------------------------------------------------


def _endpoint(template: str = TOOL_TEMPLATE) -> Messages:
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = template
    return Messages(tokenizer, MODEL, 65536, 64)


def _prompt(endpoint: Messages, body: dict) -> str:
    parsed = endpoint.parse(body)
    return endpoint.tokenizer.decode(parsed.choices[0].prompt_ids)


# The shape of an Anthropic-API agent CLI's request as seen on the wire (its texts shortened): system blocks
# led by an attribution line, a system message inside `messages` (with a per-turn output_config), tools with
# draft 2020-12 schemas and a deferred one, adaptive thinking not displayed, an effort, context management.
def agent_request(attribution: str = "cc_version=2.1.332.1c9; cc_entrypoint=sdk-cli;") -> dict:
    schema = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "type": "object",
        "properties": {"command": {"type": "string"}, "description": {"type": "string"}},
        "required": ["command"],
        "additionalProperties": False,
    }
    return {
        "model": "claude-opus-5-5",
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "<system-reminder>Attribute commits.</system-reminder>"},
                    {"type": "text", "text": "Run echo hi"},
                ],
            },
            {
                "role": "system",
                "content": [{"type": "text", "text": "# Environment\nLinux", "cache_control": {"type": "ephemeral"}}],
                "output_config": {"effort": "medium"},
            },
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "", "signature": "sig"},
                    {"type": "tool_use", "id": "toolu_01", "name": "Bash", "input": {"command": "echo hi"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "tool_use_id": "toolu_01",
                        "type": "tool_result",
                        "content": "hi",
                        "is_error": False,
                        "cache_control": {"type": "ephemeral"},
                    }
                ],
            },
        ],
        "system": [
            {"type": "text", "text": f"x-anthropic-billing-header: {attribution}"},
            {"type": "text", "text": "You are an agent.", "cache_control": {"type": "ephemeral"}},
        ],
        "tools": [
            {"name": "Bash", "description": "Run a command", "input_schema": schema},
            {"name": "Read", "description": "Read a file", "input_schema": {**schema, "required": []}},
            {
                "name": "DeferredToolPlaceholder",
                "description": "More tools",
                "input_schema": {"type": "object", "properties": {}},
                "defer_loading": True,
            },
        ],
        "metadata": {"user_id": json.dumps({"device_id": "d", "session_id": "s"})},
        "max_tokens": 32000,
        "thinking": {"type": "adaptive", "display": "omitted"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
        "stream": True,
    }


def test_an_agents_whole_request_reaches_the_template_and_its_attribution_line_does_not():
    endpoint = _endpoint()
    prompt = _prompt(endpoint, agent_request())
    assert prompt.startswith("Tools: Bash Read DeferredToolPlaceholder\nSystem: You are an agent.\n\nUser: ")
    assert "billing" not in prompt and "cc_version" not in prompt
    assert "User: <system-reminder>Attribute commits.</system-reminder>Run echo hi\n\nSystem: # Environment\nLinux" in prompt
    assert 'Assistant: <tool_call>\n{"name": "Bash", "arguments": {"command": "echo hi"}}\n</tool_call>' in prompt
    assert "Tool: <tool_response>hi</tool_response>" in prompt
    # a changed attribution line changes nothing, so the next turn's prefix is reused
    assert _prompt(endpoint, agent_request("cc_version=2.1.332.e8f; cc_entrypoint=sdk-cli;")) == prompt
    parsed = endpoint.parse(agent_request())
    assert parsed.stream and parsed.choices[0].params.max_tokens == 32000 and not parsed.reply.window_cap
    # a window smaller than prompt + max_tokens: the answer gets the room that is left
    small = Messages(endpoint.tokenizer, MODEL, 4096, 64).parse(agent_request())
    assert small.choices[0].params.max_tokens == 4096 - len(small.choices[0].prompt_ids) and small.reply.window_cap


def test_a_template_that_takes_a_system_message_only_first_gets_it_in_the_next_user_turn():
    check = (
        "{% if m.role == 'system' and not loop.first %}"
        "{{ raise_exception('System message must be at the beginning.') }}{% endif %}"
    )
    lenient = (
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
    )
    strict = lenient.replace("{% for m in messages %}", "{% for m in messages %}" + check)
    body = {
        "system": "Be brief.",
        "max_tokens": 8,
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "system", "content": "Today is Sunday."},
            {"role": "user", "content": "What day?"},
        ],
    }
    prompt = _prompt(_endpoint(strict), body)
    assert prompt == "system: Be brief.\nuser: Hi\nassistant: Hello.\nuser: Today is Sunday.\n\nWhat day?\nassistant:"
    # a template that takes it where it stands gets it there
    assert "\nsystem: Today is Sunday.\nuser: What day?" in _prompt(_endpoint(lenient), body)


THINK_TEMPLATE = (
    "{% for m in messages %}{{ m.role }}[{{ m.reasoning_content }}]: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: <think>\n{% endif %}{# </think> closes a thought #}"
)


def _answer(parsed, answer: str, finish: str = "stop") -> GenerationResult:
    ids = byte_tokenizer()(answer, add_special_tokens=False)["input_ids"]
    return GenerationResult(answer, len(parsed.choices[0].prompt_ids), ids, 0.1, 0.01, 10.0, finish)


@pytest.mark.parametrize("display", ["summarized", "omitted"])
def test_reasoning_comes_back_as_a_thinking_block_streamed_or_whole(display):
    answer = "Because the sky scatters blue.\n</think>\n\nRayleigh scattering."
    body = {
        "messages": [{"role": "user", "content": "Why?"}],
        "max_tokens": 64,
        "thinking": {"type": "enabled", "budget_tokens": 1024, "display": display},
    }
    thought = "Because the sky scatters blue." if display == "summarized" else ""
    parsed = _endpoint(THINK_TEMPLATE).parse(body)
    whole = parsed.reply.response({0: _answer(parsed, answer)})
    assert whole["content"] == [
        {"type": "thinking", "thinking": thought, "signature": ""},
        {"type": "text", "text": "Rayleigh scattering."},
    ]
    assert whole["stop_reason"] == "end_turn"
    parsed = _endpoint(THINK_TEMPLATE).parse(body)
    reply, events = parsed.reply, parsed.reply.opening(0)
    for k in range(0, len(answer), 3):
        events += reply.chunk(Piece(0, answer[k : k + 3], []))
    events += reply.last_chunks(Done(0, _answer(parsed, answer)))
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert starts == ["thinking", "text"]
    deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
    assert "".join(d.get("thinking", "") for d in deltas) == thought
    assert "".join(d.get("text", "") for d in deltas) == "Rayleigh scattering."
    assert [e["type"] for e in events if e["type"] != "content_block_delta"] == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_stop",
        "content_block_start",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    # thinking passed back joins its assistant turn for the template
    back = {
        "max_tokens": 4,
        "messages": [
            {"role": "user", "content": "Why?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "scattering", "signature": "s"},
                    {"type": "text", "text": "Blue."},
                    {"type": "redacted_thinking", "data": "opaque"},
                ],
            },
            {"role": "user", "content": "More?"},
        ],
    }
    assert "assistant[scattering]: Blue." in _prompt(_endpoint(THINK_TEMPLATE), back)


def test_thinking_switches_the_templates_thinking():
    template = "{% if enable_thinking is defined and not enable_thinking %}NO-THINK {% endif %}" + THINK_TEMPLATE
    body = {"messages": [{"role": "user", "content": "Why?"}], "max_tokens": 4}
    assert _prompt(_endpoint(template), {**body, "thinking": {"type": "disabled"}}).startswith("NO-THINK ")
    for thinking in ({"type": "enabled", "budget_tokens": 2048}, {"type": "adaptive"}, None):
        assert not _prompt(_endpoint(template), {**body, "thinking": thinking}).startswith("NO-THINK ")
    effort = "{{ reasoning_effort }} " + THINK_TEMPLATE
    assert _prompt(_endpoint(effort), {**body, "output_config": {"effort": "max"}}).startswith("high ")


def test_a_quiet_stream_is_told_alive():
    """While a long prompt is prefilled nothing comes: the job's output says so every `quiet_after` seconds."""

    async def run() -> list:
        worker = type("W", (), {"_cancel": lambda self, job: None})()
        job = Job([Choice([1], SamplingParams())], 30.0, 1e12, worker, asyncio.get_running_loop())
        job.request = type("R", (), {"started": True})()
        timer = threading.Timer(0.5, lambda: job._post("done", Done(0, GenerationResult("", 1, [], 0, 0, 0, "stop"))))
        timer.start()
        return [type(item).__name__ async for item in job.output(quiet_after=0.1)]

    kinds = asyncio.run(run())
    assert kinds[-1] == "Done" and 2 <= kinds.count("Quiet") == len(kinds) - 1
    assert Quiet() == Quiet()
