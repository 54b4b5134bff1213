"""Answers told apart as they stream (server/answer_stream.py): for every tool-call format, an answer
fed in pieces split at every position gives deltas that add up to the non-streamed answer, each call's
name before its arguments and the arguments in more than one delta; reasoning blocks kept apart."""

import json
import random

import pytest
from test_tool_calls import WRITERS, random_calls

from moestream.server.answer_stream import (
    AnswerStream,
    ArgumentsDelta,
    CallStarted,
    ContentDelta,
    ReasoningDelta,
    Thinking,
)


def collect(stream: AnswerStream, pieces: list[str]):
    """Feed the pieces; what a client holds after concatenating the deltas, the order of the events, and
    the final answer."""
    reasoning, content, calls, events = "", "", {}, []
    for piece in pieces:
        events += stream.update(piece)
    deltas, final = stream.finish("".join(pieces))
    events += deltas
    for e in events:
        if isinstance(e, ReasoningDelta):
            reasoning += e.text
        elif isinstance(e, ContentDelta):
            content += e.text
        elif isinstance(e, CallStarted):
            assert e.index == len(calls), "calls start in order, each once"
            calls[e.index] = [e.id, e.name, ""]
        else:
            assert e.index in calls, "a call's arguments never come before its name"
            calls[e.index][2] += e.text
    return reasoning, content, calls, events, final


def split_at_random(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 40))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@pytest.mark.parametrize("family", WRITERS)
@pytest.mark.parametrize("n_calls", [1, 3])
def test_streamed_deltas_add_up_to_the_final_answer(family, n_calls):
    fmt, write = WRITERS[family]
    rng = random.Random(f"stream-{family}-{n_calls}")
    calls = random_calls(rng, n_calls)
    for content in ["", "Let me check <that>."]:
        text = write(content, calls)
        final_parse = fmt.parse(text)
        assert [c.name for c in final_parse.calls] == [n for n, _ in calls]
        # one character at a time, and random splits
        for pieces in [list(text), *(split_at_random(text, rng) for _ in range(5))]:
            reasoning, sent, streamed, events, final = collect(AnswerStream(fmt), pieces)
            assert [(c.name, c.arguments) for c in final.calls] == [(c.name, c.arguments) for c in final_parse.calls]
            assert [(i, n, a) for i, n, a in streamed.values()] == [(c.id, c.name, c.arguments) for c in final.calls]
            assert sent == (final.content or "") == (final_parse.content or "")
            assert reasoning == (final.reasoning or "")
        # written a character at a time, every call with arguments streams them in more than one delta
        _, _, _, events, final = collect(AnswerStream(fmt), list(text))
        for index, call in enumerate(final.calls):
            if len(json.loads(call.arguments)) > 1:
                assert sum(isinstance(e, ArgumentsDelta) and e.index == index for e in events) > 1, (family, call)


@pytest.mark.parametrize("family", WRITERS)
def test_one_call_only_when_parallel_calls_are_off(family):
    fmt, write = WRITERS[family]
    text = write("", random_calls(random.Random(family), 2))
    _, _, streamed, _, final = collect(AnswerStream(fmt, max_calls=1), list(text))
    assert len(final.calls) == 1 and len(streamed) == 1


def test_a_call_streams_its_arguments_before_it_is_complete():
    fmt, write = WRITERS["hermes"]
    stream = AnswerStream(fmt)
    text = write("", [("get_weather", {"city": "Paris", "days": 3})])
    partial = text[: text.index('"days"')]
    events = stream.update(partial)
    assert CallStarted(0, stream.calls_sent[0][0], "get_weather") in events
    assert "".join(e.text for e in events if isinstance(e, ArgumentsDelta)) == '{"city":"Paris",'


@pytest.mark.parametrize("opened_by_prompt", [False, True])
def test_reasoning_is_kept_apart_from_the_content_and_the_calls(opened_by_prompt):
    fmt, write = WRITERS["hermes"]
    calls = [("get_time", {"zone": "CET"})]
    thought = "The user wants the time.\nI call the clock."
    text = ("" if opened_by_prompt else "<think>\n") + thought + "\n</think>\n\n" + write("Checking.", calls)
    for tool_format in (fmt, None):
        for pieces in [list(text), split_at_random(text, random.Random(3))]:
            reasoning, content, streamed, _, final = collect(AnswerStream(tool_format, Thinking(opened_by_prompt)), pieces)
            assert reasoning == final.reasoning == thought
            if tool_format is None:
                assert content == final.content and content.startswith("Checking.\n<tool_call>")
            else:
                assert content == final.content == "Checking." and [c[1] for c in streamed.values()] == ["get_time"]
    # an answer that does not open the block is all content; one cut off inside it is all reasoning
    assert collect(AnswerStream(None, Thinking(False)), list("No thoughts."))[4].reasoning is None
    cut = collect(AnswerStream(None, Thinking(True)), list("Still thinking"))[4]
    assert cut.reasoning == "Still thinking" and not cut.content


def test_thinking_comes_from_the_template_and_the_prompt():
    template = "{{ messages }}<think>{{ x }}</think>"
    assert Thinking.of(None, "p") is None and Thinking.of("{{ messages }}", "p") is None
    assert Thinking.of(template, "<|im_start|>assistant\n<think>\n").opened_by_prompt
    assert not Thinking.of(template, "<|im_start|>assistant\n").opened_by_prompt


def test_plain_answers_pass_through_unchanged():
    stream = AnswerStream()
    assert stream.plain
    text = "  Exactly as written <tool_call> </think>  "
    reasoning, content, calls, _, final = collect(stream, split_at_random(text, random.Random(1)))
    assert content == final.content == text and not calls and final.reasoning is None
