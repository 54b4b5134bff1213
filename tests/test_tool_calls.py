"""Tool-call formats (server/tool_calls.py): parsing each family's raw output, detection from chat
templates, the grammars driven through llguidance with a real (byte-level) tokenizer, and the messages
handed to chat templates."""

import json
import random

import jsonschema
import llguidance
import llguidance.hf
import pytest

from moestream.conversion.synthetic import byte_tokenizer
from moestream.server.tool_calls import (
    FAMILIES,
    CallDraft,
    DeepSeekFormat,
    DsmlFormat,
    GlmFormat,
    HarmonyFormat,
    HermesFormat,
    KimiFormat,
    LlamaFormat,
    MiniMaxFormat,
    MistralFormat,
    ParsedOutput,
    Qwen3CoderFormat,
    ToolCall,
    detect,
    to_template_messages,
)

# -- each family's raw output, written here from the formats' descriptions --------------------------------


def hermes_text(content, calls, after=""):
    blocks = "\n".join(f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>" for n, a in calls)
    return f"{content}\n{blocks}{after}<|im_end|>"


def mistral_json_text(content, calls, after=""):
    listed = json.dumps([{"name": n, "arguments": a} for n, a in calls])
    return f"{content}[TOOL_CALLS] {listed}{after}</s>"


def mistral_args_text(content, calls, after=""):
    return content + "".join(f"[TOOL_CALLS]{n}[ARGS]{json.dumps(a)}" for n, a in calls) + after + "</s>"


def deepseek_v3_text(content, calls, after=""):
    blocks = "\n".join(
        f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{n}\n```json\n{json.dumps(a)}\n```<｜tool▁call▁end｜>" for n, a in calls
    )
    return f"{content}<｜tool▁calls▁begin｜>{blocks}<｜tool▁calls▁end｜>{after}<｜end▁of▁sentence｜>"


def deepseek_v31_text(content, calls, after=""):
    blocks = "".join(f"<｜tool▁call▁begin｜>{n}<｜tool▁sep｜>{json.dumps(a)}<｜tool▁call▁end｜>" for n, a in calls)
    return f"{content}<｜tool▁calls▁begin｜>{blocks}<｜tool▁calls▁end｜>{after}<｜end▁of▁sentence｜>"


def harmony_text(content, calls, after=""):
    """Reasoning, a preamble (the content) in the commentary channel, then the calls, the first with the
    recipient after the channel, the others before it (both orders occur)."""
    text = "<|channel|>analysis<|message|>The user wants something; I will call a tool.<|end|>"
    if content:
        text += f"<|start|>assistant<|channel|>commentary<|message|>{content}<|end|>"
    for i, (n, a) in enumerate(calls):
        if i == 0:
            text += (
                f"<|start|>assistant<|channel|>commentary to=functions.{n} <|constrain|>json<|message|>{json.dumps(a)}<|call|>"
            )
        else:
            text += f"<|start|>assistant to=functions.{n}<|channel|>commentary json<|message|>{json.dumps(a)}<|call|>"
    return text


# The XML-like formats type each value by the tool's schema, so the writers below tell the formats the
# schema of what they write: each parameter's type is its value's (several where a name comes back typed
# otherwise), kept here and handed to the formats as their schemas (a mapping they read as it is now).
WRITTEN_SCHEMAS = {}
JSON_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object"}


def json_type(value):
    return "null" if value is None else JSON_TYPES[type(value)]


def record_schemas(calls):
    for name, arguments in calls:
        properties = WRITTEN_SCHEMAS.setdefault(name, {"type": "object", "properties": {}})["properties"]
        for key, value in arguments.items():
            known = properties.setdefault(key, {"type": json_type(value)})["type"]
            if json_type(value) not in ([known] if isinstance(known, str) else known):
                properties[key]["type"] = [*([known] if isinstance(known, str) else known), json_type(value)]


def xml_value(value):
    """A value as the templates write it: a string as it is, anything else as JSON (tojson)."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def qwen3_coder_text(content, calls, after=""):
    record_schemas(calls)
    blocks = "\n".join(
        f"<tool_call>\n<function={n}>\n"
        + "".join(f"<parameter={k}>\n{xml_value(v)}\n</parameter>\n" for k, v in a.items())
        + "</function>\n</tool_call>"
        for n, a in calls
    )
    return f"{content}\n{blocks}{after}<|im_end|>"


def glm_text(content, calls, after=""):
    record_schemas(calls)
    blocks = "\n".join(
        f"<tool_call>{n}\n"
        + "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{xml_value(v)}</arg_value>\n" for k, v in a.items())
        + "</tool_call>"
        for n, a in calls
    )
    return f"{content}\n{blocks}{after}<|observation|>"


def dsml_text(content, calls, after="", block="tool_calls"):
    """DeepSeek V3.2/V4: each value says whether it is a string; no schema needed."""
    t = "｜DSML｜"

    def parameter(k, v):
        kind = "true" if isinstance(v, str) else "false"
        return f'<{t}parameter name="{k}" string="{kind}">{xml_value(v)}</{t}parameter>\n'

    invokes = "".join(
        f'<{t}invoke name="{n}">\n' + "".join(parameter(k, v) for k, v in a.items()) + f"</{t}invoke>\n" for n, a in calls
    )
    blocks = f"\n\n<{t}{block}>\n{invokes}</{t}{block}>" if calls else ""
    return f"{content}{blocks}{after}<｜end▁of▁sentence｜>"


def minimax_text(content, calls, after=""):
    record_schemas(calls)
    invokes = "".join(
        f'<invoke name="{n}">\n'
        + "".join(f'<parameter name="{k}">{xml_value(v)}</parameter>\n' for k, v in a.items())
        + "</invoke>\n"
        for n, a in calls
    )
    blocks = f"\n<minimax:tool_call>\n{invokes}</minimax:tool_call>" if calls else ""
    return f"{content}{blocks}{after}[e~["


def kimi_text(content, calls, after=""):
    section = "".join(
        f"<|tool_call_begin|>functions.{n}:{i}<|tool_call_argument_begin|>{json.dumps(a)}<|tool_call_end|>"
        for i, (n, a) in enumerate(calls)
    )
    blocks = f"<|tool_calls_section_begin|>{section}<|tool_calls_section_end|>" if calls else ""
    return f"{content}{blocks}{after}<|im_end|>"


def llama_text(content, calls, after=""):
    """Bare JSON when the answer is only calls; after `<|python_tag|>` when the model says something first."""
    objects = "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in calls)
    return content + ("<|python_tag|>" if content and calls else "") + objects + after + "<|eot_id|>"


WRITERS = {
    "hermes": (HermesFormat(), hermes_text),
    "mistral-json": (MistralFormat(), mistral_json_text),
    "mistral-args": (MistralFormat(args_style=True), mistral_args_text),
    "deepseek-v3": (DeepSeekFormat(), deepseek_v3_text),
    "deepseek-v3.1": (DeepSeekFormat(fenced=False), deepseek_v31_text),
    "harmony": (HarmonyFormat(), harmony_text),
    "qwen3-coder": (Qwen3CoderFormat(WRITTEN_SCHEMAS), qwen3_coder_text),
    "glm": (GlmFormat(WRITTEN_SCHEMAS), glm_text),
    "llama": (LlamaFormat(), llama_text),
    "dsml": (DsmlFormat(), dsml_text),
    "dsml-v3.2": (DsmlFormat(block="function_calls"), lambda *a, **k: dsml_text(*a, **k, block="function_calls")),
    "minimax": (MiniMaxFormat(WRITTEN_SCHEMAS), minimax_text),
    "kimi": (KimiFormat(), kimi_text),
}
# the formats whose arguments are built from raw values (compact JSON with the characters as they are)
# rather than kept as the model wrote the JSON
TYPED = {"qwen3-coder", "glm", "dsml", "dsml-v3.2", "minimax"}

WORDS = ["get", "weather", "search", "docs", "send", "mail", "city", "lookup", "x2", "v3"]
TRICKY = ['say "hi"', "back\\slash", "{braces}", "[brackets]", "line\nbreak", "café ☕", "tab\t", "</end>", ""]


def random_value(rng, depth=0):
    kind = rng.randrange(6 if depth < 2 else 4)
    if kind == 0:
        return rng.choice(TRICKY) + rng.choice(WORDS)
    if kind == 1:
        return rng.randint(-(10**6), 10**6)
    if kind == 2:
        return rng.choice([True, False, None, 0.5, -1e-3])
    if kind == 3:
        return rng.choice(WORDS)
    if kind == 4:
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return random_arguments(rng, depth + 1)


def random_arguments(rng, depth=0):
    return {rng.choice(WORDS) + str(i): random_value(rng, depth) for i in range(rng.randint(0, 4))}


def random_calls(rng, n):
    return [("_".join(rng.sample(WORDS, 2)), random_arguments(rng)) for _ in range(n)]


# -- parse ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", WRITERS)
@pytest.mark.parametrize("n_calls", [1, 2])
@pytest.mark.parametrize("seed", range(4))
def test_parse_round_trip(family, n_calls, seed):
    fmt, write = WRITERS[family]
    rng = random.Random(f"{family}-{n_calls}-{seed}")
    calls = random_calls(rng, n_calls)
    content = rng.choice(["", "Let me check that.", 'Sure — I\'ll call "the" tool {now}.'])
    parsed = fmt.parse(write(content, calls))
    # the arguments as the model wrote them (json.dumps here), less the whitespace between tokens
    ascii_ = family not in TYPED
    assert parsed.calls == [ToolCall(n, json.dumps(a, separators=(",", ":"), ensure_ascii=ascii_)) for n, a in calls]
    assert [json.loads(c.arguments) for c in parsed.calls] == [a for _, a in calls]
    assert parsed.content == (content or None)
    if family == "harmony":
        assert parsed.reasoning == "The user wants something; I will call a tool."


@pytest.mark.parametrize(
    "family",
    [
        "hermes",
        "mistral-json",
        "mistral-args",
        "deepseek-v3",
        "deepseek-v3.1",
        "qwen3-coder",
        "glm",
        "llama",
        "dsml",
        "minimax",
        "kimi",
    ],
)
def test_text_after_the_calls_is_content(family):
    fmt, write = WRITERS[family]
    parsed = fmt.parse(write("Before.", [("f", {"a": 1})], after=" After."))
    assert parsed.calls == [ToolCall("f", '{"a":1}')]
    assert parsed.content.startswith("Before.") and parsed.content.endswith("After.")


def test_hermes_text_between_calls_and_an_unclosed_last_call():
    text = 'A <tool_call>\n{"name": "f", "arguments": {}}\n</tool_call> B <tool_call>{"name": "g", "arguments": {"x": [1]}}'
    assert HermesFormat().parse(text) == ParsedOutput("A  B", [ToolCall("f", "{}"), ToolCall("g", '{"x":[1]}')])
    # arguments given as JSON text, and "parameters" for "arguments", are read too
    text = (
        '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call><tool_call>{"name": "g", "parameters": {}}</tool_call>'
    )
    assert HermesFormat().parse(text).calls == [ToolCall("f", '{"a":1}'), ToolCall("g", "{}")]


MALFORMED = {
    "hermes": '<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>',
    "mistral-json": '[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}]',
    "mistral-args": '[TOOL_CALLS]f[ARGS]{"a": 1',
    "deepseek-v3": '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{"a": }\n```<｜tool▁call▁end｜>',
    "deepseek-v3.1": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{a: 1}<｜tool▁call▁end｜>",
    "harmony": "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{'a': 1}<|call|>",
    # a parameter never closed; a value never closed; an object never closed
    "qwen3-coder": '<tool_call>\n<function=f>\n<parameter=a>\n{"x": 1}\n</function>\n</tool_call>',
    "glm": '<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>{"x": 1}\n</tool_call>',
    "llama": '<|python_tag|>{"name": "f", "parameters": {"a": 1}',
    # a parameter never closed; a JSON value that is not JSON; an invoke never closed; arguments not JSON
    "dsml": '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="a" string="true">{x\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>',
    "dsml-v3.2": '<｜DSML｜function_calls>\n<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="a" string="false">{x: 1}</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>',
    "minimax": '<minimax:tool_call>\n<invoke name="f">\n<parameter name="a">{"x": 1}</parameter>\n</minimax:tool_call>',
    "kimi": "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{a: 1}<|tool_call_end|><|tool_calls_section_end|>",
}


@pytest.mark.parametrize("family", WRITERS)
def test_malformed_call_stays_content(family):
    fmt, _ = WRITERS[family]
    parsed = fmt.parse("Looking. " + MALFORMED[family])
    assert parsed.calls == []
    assert parsed.content.startswith("Looking.")
    assert "{" in parsed.content and ("f" in parsed.content)


def test_malformed_call_next_to_a_good_one():
    text = (
        '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>\n<tool_call>{"name": "g", "arguments": {oops}}</tool_call>'
    )
    parsed = HermesFormat().parse(text)
    assert parsed.calls == [ToolCall("f", '{"a":1}')]
    assert parsed.content == '<tool_call>{"name": "g", "arguments": {oops}}</tool_call>'


@pytest.mark.parametrize("family", WRITERS)
def test_answer_without_calls_is_content(family):
    fmt, _ = WRITERS[family]
    text = 'The answer is 42; {"name": "f"} is only JSON in prose.'
    if family == "harmony":
        assert fmt.parse(
            f"<|channel|>analysis<|message|>easy<|end|><|start|>assistant<|channel|>final<|message|>{text}<|return|>"
        ) == (ParsedOutput(text, [], "easy"))
    assert fmt.parse(text) == ParsedOutput(text, [])
    assert fmt.parse("") == ParsedOutput("", [])


def test_harmony_builtin_tool_and_final_answer():
    text = (
        "<|channel|>analysis<|message|>search first<|end|>"
        '<|start|>assistant<|channel|>analysis to=browser.search<|message|>{"query": "x"}<|call|>'
    )
    parsed = HarmonyFormat().parse(text)
    assert parsed.calls == [] and "browser.search" in parsed.content and parsed.reasoning == "search first"


def test_harmony_call_cut_at_its_end_of_sequence_token():
    """gpt-oss's <|call|> is an end-of-sequence token, which a server may drop before parsing."""
    text = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}'
    assert HarmonyFormat().parse(text) == ParsedOutput(None, [ToolCall("get_weather", '{"city":"Oslo"}')])
    assert HarmonyFormat().streamable(text) == ""


# -- streaming -----------------------------------------------------------------------------------------


def test_held_back():
    fmt = HermesFormat()
    assert fmt.start_marker == "<tool_call>"
    assert fmt.held_back("Sure <tool_") == len("<tool_")
    assert fmt.held_back("Sure <") == 1
    assert fmt.held_back("Sure <b>") == 0
    assert fmt.held_back("") == 0
    assert MistralFormat().held_back("ok [TOOL") == len("[TOOL")
    assert DeepSeekFormat().held_back("ok <｜tool▁call") == len("<｜tool▁call")


@pytest.mark.parametrize("family", WRITERS)
def test_streamable_grows_and_is_a_prefix_of_the_content(family):
    fmt, write = WRITERS[family]
    for content, calls in [("Let me see <b>this</b>.", [("f", {"a": "<tool_call>"})]), ("Just text, no call.", [])]:
        text = write(content, calls)
        final = fmt.parse(text).content or ""
        previous = ""
        for i in range(len(text) + 1):
            now = fmt.streamable(text[:i])
            assert now.startswith(previous) and final.startswith(now), (text[:i], now)
            previous = now
        assert previous == content


# -- detect --------------------------------------------------------------------------------------------

HERMES_TEMPLATE = """{%- for m in messages %}<|im_start|>{{ m.role }}
{%- if m.tool_calls %}{% for c in m.tool_calls %}
<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>{% endfor %}{% else %}
{{ m.content }}{% endif %}<|im_end|>
{% endfor %}"""
MISTRAL_TEMPLATE = (
    "[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% for c in calls %}[TOOL_CALLS] [{{ c | tojson }}]{% endfor %}"
)
MISTRAL_ARGS_TEMPLATE = "{% for c in calls %}[TOOL_CALLS]{{ c.name }}[ARGS]{{ c.arguments | tojson }}{% endfor %}</s>"
DEEPSEEK_TEMPLATE = (
    "{{ '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + c.type + '<｜tool▁sep｜>' + c.function.name"
    " + '\\n```json\\n' + c.function.arguments + '\\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>' }}"
)
DEEPSEEK_V31_TEMPLATE = (
    "{{ '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + c.function.name + '<｜tool▁sep｜>' + c.function.arguments"
    " + '<｜tool▁call▁end｜><｜tool▁calls▁end｜>' }}"
)
HARMONY_TEMPLATE = (
    "<|start|>assistant to=functions.{{ c.name }}<|channel|>commentary json<|message|>{{ c.arguments | tojson }}<|call|>"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)
PLAIN_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
XML_CALLS_TEMPLATE = "<tool_call>\n<function={{ c.name }}>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
GLM_TEMPLATE = "<tool_call>{{ c.name }}\n{% for k, v in c.arguments.items() %}<arg_key>{{ k }}</arg_key>{% endfor %}</tool_call>"
LLAMA_TEMPLATE = (
    '{{- \'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.\' }}'
    "{{- '{\"name\": \"' + c.name + '\", \"parameters\": ' + c.arguments | tojson + '}' }}"
)
LLAMA_BUILTIN_TEMPLATE = "{%- if builtin_tools is defined %}<|python_tag|>{{ c.name }}.call(){% endif %}<|eom_id|>"


def test_detect():
    assert isinstance(detect(HERMES_TEMPLATE), HermesFormat)
    mistral, mistral_args = detect(MISTRAL_TEMPLATE), detect(MISTRAL_ARGS_TEMPLATE)
    assert isinstance(mistral, MistralFormat) and not mistral.args_style
    assert isinstance(mistral_args, MistralFormat) and mistral_args.args_style
    deepseek, deepseek_v31 = detect(DEEPSEEK_TEMPLATE), detect(DEEPSEEK_V31_TEMPLATE)
    assert isinstance(deepseek, DeepSeekFormat) and deepseek.fenced
    assert isinstance(deepseek_v31, DeepSeekFormat) and not deepseek_v31.fenced
    assert isinstance(detect(HARMONY_TEMPLATE), HarmonyFormat)
    assert detect(PLAIN_TEMPLATE) is None
    # <tool_call> with XML inside rather than Hermes's JSON
    assert isinstance(detect(XML_CALLS_TEMPLATE), Qwen3CoderFormat)
    assert isinstance(detect(GLM_TEMPLATE), GlmFormat)
    assert isinstance(detect(LLAMA_TEMPLATE), LlamaFormat) and isinstance(detect(LLAMA_BUILTIN_TEMPLATE), LlamaFormat)
    assert detect(None) is None and detect("") is None
    assert set(FAMILIES) == {
        *("hermes", "mistral", "deepseek", "dsml", "kimi", "minimax", "harmony", "qwen3-coder", "glm", "llama"),
        *("solar", "gigachat", "cohere", "hunyuan", "pythonic", "kimi-xtml", "minimax-m3"),
    }


# -- grammar -------------------------------------------------------------------------------------------

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city", "days"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}},
}
NO_PARAMETERS = {"type": "function", "function": {"name": "ping"}}
TOOLS = [WEATHER, TIME, NO_PARAMETERS]
NAMED = {"type": "function", "function": {"name": "get_weather"}}

GOOD = ("get_weather", {"city": "Paris", "days": 3})
SECOND = ("get_time", {"zone": "UTC"})
WRONG_NAME = ("get_time", {"zone": "UTC"})  # a real tool, but not the named one
MISSING = ("get_weather", {"city": "Paris"})
WRONG_TYPE = ("get_weather", {"city": "Paris", "days": "three"})
UNKNOWN = ("get_wether", {"city": "Paris", "days": 3})

# the markers each family's checkpoints have as tokens, added to the byte-level tokenizer
TOKEN_MARKERS = {
    "hermes": ["<tool_call>", "</tool_call>"],
    "mistral-json": ["[TOOL_CALLS]"],
    "mistral-args": ["[TOOL_CALLS]", "[ARGS]"],
    "deepseek-v3": [
        "<｜tool▁calls▁begin｜>",
        "<｜tool▁calls▁end｜>",
        "<｜tool▁call▁begin｜>",
        "<｜tool▁call▁end｜>",
        "<｜tool▁sep｜>",
    ],
    "harmony": ["<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|call|>", "<|return|>"],
    "qwen3-coder": ["<tool_call>", "</tool_call>"],
    "glm": ["<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"],
    "llama": [],  # forced calls are the bare JSON object: no marker
    "dsml": [],  # DSML's markers are text
    "dsml-v3.2": [],
    "minimax": ["<minimax:tool_call>", "</minimax:tool_call>"],
    "kimi": [
        "<|tool_calls_section_begin|>",
        "<|tool_calls_section_end|>",
        "<|tool_call_begin|>",
        "<|tool_call_argument_begin|>",
        "<|tool_call_end|>",
    ],
}
TOKEN_MARKERS["deepseek-v3.1"] = TOKEN_MARKERS["deepseek-v3"]

# how each family writes the calls the grammar must accept: exactly the formats' own spelling
GRAMMAR_TEXT = {
    "hermes": lambda calls: hermes_text("", calls).strip().removesuffix("<|im_end|>"),
    "mistral-json": lambda calls: mistral_json_text("", calls).removesuffix("</s>"),
    "mistral-args": lambda calls: mistral_args_text("", calls).removesuffix("</s>"),
    "deepseek-v3": lambda calls: deepseek_v3_text("", calls).removesuffix("<｜end▁of▁sentence｜>"),
    "deepseek-v3.1": lambda calls: deepseek_v31_text("", calls).removesuffix("<｜end▁of▁sentence｜>"),
    "harmony": lambda calls: "".join(
        f"<|channel|>commentary to=functions.{n} <|constrain|>json<|message|>{json.dumps(a)}<|call|>" for n, a in calls
    ),
    "qwen3-coder": lambda calls: qwen3_coder_text("", calls).strip().removesuffix("<|im_end|>"),
    "dsml": lambda calls: dsml_text("", calls).strip().removesuffix("<｜end▁of▁sentence｜>"),
    "dsml-v3.2": lambda calls: dsml_text("", calls, block="function_calls").strip().removesuffix("<｜end▁of▁sentence｜>"),
    "minimax": lambda calls: minimax_text("", calls).strip().removesuffix("[e~["),
    "kimi": lambda calls: kimi_text("", calls).removesuffix("<|im_end|>"),
    "glm": lambda calls: glm_text("", calls).strip().removesuffix("<|observation|>"),
    "llama": lambda calls: llama_text("", calls).removesuffix("<|eot_id|>"),
}

_VOCABULARIES = {}


def vocabulary(markers):
    """A byte-level HF tokenizer with `markers` added as special tokens, and llguidance's view of it."""
    key = tuple(markers)
    if key not in _VOCABULARIES:
        tokenizer = byte_tokenizer()
        if markers:
            tokenizer.add_special_tokens({"additional_special_tokens": list(markers)})
        _VOCABULARIES[key] = tokenizer, llguidance.hf.from_tokenizer(tokenizer)
    return _VOCABULARIES[key]


def accepts(grammar, tokenizer, words, tokens):
    """Whether the grammar takes these tokens one by one and may end after them."""
    compiled = llguidance.LLMatcher.grammar_from_lark(grammar)
    assert llguidance.LLMatcher.validate_grammar(compiled, words) == ""
    matcher = llguidance.LLMatcher(words, compiled, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    for token in tokens:
        if not matcher.consume_token(token):
            assert matcher.is_error()
            return False
    return matcher.is_accepting()


def accepts_text(grammar, tokenizer, words, text):
    return accepts(grammar, tokenizer, words, tokenizer.encode(text, add_special_tokens=False))


@pytest.mark.parametrize("family", WRITERS)
def test_grammar_forces_valid_calls(family):
    fmt, _ = WRITERS[family]
    tokenizer, words = vocabulary(TOKEN_MARKERS[family])
    added = tokenizer.get_added_vocab()
    write = GRAMMAR_TEXT[family]

    named = fmt.grammar(TOOLS, NAMED, added_tokens=added)
    assert accepts_text(named, tokenizer, words, write([GOOD]))
    for bad in (WRONG_NAME, MISSING, WRONG_TYPE, UNKNOWN):
        assert not accepts_text(named, tokenizer, words, write([bad])), bad
    assert not accepts_text(named, tokenizer, words, "Sure! " + write([GOOD]))  # no text before the call
    if family != "harmony":  # one call per turn there: <|call|> ends it
        assert not accepts_text(named, tokenizer, words, write([GOOD, GOOD]))  # a named choice is one call

    required = fmt.grammar(TOOLS, "required", added_tokens=added)
    assert accepts_text(required, tokenizer, words, write([GOOD]))
    assert accepts_text(required, tokenizer, words, write([("ping", {})]))
    assert not accepts_text(required, tokenizer, words, write([("ping", {"extra": 1})]))
    for bad in (MISSING, WRONG_TYPE, UNKNOWN):
        assert not accepts_text(required, tokenizer, words, write([bad])), bad
    assert not accepts_text(required, tokenizer, words, "")  # at least one call
    if family != "harmony":
        assert accepts_text(required, tokenizer, words, write([GOOD, SECOND]))
        assert not accepts_text(required, tokenizer, words, write([GOOD, MISSING]))
        single = fmt.grammar(TOOLS, "required", added_tokens=added, parallel=False)
        assert accepts_text(single, tokenizer, words, write([GOOD]))
        assert not accepts_text(single, tokenizer, words, write([GOOD, SECOND]))
    # what the grammar accepts parses back to the same calls
    assert fmt.parse(write([GOOD])).calls == [ToolCall("get_weather", '{"city":"Paris","days":3}')]


@pytest.mark.parametrize("family", [f for f in WRITERS if TOKEN_MARKERS[f]])
def test_grammar_markers_are_the_special_tokens(family):
    """Where a marker is a token, the grammar takes only that token, not the marker spelled out."""
    fmt, _ = WRITERS[family]
    tokenizer, words = vocabulary(TOKEN_MARKERS[family])
    grammar = fmt.grammar([WEATHER], "required", added_tokens=tokenizer.get_added_vocab())
    text = GRAMMAR_TEXT[family]([GOOD])
    as_tokens = tokenizer.encode(text, add_special_tokens=False)
    spelled = tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    assert len(spelled) > len(as_tokens) and tokenizer.decode(spelled) == tokenizer.decode(as_tokens)
    assert accepts(grammar, tokenizer, words, as_tokens)
    assert not accepts(grammar, tokenizer, words, spelled)


def test_grammar_markers_as_plain_text_where_they_are_text():
    """A vocabulary without `<tool_call>` as a token: the grammar spells it (Hermes-format fine-tunes
    of models that never had the token)."""
    tokenizer, words = vocabulary([])
    grammar = HermesFormat().grammar([WEATHER], "required", added_tokens=tokenizer.get_added_vocab())
    assert '"<tool_call>"' in grammar
    assert accepts_text(grammar, tokenizer, words, GRAMMAR_TEXT["hermes"]([GOOD]))


def test_grammar_markers_by_name_without_the_vocabulary():
    """Without added_tokens, angle-bracketed markers are written by name and llguidance finds them;
    Mistral's bracketed ones can only be given by id."""
    for family in ("hermes", "harmony", "deepseek-v3", "qwen3-coder", "glm"):
        fmt, _ = WRITERS[family]
        tokenizer, words = vocabulary(TOKEN_MARKERS[family])
        grammar = fmt.grammar([WEATHER], NAMED)
        assert accepts_text(grammar, tokenizer, words, GRAMMAR_TEXT[family]([GOOD]))
    with pytest.raises(ValueError, match="added_tokens"):
        MistralFormat().grammar([WEATHER], NAMED)


def test_harmony_grammar_allows_reasoning_first_and_call_as_end_of_sequence():
    markers = TOKEN_MARKERS["harmony"]
    tokenizer, _ = vocabulary(markers)
    # gpt-oss ends a turn on <|call|>: the grammar's own last token may be an end-of-sequence token
    words = llguidance.hf.from_tokenizer(tokenizer, eos_token=tokenizer.convert_tokens_to_ids(["<|call|>", "<|return|>"]))
    grammar = HarmonyFormat().grammar(TOOLS, NAMED, added_tokens=tokenizer.get_added_vocab())
    call = GRAMMAR_TEXT["harmony"]([GOOD])
    reasoning = "<|channel|>analysis<|message|>They want Paris,\nfor 3 days.<|end|><|start|>assistant"
    assert accepts_text(grammar, tokenizer, words, call)
    assert accepts_text(grammar, tokenizer, words, reasoning + call)
    assert not accepts_text(grammar, tokenizer, words, "<|channel|>final<|message|>It is sunny.<|return|>")


def test_grammar_rejects_bad_requests():
    fmt = HermesFormat()
    for choice in ("auto", "none", {"type": "function", "function": {"name": "nope"}}):
        with pytest.raises(ValueError):
            fmt.grammar(TOOLS, choice)
    with pytest.raises(ValueError):
        fmt.grammar([], "required")
    with pytest.raises(ValueError):
        fmt.grammar([WEATHER, WEATHER], "required")
    with pytest.raises(ValueError):
        fmt.grammar([{"type": "function", "function": {"name": "has space"}}], "required")


# -- messages for the chat template --------------------------------------------------------------------

# A minimal Hermes-style template (written for this test): tools in the system turn, calls as
# <tool_call> blocks whose arguments go through tojson, results as <tool_response> blocks.
HERMES_TOOLS_TEMPLATE = """
{%- if tools %}<|im_start|>system
You may call these tools:
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls is defined %}<|im_start|>assistant
{%- if message.content %}
{{ message.content }}{% endif %}
{%- for call in message.tool_calls %}
{%- set call = call.function %}
<tool_call>
{{ {"name": call.name, "arguments": call.arguments} | tojson }}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response name="{{ message.name }}">
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

CONVERSATION = [
    {"role": "user", "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Paris?"}]},
    {
        "role": "assistant",
        "content": None,
        "name": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'},
            },
            {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}},
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    {"role": "tool", "tool_call_id": "call_2", "content": "14:00"},
]


def test_to_template_messages():
    messages = to_template_messages(CONVERSATION)
    assert messages[0] == {"role": "user", "content": "Weather in Paris?"}
    assistant = messages[1]
    assert assistant["content"] == "" and "name" not in assistant
    assert assistant["tool_calls"][0] == {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}},
    }
    assert messages[2] == {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}', "name": "get_weather"}
    assert messages[3]["name"] == "get_time"
    assert CONVERSATION[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris", "days": 3}'  # not changed in place
    # as text for templates that concatenate it
    as_text = to_template_messages(CONVERSATION, arguments_as_dict=False)
    assert as_text[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris", "days": 3}'
    assert (
        DeepSeekFormat().template_messages(messages)[1]["tool_calls"][0]["function"]["arguments"]
        == '{"city": "Paris", "days": 3}'
    )


def test_template_renders_the_calls_and_results():
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = HERMES_TOOLS_TEMPLATE
    fmt = detect(tokenizer.chat_template)
    assert isinstance(fmt, HermesFormat)
    prompt = tokenizer.apply_chat_template(
        fmt.template_messages(CONVERSATION), tools=[WEATHER, TIME], tokenize=False, add_generation_prompt=True
    )
    assert '"name": "get_weather"' in prompt.split("<|im_end|>")[0]  # the tools
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>' in prompt
    assert '<tool_response name="get_weather">\n{"temperature": 21}\n</tool_response>' in prompt
    assert '<tool_response name="get_time">\n14:00\n</tool_response>' in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    # the model's earlier turn, as the template wrote it, parses back to the calls it came from
    turn = prompt.split("<|im_start|>assistant")[1].split("<|im_end|>")[0]
    assert fmt.parse(turn) == ParsedOutput(
        None, [ToolCall("get_weather", '{"city":"Paris","days":3}'), ToolCall("get_time", '{"zone":"CET"}')]
    )
    # without the conversion, tojson writes the arguments as a JSON string: what the helper is for
    raw = tokenizer.apply_chat_template(CONVERSATION[1:2], tokenize=False)
    assert '"arguments": "{\\"city\\"' in raw


def test_deepseek_style_template_wants_text_arguments():
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = (
        "{%- for m in messages %}{%- if m.tool_calls is defined %}<｜tool▁calls▁begin｜>"
        "{%- for c in m.tool_calls %}<｜tool▁call▁begin｜>{{ c.function.name + '<｜tool▁sep｜>' + c.function.arguments }}"
        "<｜tool▁call▁end｜>{%- endfor %}<｜tool▁calls▁end｜>{%- else %}{{ m.content }}{%- endif %}{%- endfor %}"
    )
    fmt = detect(tokenizer.chat_template)
    assert isinstance(fmt, DeepSeekFormat) and not fmt.fenced
    prompt = tokenizer.apply_chat_template(fmt.template_messages(CONVERSATION[1:2]), tokenize=False)
    assert fmt.parse(prompt).calls == [
        ToolCall("get_weather", '{"city":"Paris","days":3}'),
        ToolCall("get_time", '{"zone":"CET"}'),
    ]


# -- the formats that need the tools (Qwen3-Coder's and GLM's raw values) ------------------------------

TYPED_TOOL = {
    "type": "function",
    "function": {
        "name": "f",
        "parameters": {
            "type": "object",
            "properties": {
                "s": {"type": "string"},
                "i": {"type": "integer"},
                "x": {"type": "number"},
                "b": {"type": "boolean"},
                "o": {"type": "object"},
                "a": {"type": "array", "items": {"type": "integer"}},
                "n": {"type": ["integer", "null"]},
                "si": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
                "e": {"enum": ["C", "F"]},
                "any": {},
            },
        },
    },
}


def qwen3_coder_call(name, raw_values):
    parameters = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in raw_values.items())
    return f"<tool_call>\n<function={name}>\n{parameters}</function>\n</tool_call>"


@pytest.mark.parametrize("fmt", [Qwen3CoderFormat(), GlmFormat()])
def test_values_are_typed_by_the_tools_schema(fmt):
    raw = {
        "s": "3",  # a string that looks like a number stays a string
        "i": "42",
        "x": "-0.5",
        "b": "true",
        "o": '{"k": [1, "two"]}',
        "a": "[1, 2]",
        "n": "null",
        "si": "7",  # a string or an integer: read as the integer it is
        "e": "C",
        "any": "12",  # a schema that gives no type: the text
    }
    if isinstance(fmt, GlmFormat):
        text = "<tool_call>f\n" + "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in raw.items())
        text += "</tool_call>"
    else:
        text = qwen3_coder_call("f", raw)
    typed = fmt.with_tools([TYPED_TOOL])
    assert typed is not fmt and type(typed) is type(fmt)
    (call,) = typed.parse(text).calls
    assert json.loads(call.arguments) == {
        "s": "3",
        "i": 42,
        "x": -0.5,
        "b": True,
        "o": {"k": [1, "two"]},
        "a": [1, 2],
        "n": None,
        "si": 7,
        "e": "C",
        "any": "12",
    }
    assert call.arguments.startswith('{"s":"3","i":42,')  # compact JSON, in the order written
    # without the tools every value is the text the model wrote
    (untyped,) = fmt.parse(text).calls
    assert json.loads(untyped.arguments) == raw
    # a function the tools do not name: its values stay text too
    assert json.loads(typed.parse(text.replace(">f\n", ">g\n").replace("=f>", "=g>")).calls[0].arguments) == raw


def test_values_that_are_not_json():
    """Python literals (templates that render values with `str` show the model True and {'a': 1}), and text
    that is neither stays the text rather than failing the call."""
    typed = Qwen3CoderFormat().with_tools([TYPED_TOOL])
    raw = {"b": "True", "o": "{'k': None, 'l': (1, 2)}", "i": "many", "x": "NaN", "a": "{1, 2}", "si": "seven", "n": "None"}
    (call,) = typed.parse(qwen3_coder_call("f", raw)).calls
    assert json.loads(call.arguments) == {
        "b": True,
        "o": {"k": None, "l": [1, 2]},
        "i": "many",
        "x": "NaN",  # not JSON (json.loads would take it; json.dumps would write invalid JSON)
        "a": "{1, 2}",  # a Python set: nothing JSON has
        "si": "seven",
        "n": None,
    }


def test_qwen3_coder_values_keep_their_lines():
    """A value is the text between the tags less one newline on each side: a value's own blank lines and
    indentation are kept (code, as Qwen3-Coder writes it), and `<tool_call>` inside a value is text."""
    code = "\ndef f():\n    return '<tool_call>'\n\n"
    text = "Here:\n" + qwen3_coder_call("write_file", {"path": "a.py", "content": code}) + "\n"
    assert Qwen3CoderFormat().parse(text) == ParsedOutput(
        "Here:", [ToolCall("write_file", json.dumps({"path": "a.py", "content": code}, separators=(",", ":")))]
    )
    # a call cut off after its function closed (the stop came before </tool_call>) is still a call
    assert Qwen3CoderFormat().parse(text.removesuffix("</tool_call>\n")).calls[0].name == "write_file"
    # a call whose function never closes is content
    unclosed = qwen3_coder_call("f", {"a": "1"}).replace("</function>\n", "")
    assert Qwen3CoderFormat().parse(unclosed) == ParsedOutput(unclosed, [])


def test_glm_name_without_a_newline_and_call_without_arguments():
    text = "<tool_call>get_time<arg_key>zone</arg_key><arg_value>UTC</arg_value></tool_call>\n<tool_call>ping\n</tool_call>"
    assert GlmFormat().parse(text) == ParsedOutput(None, [ToolCall("get_time", '{"zone":"UTC"}'), ToolCall("ping", "{}")])
    # the value is all the text between its tags: GLM writes it on one line, spaces and all
    spaced = "<tool_call>f\n<arg_key> a </arg_key>\n<arg_value> x \n</arg_value>\n</tool_call>"
    assert GlmFormat().parse(spaced).calls == [ToolCall("f", '{"a":" x \\n"}')]
    assert GlmFormat().parse("<tool_call>has space\n</tool_call>").calls == []


@pytest.mark.parametrize("family", ["qwen3-coder", "glm"])
def test_xml_call_drafts_grow_parameter_by_parameter(family):
    """The draft's arguments are `{` and the parameters whose value is complete, a prefix of the call's
    arguments at every length of the text; the name comes once it is whole."""
    fmt, write = WRITERS[family]
    arguments = {"city": "Pa\nris", "days": 3, "when": ["mon", "tue"]}
    text = write("", [("get_weather", arguments)])
    final = fmt.parse(text).calls[0]
    assert final == ToolCall("get_weather", json.dumps(arguments, separators=(",", ":")))
    seen = set()
    for i in range(len(text) + 1):
        calls = fmt.draft(text[:i]).calls
        if calls:
            (draft,) = calls
            assert draft.name in (None, "get_weather") and final.arguments.startswith(draft.arguments)
            assert draft.name is not None or draft.arguments == ""
            seen.add(draft.arguments)
    assert {"{", '{"city":"Pa\\nris"', '{"city":"Pa\\nris","days":3', final.arguments} <= seen
    # the draft of a value being written says nothing of it yet
    cut = text[: text.index("ris")]
    assert fmt.draft(cut).calls == [CallDraft("get_weather", "{")]


# -- Llama's bare JSON ---------------------------------------------------------------------------------


def test_llama_calls_only_where_the_answer_begins_with_one():
    fmt = LlamaFormat()
    call = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert fmt.parse(f"  {call}<|eot_id|>") == ParsedOutput(None, [ToolCall("get_weather", '{"city":"Paris"}')])
    assert fmt.parse(f"Call it: {call}") == ParsedOutput(f"Call it: {call}", [])  # JSON in prose
    # "arguments" for "parameters", several calls a `;` or a line apart, or back to back
    two = '{ "name": "f", "arguments": {"a": 1} };\n{"name": "g", "parameters": {}}{"name": "h", "parameters": {}}'
    assert fmt.parse(two).calls == [ToolCall("f", '{"a":1}'), ToolCall("g", "{}"), ToolCall("h", "{}")]
    # an object that only looks like a call: the name, but no parameters, or more than them
    for json_answer in ('{"name": "Bob", "age": 3}', '{"name": "f", "parameters": {}, "id": 1}', '{"name": "f"}'):
        assert fmt.parse(json_answer) == ParsedOutput(json_answer, [])
    # a malformed second call: the first is a call, the rest content
    assert fmt.parse('{"name": "f", "parameters": {}}; {"name": "g", "parameters": {oops}}') == ParsedOutput(
        '{"name": "g", "parameters": {oops}}', [ToolCall("f", "{}")]
    )


def test_llama_wrapper_tokens():
    fmt = LlamaFormat()
    # Llama 3.1: <|python_tag|> before the call (and <|eom_id|>: a result is expected)
    assert fmt.parse('<|python_tag|>{"name": "f", "parameters": {"a": 1}}<|eom_id|>') == ParsedOutput(
        None, [ToolCall("f", '{"a":1}')]
    )
    # Llama 4: what it says before its calls between <|python_start|> and <|python_end|>; or the calls inside
    llama4 = '<|python_start|>Let me look.<|python_end|>{"name": "f", "parameters": {}}{"name": "g", "parameters": {}}<|eot|>'
    assert fmt.parse(llama4) == ParsedOutput("Let me look.", [ToolCall("f", "{}"), ToolCall("g", "{}")])
    inside = '<|python_start|>{"name": "f", "parameters": {}}<|python_end|>'
    assert fmt.parse(inside) == ParsedOutput(None, [ToolCall("f", "{}")])
    # a built-in tool's code after the tag is not a JSON call: it stays as written
    builtin = '<|python_tag|>brave_search.call(query="weather")<|eom_id|>'
    assert fmt.parse(builtin) == ParsedOutput(builtin.removesuffix("<|eom_id|>"), [])


def test_llama_streaming_holds_back_what_may_be_a_call():
    fmt = LlamaFormat()
    for text in ('{"name": "f", "parameters": {"a": 1}}', '{"a": 1} is JSON.', '{"name": "Bob", "age": 3}', "Plain {text}."):
        final = fmt.parse(text).content or ""
        sent = [fmt.streamable(text[:i]) for i in range(len(text) + 1)]
        assert all(b.startswith(a) and final.startswith(b) for a, b in zip(sent, sent[1:])), text
    assert fmt.streamable('{"na') == "" and fmt.streamable(" {") == ""
    assert fmt.streamable('{"a": 1} is') == '{"a": 1} is'  # cannot be a call: it streams
    assert fmt.streamable('{"name": "Bob", "age"') == ""  # may be one until it is whole
    assert fmt.streamable("Sure <|python") == "Sure"
    assert fmt.draft('{"name": "f", "parameters": {"a": 1, "b"').calls == [CallDraft("f", '{"a":1,"b"')]


# -- grammar: the XML-like formats ---------------------------------------------------------------------


def forced_calls_parse_and_validate(family, fmt, grammar, tokenizer, words, calls):
    """Text the grammar accepts for these calls parses back (typed by the tools) to arguments valid
    against the tools' schemas."""
    text = GRAMMAR_TEXT[family](calls)
    assert accepts_text(grammar, tokenizer, words, text), text
    parsed = fmt.with_tools(GRAMMAR_TOOLS).parse(text).calls
    assert [(c.name, json.loads(c.arguments)) for c in parsed] == calls
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in GRAMMAR_TOOLS}
    for call in parsed:
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])


GRAMMAR_TOOLS = [
    WEATHER,
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string"},
                    "content": {"type": "string"},
                    "mode": {"type": "string", "enum": ["w", "a"]},
                    "lines": {"type": "array", "items": {"$ref": "#/$defs/line"}},
                    "force": {"type": "boolean"},
                },
                "required": ["content", "path"],
                "$defs": {"line": {"type": "integer", "minimum": 1}},
            },
        },
    },
]


@pytest.mark.parametrize("family", ["qwen3-coder", "glm", "llama"])
@pytest.mark.parametrize("spelled", [False, True])
def test_grammar_forced_calls_parse_back_and_validate(family, spelled):
    """Required parameters in the schema's order, then the optional ones, each or not; string values any
    text (lines, markup, braces) but their closing tag; the rest JSON held to the property's schema. With
    `spelled`, the vocabulary has none of the markers as tokens: the grammar spells them."""
    fmt, _ = WRITERS[family]
    tokenizer, words = vocabulary([] if spelled else TOKEN_MARKERS[family])
    grammar = fmt.grammar(GRAMMAR_TOOLS, "required", added_tokens=tokenizer.get_added_vocab())
    content = "def f():\n    return '<b>{x}</b>'\n"
    for calls in (
        [GOOD],
        [("write_file", {"path": "a.py", "content": content})],
        [("write_file", {"path": "a.py", "content": "", "mode": "a", "lines": [1, 2]}), GOOD],
        [("write_file", {"path": "a.py", "content": "x", "force": False})],
    ):
        forced_calls_parse_and_validate(family, fmt, grammar, tokenizer, words, calls)
    for bad in (
        ("write_file", {"content": "x", "path": "a.py"}),  # required ones out of order
        ("write_file", {"path": "a.py", "content": "x", "mode": "x"}),  # not in the enum
        ("write_file", {"path": "a.py", "content": "x", "lines": [0]}),  # the $ref's minimum
        ("write_file", {"path": "a.py", "content": "x", "force": False, "mode": "w"}),  # optional ones out of order
    ):
        assert not accepts_text(grammar, tokenizer, words, GRAMMAR_TEXT[family]([bad])), bad


def test_grammar_string_values_cannot_hold_their_closing_tag():
    """A value with `</parameter>` inside would be read cut there: the grammar does not let one be written."""
    fmt, _ = WRITERS["qwen3-coder"]
    tokenizer, words = vocabulary(TOKEN_MARKERS["qwen3-coder"])
    grammar = fmt.grammar([WEATHER], NAMED, added_tokens=tokenizer.get_added_vocab())
    assert accepts_text(grammar, tokenizer, words, GRAMMAR_TEXT["qwen3-coder"]([("get_weather", {"city": "</param", "days": 1})]))
    bad = ("get_weather", {"city": "a</parameter>b", "days": 1})
    assert not accepts_text(grammar, tokenizer, words, GRAMMAR_TEXT["qwen3-coder"]([bad]))
    # spelled GLM markers: the same for </arg_value>
    tokenizer, words = vocabulary([])
    grammar = GlmFormat().grammar([WEATHER], NAMED, added_tokens=tokenizer.get_added_vocab())
    assert not accepts_text(
        grammar, tokenizer, words, GRAMMAR_TEXT["glm"]([("get_weather", {"city": "a</arg_value>", "days": 1})])
    )


# -- templates in each family's style ------------------------------------------------------------------

# Minimal templates written for these tests in the style of each family's own: the calls from the
# arguments as a mapping, each value as text (non-strings through tojson), the results after them.
QWEN3_CODER_TOOLS_TEMPLATE = """
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls is defined %}
{{- '<|im_start|>assistant' }}
{%- for call in message.tool_calls %}
{{- '\\n<tool_call>\\n<function=' + call.function.name + '>\\n' }}
{%- for name, value in call.function.arguments | items %}
{{- '<parameter=' + name + '>\\n' + (value if value is string else value | tojson) + '\\n</parameter>\\n' }}
{%- endfor %}
{{- '</function>\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == "tool" %}
{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""

GLM_TOOLS_TEMPLATE = """[gMASK]<sop>
{%- for m in messages %}
{%- if m.role == "assistant" %}<|assistant|>
{%- for tc in m.tool_calls or [] %}
{{- '\\n<tool_call>' + tc.function.name + '\\n' }}
{%- for k, v in tc.function.arguments.items() %}
{{- '<arg_key>' + k + '</arg_key>\\n<arg_value>' + (v if v is string else v | tojson(ensure_ascii=False)) + '</arg_value>\\n' }}
{%- endfor %}
{{- '</tool_call>' }}
{%- endfor %}
{%- elif m.role == "tool" %}<|observation|>
<tool_response>
{{ m.content }}
</tool_response>
{%- else %}<|{{ m.role }}|>
{{ m.content }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|assistant|>{% endif %}"""

LLAMA_TOOLS_TEMPLATE = """
{%- if tools %}<|start_header_id|>system<|end_header_id|>

Environment: ipython
To call a function, respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.
{% for t in tools %}{{ t | tojson }}
{% endfor %}<|eot_id|>
{%- endif %}
{%- for message in messages %}
{%- if message.tool_calls is defined %}<|start_header_id|>assistant<|end_header_id|>

{% for call in message.tool_calls %}
{{- '{"name": "' + call.function.name + '", "parameters": ' + call.function.arguments | tojson + '}' }}
{%- if not loop.last %}; {% endif %}
{%- endfor %}<|eot_id|>
{%- elif message.role == "tool" %}<|start_header_id|>ipython<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- else %}<|start_header_id|>{{ message.role }}<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""


@pytest.mark.parametrize(
    "template, format_type, turn_between",
    [
        (QWEN3_CODER_TOOLS_TEMPLATE, Qwen3CoderFormat, ("<|im_start|>assistant", "<|im_end|>")),
        (GLM_TOOLS_TEMPLATE, GlmFormat, ("<|assistant|>", "<|observation|>")),
        (LLAMA_TOOLS_TEMPLATE, LlamaFormat, ("<|start_header_id|>assistant<|end_header_id|>", "<|eot_id|>")),
    ],
)
def test_family_template_renders_calls_that_parse_back(template, format_type, turn_between):
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = template
    fmt = detect(tokenizer.chat_template)
    assert type(fmt) is format_type and fmt.arguments_as_dict
    conversation = [*CONVERSATION[:2], {**CONVERSATION[2], "content": '{"temperature": 21}'}, CONVERSATION[3]]
    conversation[1] = {
        **conversation[1],
        "tool_calls": [
            *conversation[1]["tool_calls"],
            {"id": "call_3", "type": "function", "function": {"name": "f", "arguments": '{"o": {"k": [1]}, "b": true}'}},
        ],
    }
    tools = [WEATHER, TIME, {"type": "function", "function": {"name": "f", "parameters": TYPED_TOOL["function"]["parameters"]}}]
    prompt = tokenizer.apply_chat_template(
        fmt.template_messages(conversation), tools=tools, tokenize=False, add_generation_prompt=True
    )
    opening, closing = turn_between
    turn = prompt.split(opening)[1].split(closing)[0]
    # the model's earlier turn, as the template wrote it, parses back to the calls it came from
    assert fmt.with_tools(tools).parse(turn) == ParsedOutput(
        None,
        [
            ToolCall("get_weather", '{"city":"Paris","days":3}'),
            ToolCall("get_time", '{"zone":"CET"}'),
            ToolCall("f", '{"o":{"k":[1]},"b":true}'),
        ],
    )
    assert '{"temperature": 21}' in prompt


@pytest.mark.parametrize("think_tokens", [True, False])
@pytest.mark.parametrize("family", ["hermes", "qwen3-coder", "dsml"])
def test_a_forced_call_comes_after_the_reasoning_never_inside_it(family, think_tokens):
    """A thinking template: with the block opened by the prompt, the grammar takes any reasoning, its end,
    then the call; where the model may open one, a call with or without a block first."""
    fmt, _ = WRITERS[family]
    tokenizer, words = vocabulary(TOKEN_MARKERS[family] + (["<think>", "</think>"] if think_tokens else []))
    added = tokenizer.get_added_vocab()
    call = GRAMMAR_TEXT[family]([GOOD])
    opened = fmt.grammar(TOOLS, NAMED, added_tokens=added, thinking="open")
    assert accepts_text(opened, tokenizer, words, "The user wants Paris, 3 days.\n</think>\n\n" + call)
    assert accepts_text(opened, tokenizer, words, "</think>" + call)
    assert not accepts_text(opened, tokenizer, words, call)  # not inside the reasoning
    assert not accepts_text(opened, tokenizer, words, "Hm.</think>\n" + GRAMMAR_TEXT[family]([WRONG_TYPE]))
    optional = fmt.grammar(TOOLS, NAMED, added_tokens=added, thinking="optional")
    assert accepts_text(optional, tokenizer, words, call)
    assert accepts_text(optional, tokenizer, words, "<think>\nParis, 3 days.\n</think>\n\n" + call)
    assert not accepts_text(optional, tokenizer, words, "Paris, 3 days. " + call)


@pytest.mark.parametrize("family", [f for f in WRITERS if f != "harmony"])
def test_a_call_cut_at_the_length_limit_is_neither_a_call_nor_content(family):
    """An answer that ends at max_tokens inside its second call: the first call stands, the cut one is
    dropped, and none of its markup becomes content."""
    fmt, write = WRITERS[family]
    whole = write("", [GOOD, SECOND])
    cut = whole[: whole.rfind("get_time") + 5]
    parsed = fmt.parse(cut, cut=True)
    assert not parsed.content, parsed
    assert parsed.calls in ([], [ToolCall("get_weather", '{"city":"Paris","days":3}')])
    uncut = fmt.parse(cut)  # read as a finished answer, the cut call is content (or, by some formats, a call)
    assert "get_t" in (uncut.content or "") + "".join(c.name for c in uncut.calls)
