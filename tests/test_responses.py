"""POST /v1/responses through the real `openai` client on a served tiny model (random weights, a Hermes-style
tool template): text answers equal chat completions' on the same conversation, a json_schema text.format that
validates, a required call whose arguments parse, a function_call_output round trip, the event order of a
stream with arguments in several deltas, what agents send accepted and what cannot be served refused by name;
and, without a server, reasoning items from a template's reasoning block."""

import json

import jsonschema
import openai
import pytest
from test_openai_features import SCHEMA, TOOL_TEMPLATE, WEATHER, checkpoint, server  # noqa: F401 (fixtures)
from test_server import MODEL

from moestream.conversion.synthetic import byte_tokenizer
from moestream.generation.generate import GenerationResult
from moestream.generation.worker import Done, Piece
from moestream.server.responses_api import Responses

# The same function as a Responses tool (flat: no "function" wrapper).
WEATHER_TOOL = {"type": "function", **WEATHER["function"]}


def _chat_text(server, messages, **kw) -> str:  # noqa: F811
    return server.client.chat.completions.create(model=MODEL, messages=messages, **kw).choices[0].message.content


def test_a_text_answer_is_the_chat_answer_to_the_same_conversation(server):  # noqa: F811
    answer = server.client.responses.create(model=MODEL, input="Hello there", max_output_tokens=12, temperature=0)
    assert answer.id.startswith("resp_") and answer.object == "response"
    assert [item.type for item in answer.output] == ["message"] and answer.output[0].id.startswith("msg_")
    assert answer.output_text == _chat_text(server, [{"role": "user", "content": "Hello there"}], max_tokens=12, temperature=0)
    assert answer.status == "incomplete" and answer.incomplete_details.reason == "max_output_tokens"
    assert answer.output[0].status == "incomplete"
    assert answer.usage.output_tokens == 12 and answer.usage.input_tokens > 0
    # instructions are the system message; items in any of the shapes clients send
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}], "id": "msg_1"},
    ]
    answer = server.client.responses.create(
        model=MODEL, input=items, instructions="You help.", max_output_tokens=6, extra_body={"seed": 3}
    )
    chat = [
        {"role": "system", "content": "You help."},
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ]
    assert answer.output_text == _chat_text(server, chat, max_tokens=6, seed=3)


def test_a_json_schema_text_format_validates(server):  # noqa: F811
    fmt = {"type": "json_schema", "name": "answer", "schema": SCHEMA, "strict": True}
    answer = server.client.responses.create(
        model=MODEL, input="Colors?", max_output_tokens=80, extra_body={"seed": 1}, text={"format": fmt}
    )
    jsonschema.validate(json.loads(answer.output_text), SCHEMA)
    assert answer.text.format.type == "json_schema"


def test_a_required_call_and_its_output_round_trip(server):  # noqa: F811
    answer = server.client.responses.create(
        model=MODEL, input="Weather?", tools=[WEATHER_TOOL], tool_choice="required", max_output_tokens=150, extra_body={"seed": 5}
    )
    calls = [item for item in answer.output if item.type == "function_call"]
    assert calls and all(c.name == "get_weather" and c.call_id.startswith("call_") and c.id.startswith("fc_") for c in calls)
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), WEATHER["function"]["parameters"])
    # the next turn: the calls and their outputs go back as items, and reach the template as chat's tool messages do
    outputs = [{"type": "function_call_output", "call_id": c.call_id, "output": "sunny, 21 C"} for c in calls]
    items = [{"role": "user", "content": "Weather?"}, *[c.model_dump(exclude_none=True) for c in calls], *outputs]
    follow = server.client.responses.create(model=MODEL, input=items, tools=[WEATHER_TOOL], max_output_tokens=4, temperature=0)
    messages = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls
            ],
        },
        *[{"role": "tool", "tool_call_id": c.call_id, "content": "sunny, 21 C"} for c in calls],
    ]
    chat = server.client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=4, temperature=0)
    assert follow.usage.input_tokens == chat.usage.prompt_tokens
    assert follow.output_text == (chat.choices[0].message.content or "")


def test_a_stream_follows_openais_event_order(server):  # noqa: F811
    kwargs = dict(
        model=MODEL,
        input="Weather?",
        tools=[WEATHER_TOOL],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=150,
    )
    with server.client.responses.stream(**kwargs, extra_body={"seed": 9}) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) > 1 and kinds.index("response.function_call_arguments.delta") == 3
    (call,) = final.output
    assert call.type == "function_call" and "".join(deltas) == call.arguments
    jsonschema.validate(json.loads(call.arguments), WEATHER["function"]["parameters"])
    assert events[2].item.name == "get_weather" and events[2].item.call_id == call.call_id
    # the same answer as the non-streamed request with the same seed
    whole = server.client.responses.create(**kwargs, extra_body={"seed": 9})
    assert [(c.name, c.arguments) for c in whole.output] == [(call.name, call.arguments)]
    # text: output_text deltas inside a message item, the same text as answered whole
    with server.client.responses.stream(model=MODEL, input="Hi", max_output_tokens=10, extra_body={"seed": 2}) as stream:
        events = list(stream)
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = [e for e in events if e.type == "response.output_text.done"]
    assert done and done[0].text == text == events[-1].response.output_text
    assert events[-1].type == "response.incomplete"
    assert (
        server.client.responses.create(model=MODEL, input="Hi", max_output_tokens=10, extra_body={"seed": 2}).output_text == text
    )


# What an agent CLI sends with every request (its tools of every kind, reasoning passed back, its metadata).
AGENT_REQUEST = {
    "model": MODEL,
    "input": [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Agent."}]},
        {"type": "message", "role": "user", "id": "msg_a", "content": [{"type": "input_text", "text": "ls?"}]},
        {
            "type": "reasoning",
            "id": "rs_1",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": "hm"}],
            "encrypted_content": None,
        },
        {
            "type": "function_call",
            "id": "fc_1",
            "status": "completed",
            "name": "exec_command",
            "arguments": '{"cmd":"ls"}',
            "call_id": "c1",
        },
        {"type": "function_call_output", "id": "fco_1", "call_id": "c1", "output": "a"},
        {"type": "custom_tool_call", "id": "ctc_1", "call_id": "c2", "name": "apply_patch", "input": "p"},
        {"type": "custom_tool_call_output", "call_id": "c2", "output": "ok"},
    ],
    "tools": [
        {
            "type": "function",
            "name": "exec_command",
            "description": "Run",
            "strict": False,
            "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]},
        },
        {
            "type": "namespace",
            "name": "agents",
            "description": "Agents",
            "tools": [{"type": "function", "name": "spawn_agent", "parameters": {"type": "object", "properties": {}}}],
        },
        {"type": "web_search", "external_web_access": True},
        {
            "type": "custom",
            "name": "apply_patch",
            "description": "Patch",
            "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"},
        },
    ],
    "tool_choice": "auto",
    "parallel_tool_calls": True,
    "reasoning": {"summary": "auto", "effort": "medium"},
    "store": False,
    "stream": True,
    "include": ["reasoning.encrypted_content"],
    "prompt_cache_key": "session-1",
    "text": {"verbosity": "low"},
    "client_metadata": {"session_id": "s"},
    "max_output_tokens": 4,
}


def test_what_agents_send_is_accepted_and_what_cannot_be_served_is_refused_by_name(server):  # noqa: F811
    # (the tiny model's context is 256 tokens: the whole agent request is parsed offline below)
    short = {**AGENT_REQUEST, "input": AGENT_REQUEST["input"][:2]}
    with server.http.stream("POST", "/v1/responses", json=short) as response:
        assert response.status_code == 200, response.read()
        body = "".join(response.iter_text())
    events = [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: ")]
    assert body.startswith("event: response.created\n") and "[DONE]" not in body
    assert (
        events[-1]["type"] in ("response.completed", "response.incomplete")
        and events[-1]["response"]["usage"]["input_tokens"] > 0
    )
    refused = [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"store": True}, "store"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]"),
        ({"tools": [{"type": "computer_use", "name": "x"}]}, "tools[0]"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"tools": [{"type": "namespace", "name": "n", "tools": ["x"]}]}, "tools[0].tools"),
        ({"tools": [{"type": "namespace", "name": "n", "tools": 5}]}, "tools[0].tools"),
        ({"frequency_penalty": 1}, "frequency_penalty"),
        ({"input": []}, "input"),
    ]
    for fields, param in refused:
        response = server.http.post("/v1/responses", json={"model": MODEL, "input": "Hi", **fields})
        assert response.status_code == 400 and response.json()["error"]["param"] == param, (fields, response.json())
    with pytest.raises(openai.NotFoundError):
        server.client.responses.create(model="other", input="Hi")


def test_an_agents_whole_request_reaches_the_template():
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = TOOL_TEMPLATE
    parsed = Responses(tokenizer, MODEL, 4096, 64).parse(AGENT_REQUEST)
    prompt = tokenizer.decode(parsed.choices[0].prompt_ids)
    assert prompt.startswith("Tools: exec_command spawn_agent apply_patch\n")  # the namespace's, the custom one; no web_search
    assert "Developer: Agent." in prompt and '"arguments": {"cmd": "ls"}' in prompt and '"arguments": {"input": "p"}' in prompt
    assert "<tool_response>a</tool_response>" in prompt and "<tool_response>ok</tool_response>" in prompt
    assert parsed.stream and parsed.choices[0].params.max_tokens == 4


THINK_TEMPLATE = (
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: <think>\n{% endif %}{# </think> closes a thought #}"
)


def _offline_reply(template: str, answer: str, **request):
    """A Responses endpoint without a server: the request parsed, and the answer text shaped."""
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = template
    endpoint = Responses(tokenizer, MODEL, 4096, 64)
    parsed = endpoint.parse({"input": "Why?", **request})
    ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
    result = GenerationResult(answer, len(parsed.choices[0].prompt_ids), ids, 0.1, 0.01, 10.0, "stop")
    return parsed, result


def test_reasoning_comes_back_as_a_reasoning_item_streamed_or_whole():
    answer = "Because the sky scatters blue.\n</think>\n\nRayleigh scattering."
    parsed, result = _offline_reply(THINK_TEMPLATE, answer)
    whole = parsed.reply.response({0: result})
    assert [item["type"] for item in whole["output"]] == ["reasoning", "message"]
    assert whole["output"][0]["content"] == [{"type": "reasoning_text", "text": "Because the sky scatters blue."}]
    assert whole["output"][1]["content"][0]["text"] == "Rayleigh scattering."
    assert whole["usage"]["output_tokens_details"]["reasoning_tokens"] > 0
    parsed, result = _offline_reply(THINK_TEMPLATE, answer)
    reply = parsed.reply
    events = reply.opening(0)
    for k in range(0, len(answer), 3):
        events += reply.chunk(Piece(0, answer[k : k + 3], []))
    events += reply.last_chunks(Done(0, result))
    reasoning = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert reasoning == "Because the sky scatters blue." and text == "Rayleigh scattering."
    assert [item["type"] for item in events[-1]["response"]["output"]] == ["reasoning", "message"]
    # a reasoning item passed back joins the next assistant turn for the template
    parsed, _ = _offline_reply(
        "{% for m in messages %}{{ m.role }}[{{ m.reasoning_content }}]: {{ m.content }}\n{% endfor %}",
        "x",
        input=[
            {"role": "user", "content": "Why?"},
            {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "scattering"}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Blue."}]},
            {"role": "user", "content": "More?"},
        ],
    )
    prompt = byte_tokenizer().decode(parsed.choices[0].prompt_ids)
    assert "assistant[scattering]: Blue." in prompt


def test_xml_call_arguments_are_typed_by_the_requests_tool_schemas():
    """Qwen3-Coder's calls write values as text: the server types them by the tool's schema."""
    template = "{% for m in messages %}{{ m.content }}{% endfor %}<function=f><parameter=x>"  # marks the format
    answer = "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
    parsed, result = _offline_reply(template, answer, tools=[WEATHER_TOOL])
    (call,) = parsed.reply.response({0: result})["output"]
    assert call["type"] == "function_call" and json.loads(call["arguments"]) == {"city": "Oslo", "days": 3}


def test_custom_tools_come_back_as_custom_calls_and_max_tool_calls_holds():
    custom = {"type": "custom", "name": "apply_patch", "description": "Patch"}
    answer = (
        '<tool_call>\n{"name": "apply_patch", "arguments": {"input": "*** Begin Patch\\n"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}\n</tool_call>'
    )
    parsed, result = _offline_reply(TOOL_TEMPLATE, answer, tools=[custom, WEATHER_TOOL])
    output = parsed.reply.response({0: result})["output"]
    assert [item["type"] for item in output] == ["custom_tool_call", "function_call"]
    assert output[0]["input"] == "*** Begin Patch\n" and output[0]["name"] == "apply_patch"
    parsed, result = _offline_reply(TOOL_TEMPLATE, answer, tools=[custom, WEATHER_TOOL], max_tool_calls=1)
    assert [item["type"] for item in parsed.reply.response({0: result})["output"]] == ["custom_tool_call"]
