"""Tool calls through the real chat templates of the MoE families people run (tests/data/chat_templates, from
llama.cpp's source tree): for each template, an assistant turn with two calls rendered by the template is read
back as those calls, whole and streamed split at every position; a forced call with enum arguments, generated
by a tiny model through the template's prompt and the format's grammar, comes back as exactly a call of the
tool, with the template's thinking on and off; and the conversation continued with the call and its result
renders."""

import json
from pathlib import Path

import pytest
import torch
from test_openai_features import WEATHER
from tiny import TINY

from moestream.conversion.synthetic import byte_tokenizer, make_model
from moestream.generation.constraints import Vocabulary
from moestream.generation.generate import chat_prompt, eos_ids
from moestream.generation.serving import generate_batch
from moestream.server import openai_api, tool_calls
from moestream.server.answer_stream import AnswerStream, ArgumentsDelta, CallStarted, ContentDelta, Thinking
from moestream.server.openai_api import ChatCompletions

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"

# Each template's format (FAMILIES' name).
EXPECTED = {
    "GLM-4.6": "glm",
    "GLM-4.7-Flash": "glm",
    "Qwen-Qwen3-0.6B": "hermes",  # (Qwen3's, Qwen3-30B-A3B's and Qwen3-235B-A22B's too)
    "Qwen3-Coder": "qwen3-coder",
    "Qwen3.5-4B": "qwen3-coder",
    "poolside-Laguna-S-2.1": "glm",
    "deepseek-ai-DeepSeek-V3.1": "deepseek",
    "deepseek-ai-DeepSeek-V3.2": "dsml",
    "deepseek-ai-DeepSeek-V4": "dsml",
    "deepseek-ai-DeepSeek-V4-Flash-0731": "dsml",
    "ibm-granite-granite-4.0": "hermes",
    "MiniMax-M2": "minimax",
    "moonshotai-Kimi-K2": "kimi",
    "LFM2-8B-A1B": "pythonic",
    "Cohere2MoE": "cohere",
    "GigaChat3.1-10B-A1.8B": "gigachat",
    "tencent-Hy3": "hunyuan",
    "upstage-Solar-Open-100B": "solar",
    "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16": "qwen3-coder",
    "inclusionai-ling-3.0-flash": "glm",
    "StepFun3.5-Flash": "qwen3-coder",
    "openai-gpt-oss-120b": "harmony",
    "Kimi-K3": "kimi-xtml",
    "MiniMax-M3": "minimax-m3",
}
# Templates that show one call per turn (they render an assistant turn's first call only).
ONE_CALL = {"GigaChat3.1-10B-A1.8B", "openai-gpt-oss-120b"}
HELD = sorted(EXPECTED)

CALLS = [("get_weather", {"city": "Paris", "days": 3}), ("get_weather", {"city": "Oslo", "days": 1})]
REASONING = "Two cities: two calls."


def template(name: str) -> str:
    return (TEMPLATES / f"{name}.jinja").read_text()


def think_markers(name: str) -> tuple[str, str]:
    """The template's reasoning block's markers (answer_stream.Thinking)."""
    shown = [(start, end) for text, start, end in Thinking.MARKERS if text in template(name)]
    return shown[0] if shown else (Thinking.start, Thinking.end)


def tokenizer_for(name: str, think_tokens: bool = False):
    """The byte-level tokenizer with the template; with `think_tokens`, its reasoning markers as two tokens."""
    tokenizer = byte_tokenizer()
    if think_tokens:
        tokenizer.add_special_tokens({"additional_special_tokens": list(think_markers(name))})
    tokenizer.chat_template = template(name)
    return tokenizer


def test_every_template_is_listed_and_detected_as_listed():
    assert sorted(p.stem for p in TEMPLATES.glob("*.jinja")) == sorted(EXPECTED)
    for name, family in EXPECTED.items():
        fmt = tool_calls.detect(template(name))
        assert (fmt.name if fmt is not None else None) == family, name


def rendered_answer(name: str) -> tuple[str, tool_calls.ToolFormat, Thinking | None]:
    """The assistant turn with CALLS as the template renders it, after the prompt that asks for it."""
    tokenizer = tokenizer_for(name)
    fmt = tool_calls.detect(template(name)).with_tools([WEATHER])
    user = [{"role": "user", "content": "Weather in Paris and Oslo?"}]
    calls = [
        {"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
        for i, (n, a) in enumerate(CALLS)
    ]
    prompt = chat_prompt(tokenizer, user, tools=[WEATHER])
    turn = fmt.template_messages([*user, {"role": "assistant", "content": "", "tool_calls": calls}])
    whole = tokenizer.apply_chat_template(turn, tools=[WEATHER], tokenize=False, add_generation_prompt=False)
    common = next((i for i, (a, b) in enumerate(zip(prompt, whole)) if a != b), min(len(prompt), len(whole)))
    # (a prompt that ends by opening a block the history writes otherwise: start at that marker)
    opened = max(whole.rfind("<", 0, common), whole.rfind("[", 0, common))
    if opened >= 0 and not any(c in whole[opened:common] for c in ">]"):
        common = opened
    answer, thinking = whole[common:], Thinking.of(template(name), prompt)
    # The history shows a turn as the template keeps it, not always as the model wrote it after this prompt:
    # where the prompt opened the reasoning block, the model closes it (the history may drop the reasoning);
    # where the prompt holds an empty block, the model does not close it again.
    if thinking is not None and thinking.opened_by_prompt and thinking.end not in answer:
        answer = REASONING + thinking.end + "\n\n" + answer.lstrip()
    elif thinking is not None and thinking.closed_by_prompt:
        answer = answer.removeprefix(thinking.end)
    return answer, fmt, thinking


def expected_calls(name: str) -> list:
    return CALLS[:1] if name in ONE_CALL else CALLS


@pytest.mark.parametrize("name", HELD)
def test_a_rendered_turn_of_calls_reads_back_as_its_calls(name):
    answer, fmt, thinking = rendered_answer(name)
    _, final = AnswerStream(fmt, thinking).finish(answer)
    assert [(c.name, json.loads(c.arguments)) for c in final.calls] == expected_calls(name), answer
    assert not final.content, (final.content, answer)
    if REASONING in answer:
        assert final.reasoning == REASONING


@pytest.mark.parametrize("name", HELD)
def test_a_rendered_turn_streamed_split_anywhere_reads_back_the_same(name):
    answer, fmt, thinking = rendered_answer(name)
    _, final = AnswerStream(fmt, thinking).finish(answer)
    for k in range(len(answer) + 1):
        stream = AnswerStream(fmt, thinking)
        deltas = stream.update(answer[:k]) + stream.update(answer[k:])
        last, _ = stream.finish(answer)
        deltas += last
        names = [d.name for d in deltas if isinstance(d, CallStarted)]
        arguments = ["".join(d.text for d in deltas if isinstance(d, ArgumentsDelta) and d.index == i) for i in range(len(names))]
        assert names == [c.name for c in final.calls] and arguments == [c.arguments for c in final.calls], (k, answer[:k])
        assert not "".join(d.text for d in deltas if isinstance(d, ContentDelta)), (k, answer[:k])


# -- a forced call generated through each template -------------------------------------------------------


@pytest.fixture(scope="module")
def model():
    """A tiny random Qwen3-MoE whose vocabulary has the byte tokens, two specials and a reasoning block's two
    markers, with room for the templates' long tool preambles."""
    return make_model("qwen3_moe", seed=5, **{**TINY["qwen3_moe"], "vocab_size": 260, "max_position_embeddings": 16384})


def forced_call(model, name: str, thinking: bool | None, **request):
    tokenizer = tokenizer_for(name, think_tokens=True)
    vocabulary = Vocabulary.of(tokenizer, 260, eos_ids(model, tokenizer))
    endpoint = ChatCompletions(tokenizer, "tiny", 16384, 256, vocabulary=lambda: vocabulary)
    body = {
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [WEATHER],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_tokens": 800,
        "seed": 7,
        **request,
    }
    if thinking is not None:
        body["chat_template_kwargs"] = {"enable_thinking": thinking}
    # The reasoning of a tiny model would never end: a bias on its end's token ends it at once where it may.
    think_end = tokenizer.convert_tokens_to_ids(think_markers(name)[1])
    body["logit_bias"] = {str(think_end): 30}
    parsed = endpoint.parse(body)
    (result,) = generate_batch(model, tokenizer, [parsed.choices[0].prompt_ids], parsed.choices[0].params)
    return parsed, result


def thinking_switches(name: str) -> list:
    return [True, False] if "enable_thinking" in template(name) else [None]


@pytest.mark.parametrize("name", HELD)
def test_a_forced_call_is_generated_through_the_template(model, name):
    for thinking in thinking_switches(name):
        with torch.inference_mode():
            parsed, result = forced_call(model, name, thinking)
        message = parsed.reply.response({0: result})["choices"][0]
        assert message["finish_reason"] == "tool_calls", (thinking, result.text)
        (call,) = message["message"]["tool_calls"]
        arguments = json.loads(call["function"]["arguments"])
        assert call["function"]["name"] == "get_weather" and arguments["city"] in ("Paris", "Oslo"), result.text
        assert 1 <= arguments["days"] <= 5 and not message["message"]["content"], result.text
        # the conversation continued with the call and its result renders through the template
        follow = [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [{k: call[k] for k in ("id", "type", "function")}]},
            {"role": "tool", "tool_call_id": call["id"], "content": "sunny, 21 C"},
        ]
        tokenizer = tokenizer_for(name, think_tokens=True)
        again = ChatCompletions(tokenizer, "tiny", 16384, 256).parse({"messages": follow, "tools": [WEATHER], "max_tokens": 4})
        assert "sunny, 21 C" in tokenizer.decode(again.choices[0].prompt_ids)


SYSTEM, DEVELOPER, USER = "You help.", "Mind the lighthouse.", "Where is the harbour?"


@pytest.mark.parametrize("name", HELD)
def test_a_developer_message_reaches_the_prompt_through_every_template(name):
    """Agents send their instructions as developer messages after the request's own (the Responses API's
    `instructions`; Codex's are thousands of tokens): the prompt holds both, once each and in order, through
    every template; one that does not render both (most skip the developer role, or keep one system message)
    renders them as the one system message they make."""
    tokenizer = tokenizer_for(name)
    endpoint = ChatCompletions(tokenizer, "tiny", 16384, 256)

    def prompt(messages: list[dict]) -> str:
        (choice,) = endpoint.parse({"messages": messages, "max_tokens": 4}).choices
        return tokenizer.decode(choice.prompt_ids)

    text = prompt(
        [{"role": "system", "content": SYSTEM}, {"role": "developer", "content": DEVELOPER}, {"role": "user", "content": USER}]
    )
    assert [text.count(part) for part in (SYSTEM, DEVELOPER, USER)] == [1, 1, 1], text
    assert text.index(SYSTEM) < text.index(DEVELOPER) < text.index(USER)
    if not openai_api._keeps_developer(tokenizer):
        assert text == prompt([{"role": "system", "content": f"{SYSTEM}\n\n{DEVELOPER}"}, {"role": "user", "content": USER}])
