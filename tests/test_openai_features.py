"""The OpenAI API beyond plain text: structured outputs, tool calls, logprobs, logit_bias, penalties, n > 1,
prompt lists, echo, system_fingerprint, cached_tokens and the refusal of what is not served, driven by the
real `openai` client against a served tiny model (random weights: a schema is followed only because the
grammar forces it)."""

import json
import math

import jsonschema
import openai
import pytest
import torch
from test_server import MODEL, Server
from tiny import tiny_checkpoint
from transformers import AutoModelForCausalLM

from moestream.cli import main
from moestream.conversion.synthetic import byte_tokenizer
from moestream.generation.generate import Decoding, SamplingParams, chat_prompt
from moestream.generation.serving import stream

# A chat template of the Hermes family's tool-call format (the model answers a call as
# <tool_call>{"name": ..., "arguments": {...}}</tool_call>), written for these tests.
TOOL_TEMPLATE = (
    "{% if tools %}Tools:{% for t in tools %} {{ t.function.name }}{% endfor %}\n\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' and m.tool_calls %}Assistant: {% for c in m.tool_calls %}<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}\n\n'
    "{% elif m.role == 'tool' %}Tool: <tool_response>{{ m.content }}</tool_response>\n\n"
    "{% else %}{{ m.role | capitalize }}: {{ m.content }}\n\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"
)

# Random weights satisfy this by chance with a negligible probability: three keys in order, closed sets.
SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 1, "maximum": 9},
        "ok": {"type": "boolean"},
    },
    "required": ["color", "count", "ok"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "minimum": 1, "maximum": 5}},
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("features")
    _, ckpt = tiny_checkpoint("qwen3_moe", root / "hf", seed=11)
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = TOOL_TEMPLATE
    tokenizer.save_pretrained(ckpt)
    assert main(["convert", str(ckpt), str(root / "store"), "--experts-dtype", "fp32"]) == 0
    return ckpt, root / "store"


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    s = Server(checkpoint[1], tmp_path_factory.mktemp("features-log") / "server.log")
    yield s
    s.stop()


def _chat(server, content="Hello there", **kw):
    return server.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **kw)


def _json_format(schema=SCHEMA):
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def test_json_schema_answers_validate_alone_batched_and_streamed(server):
    free = _chat(server, max_tokens=60, seed=1).choices[0].message.content
    with pytest.raises((ValueError, jsonschema.ValidationError)):  # without the grammar: not JSON of the schema
        jsonschema.validate(json.loads(free), SCHEMA)
    answer = _chat(server, max_tokens=80, seed=1, response_format=_json_format())
    assert answer.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(answer.choices[0].message.content), SCHEMA)
    batched = _chat(server, max_tokens=80, seed=2, n=3, response_format=_json_format())
    for choice in batched.choices:
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    pieces = []
    for chunk in _chat(server, max_tokens=80, seed=3, stream=True, response_format=_json_format()):
        pieces += [c.delta.content or "" for c in chunk.choices]
    jsonschema.validate(json.loads("".join(pieces)), SCHEMA)
    # json_object: any JSON object, opened at once
    obj = _chat(server, max_tokens=40, seed=4, response_format={"type": "json_object"}).choices[0]
    assert obj.message.content.startswith("{")
    if obj.finish_reason == "stop":
        assert isinstance(json.loads(obj.message.content), dict)


def test_bad_response_formats_are_refused_by_name(server):
    for fmt in ({"type": "sound"}, {"type": "json_schema"}, _json_format({"type": "object", "properties": 5})):
        with pytest.raises(openai.BadRequestError) as e:
            _chat(server, max_tokens=4, response_format=fmt)
        assert e.value.body["param"].startswith("response_format"), e.value.body


def test_a_required_tool_call_comes_back_as_tool_calls_with_arguments_that_parse(server):
    answer = _chat(
        server, "Weather?", max_tokens=150, seed=5, tools=[WEATHER, CLOCK], tool_choice="required", parallel_tool_calls=False
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        tool = {"get_weather": WEATHER, "get_time": CLOCK}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
        assert call.id and call.type == "function"
    named = _chat(
        server,
        "Time?",
        max_tokens=120,
        seed=6,
        tools=[WEATHER, CLOCK],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )
    calls = named.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_time"]
    jsonschema.validate(json.loads(calls[0].function.arguments), CLOCK["function"]["parameters"])
    # streamed: the call's id and name first, then its arguments as they are written, in several deltas
    deltas, finish = [], None
    # (one call: with several, a random model writes calls until max_tokens cuts the last one short, after its start went out)
    stream = _chat(
        server,
        "Weather?",
        max_tokens=150,
        seed=5,
        stream=True,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
    )
    for chunk in stream:
        for c in chunk.choices:
            deltas += c.delta.tool_calls or []
            finish = c.finish_reason or finish
    assert finish == "tool_calls"
    calls = {}
    for d in deltas:
        if d.index not in calls:  # a call's first delta: its id and name, and calls in order
            assert d.index == len(calls) and d.id.startswith("call_") and d.function.name == "get_weather"
            calls[d.index] = [d.id, ""]
        else:
            assert d.id is None and d.function.name is None
        calls[d.index][1] += d.function.arguments
    assert len(calls) == 1 and len(deltas) > 2
    for _, arguments in calls.values():
        jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])


def test_tool_results_go_back_through_the_template(server, checkpoint):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 2}'}}
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    answer = server.client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=3)
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = TOOL_TEMPLATE
    expected = [
        {**m, "tool_calls": [{**call, "function": {"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}}]}
        if m.get("tool_calls")
        else m
        for m in messages
    ]
    prompt = chat_prompt(tokenizer, expected, tools=[WEATHER])
    assert "<tool_response>sunny, 21 C</tool_response>" in prompt and '"city": "Oslo"' in prompt and "get_weather" in prompt
    assert answer.usage.prompt_tokens == len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    # tool_choice "none" (a text answer after the results): the same prompt, and the answer is not parsed for calls
    plain = server.client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=3
    )
    assert plain.usage.prompt_tokens == answer.usage.prompt_tokens and not plain.choices[0].message.tool_calls


def test_tool_requests_that_cannot_be_served_are_refused(server):
    cases = [
        (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
        (dict(tool_choice="required"), "tool_choice"),
        (dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}), "response_format"),
    ]
    for kw, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            _chat(server, max_tokens=4, **kw)
        assert e.value.body["param"] == param, e.value.body


def test_logprobs_are_the_models_log_softmax(server, checkpoint):
    """Against transformers' own forward on the same weights: each reported logprob is the log-softmax of
    the model's logits at that position, and greedy decoding reports its token as the top one."""
    prompt = torch.randint(3, 250, (12,), generator=torch.Generator().manual_seed(7)).tolist()
    answer = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logprobs=3)
    lp = answer.choices[0].logprobs
    reference = AutoModelForCausalLM.from_pretrained(checkpoint[0], dtype=torch.float32).eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(6):  # the reference's own greedy answer, teacher-forced as a whole afterwards
            ids.append(int(reference(torch.tensor([ids])).logits[0, -1].argmax()))
        logits = reference(torch.tensor([ids])).logits[0, len(prompt) - 1 : -1].double()
    tokens = ids[len(prompt) :]
    expected = torch.log_softmax(logits, dim=-1)
    assert len(lp.tokens) == len(tokens) and all(isinstance(t, str) for t in lp.tokens)
    assert len(lp.token_logprobs) == len(tokens)
    for i, t in enumerate(tokens):
        assert lp.token_logprobs[i] == pytest.approx(float(expected[i, t]), abs=1e-4)
        assert lp.token_logprobs[i] == pytest.approx(float(expected[i].max()), abs=1e-4)  # greedy: the top one
        top = torch.topk(expected[i], 3)
        assert sorted(lp.top_logprobs[i].values()) == pytest.approx(sorted(top.values.tolist()), abs=1e-4)
        assert len(lp.top_logprobs[i]) <= 3 and sum(math.exp(v) for v in lp.top_logprobs[i].values()) <= 1 + 1e-6
    # chat, streamed: the pieces' logprobs are the whole answer's
    whole = _chat(server, max_tokens=8, seed=9, logprobs=True, top_logprobs=2).choices[0].logprobs.content
    streamed = []
    for chunk in _chat(server, max_tokens=8, seed=9, logprobs=True, top_logprobs=2, stream=True):
        for c in chunk.choices:
            streamed += c.logprobs.content if c.logprobs else []
    assert [(e.token, round(e.logprob, 5)) for e in streamed] == [(e.token, round(e.logprob, 5)) for e in whole]
    assert all(len(e.top_logprobs) == 2 for e in whole)


def test_logit_bias_bans_a_token(server):
    body = dict(model=MODEL, prompt="The cat", max_tokens=8, temperature=0)
    first = server.client.completions.create(**body).choices[0].text
    token = byte_tokenizer()(first, add_special_tokens=False)["input_ids"][0]
    banned = server.client.completions.create(**body, logit_bias={str(token): -100}).choices[0].text
    assert token not in byte_tokenizer()(banned, add_special_tokens=False)["input_ids"]
    with pytest.raises(openai.BadRequestError):
        server.client.completions.create(**body, logit_bias={"99999": 5})


def test_n_choices_share_a_prefill_and_each_equals_its_solo_run(server):
    body = dict(model=MODEL, max_tokens=10, temperature=1.0)
    three = server.client.completions.create(prompt="Once upon", n=3, seed=40, **body)
    texts = [c.text for c in sorted(three.choices, key=lambda c: c.index)]
    assert len(set(texts)) == 3
    solo = [server.client.completions.create(prompt="Once upon", seed=40 + i, **body).choices[0].text for i in range(3)]
    assert texts == solo
    streamed = {}
    for chunk in server.client.completions.create(prompt="Once upon", n=3, seed=40, stream=True, **body):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert [streamed[i] for i in range(3)] == texts
    prompt_tokens = len(byte_tokenizer()("Once upon")["input_ids"])
    assert three.usage.prompt_tokens == prompt_tokens  # the prompt counted once
    # a list of prompts, two answers each
    both = server.client.completions.create(prompt=["Once upon", "In a"], n=2, seed=40, **body)
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    assert [c.text for c in both.choices][:2] == texts[:2]
    other = server.client.completions.create(prompt="In a", seed=41, **body).choices[0].text
    assert both.choices[3].text == other


def test_echo_fingerprint_and_cached_tokens(server):
    prompt = "A long prompt that the prefix cache keeps for the next request. " * 2
    body = dict(model=MODEL, max_tokens=4, temperature=0)
    first = server.client.completions.create(prompt=prompt, echo=True, **body)
    assert first.choices[0].text.startswith(prompt)
    assert first.system_fingerprint and first.system_fingerprint.startswith("moestream-")
    again = server.client.completions.create(prompt=prompt + "More.", **body)
    assert again.system_fingerprint == first.system_fingerprint
    assert again.usage.prompt_tokens_details.cached_tokens >= len(prompt) - 1


def test_echo_with_logprobs_scores_the_prompt(server, checkpoint):
    """Completions' echo with logprobs (how evaluation harnesses score a text): each prompt token's
    logprob is the log-softmax of transformers' own logits at the position before it, the first has none,
    the answer's follow; streamed, the same entries and text arrive."""
    prompt = torch.randint(3, 250, (10,), generator=torch.Generator().manual_seed(21)).tolist()
    body = dict(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=2)
    answer = server.client.completions.create(**body).choices[0]
    reference = AutoModelForCausalLM.from_pretrained(checkpoint[0], dtype=torch.float32).eval()
    with torch.no_grad():
        expected = torch.log_softmax(reference(torch.tensor([prompt])).logits[0].double(), dim=-1)
    lp = answer.logprobs
    assert len(lp.token_logprobs) == len(prompt) + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, len(prompt)):
        assert lp.token_logprobs[i] == pytest.approx(float(expected[i - 1, prompt[i]]), abs=1e-4)
        assert sorted(lp.top_logprobs[i].values()) == pytest.approx(
            sorted(torch.topk(expected[i - 1], 2).values.tolist()), abs=1e-4
        )
    assert lp.token_logprobs[len(prompt)] == pytest.approx(float(expected[-1].max()), abs=1e-4)  # greedy's first token
    assert answer.text.startswith(byte_tokenizer().decode(prompt))
    text, entries = "", []
    for chunk in server.client.completions.create(**body, stream=True):
        for c in chunk.choices:
            text += c.text
            entries += c.logprobs.token_logprobs if c.logprobs else []
    assert text == answer.text
    assert entries[0] is None and entries[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-6)


def test_prompt_logprobs_in_pieces_equal_one_pass(checkpoint, monkeypatch):
    """A prompt longer than a piece is scored in pieces with the KV carried over: the same numbers as
    transformers' forward over the whole prompt, and the prefill that follows picks the same token."""
    import moestream
    from moestream.generation import generate

    model, _ = moestream.load(checkpoint[1], memory="64MiB")
    prompt = torch.randint(3, 250, (23,), generator=torch.Generator().manual_seed(5)).tolist()
    monkeypatch.setattr(generate, "PROMPT_LOGPROBS_PIECE", 4)
    entries, (cache, fed) = generate.prompt_logprobs(model, prompt, top=1)
    reference = AutoModelForCausalLM.from_pretrained(checkpoint[0], dtype=torch.float32).eval()
    with torch.no_grad():
        expected = torch.log_softmax(reference(torch.tensor([prompt])).logits[0].double(), dim=-1)
    assert fed == len(prompt) - 1 and entries[0].logprob is None
    assert [e.logprob for e in entries[1:]] == pytest.approx(
        [float(expected[i - 1, prompt[i]]) for i in range(1, len(prompt))], abs=1e-4
    )
    continued = stream(model, None, prompt, SamplingParams.greedy(1, prompt_logprobs=1))  # the prefill continues after them
    assert continued.token_ids == [int(expected[-1].argmax())] and continued.prompt_logprobs == entries


def test_api_key_chat_template_and_bare_paths(checkpoint, tmp_path, capsys):
    """--api-key: /v1 answers only with the key (401 naming what to send), /health stays open; --chat-template
    replaces the checkpoint's; the endpoints answer without /v1 too; a template that does not render is
    refused before the model loads."""
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}<<{{ m.content }}>>{% endfor %}{% if add_generation_prompt %}=>{% endif %}")
    s = Server(
        checkpoint[1],
        tmp_path / "server.log",
        "--api-key",
        "sk-test",
        "--chat-template",
        str(template),
        "--cors",
        "http://localhost:3000",
    )
    try:
        assert s.http.get("/health").status_code == 200
        refused = s.http.get("/v1/models")
        assert refused.status_code == 401 and "--api-key" in refused.json()["error"]["message"]
        assert s.http.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        client = openai.OpenAI(base_url=s.url, api_key="sk-test", max_retries=0, timeout=120)  # no /v1: bare paths
        answer = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi you"}], max_tokens=2)
        assert answer.usage.prompt_tokens == len(byte_tokenizer()("<<Hi you>>=>", add_special_tokens=False)["input_ids"])
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=s.url + "/v1", api_key="sk-other", max_retries=0).models.list()
        # --cors: a browser's preflight (which carries no key) is answered for the allowed origin only
        ask = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
        preflight = s.http.options("/v1/responses", headers={"Origin": "http://localhost:3000", **ask})
        assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == "http://localhost:3000"
        assert s.http.options("/v1/responses", headers={"Origin": "http://evil.example", **ask}).status_code == 400
        keyed = s.http.get("/v1/models", headers={"Origin": "http://localhost:3000", "Authorization": "Bearer sk-test"})
        assert keyed.status_code == 200 and keyed.headers["access-control-allow-origin"] == "http://localhost:3000"
    finally:
        s.stop()
    assert main(["serve", str(checkpoint[1]), "--cors", "localhost:3000"]) == 2
    assert "--cors takes origins" in capsys.readouterr().err
    template.write_text("{% for m in messages %}")
    assert main(["serve", str(checkpoint[1]), "--chat-template", str(template)]) == 2
    assert "does not render" in capsys.readouterr().err


def test_unknown_paths_name_the_endpoints(server):
    response = server.http.post("/v1/embeddings", json={"model": MODEL, "input": "hi"})
    assert response.status_code == 404 and "/v1/chat/completions" in response.json()["error"]["message"]


def test_penalties_and_bias_match_their_definition():
    """Decoding.choose against the arithmetic written out in float64 (OpenAI's definition of the
    presence and frequency penalties and of logit_bias), on fresh random logits."""
    torch.manual_seed(0)

    class _Model:
        generation_config = None

    decoding = Decoding(
        _Model(), None, [1], SamplingParams.greedy(10, presence_penalty=0.7, frequency_penalty=1.3, logit_bias={5: 2.5, 9: -100})
    )
    for token in (3, 3, 7):
        decoding.accept(token)
    logits = torch.randn(1, 20)
    expected = logits.double().clone()
    expected[0, 3] -= 2 * 1.3 + 0.7
    expected[0, 7] -= 1.3 + 0.7
    expected[0, 5] += 2.5
    expected[0, 9] = -math.inf
    chosen = decoding.choose(logits.clone())
    assert int(chosen) == int(expected.argmax())
    adjusted = logits.clone()
    decoding.choose(adjusted)
    assert torch.allclose(adjusted.double(), expected, atol=1e-6)


def test_generate_json_schema(checkpoint, tmp_path, capsys):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    code = main(
        [
            "generate",
            str(checkpoint[1]),
            "--memory",
            "1MiB",
            "--prompt",
            "Hi",
            "--max-new-tokens",
            "80",
            "--json-schema",
            str(schema),
            "--json",
        ]
    )
    assert code == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    jsonschema.validate(json.loads(out["text"]), SCHEMA)


def test_generate_json_schema_errors_name_the_file(checkpoint, tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"type": "object", "properties": 5}))
    for path, words in ((tmp_path / "missing.json", "cannot read"), (bad, "not valid JSON"), (wrong, "cannot be")):
        code = main(["generate", str(checkpoint[1]), "--memory", "1MiB", "--prompt", "Hi", "--json-schema", str(path)])
        err = capsys.readouterr().err
        assert code != 0 and str(path) in err and words in err and "Traceback" not in err, err
