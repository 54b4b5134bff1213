"""Tool calls in the model's own words: reading them out of an answer, and the grammar that forces one.

A checkpoint's chat template shows the model the tools (`apply_chat_template(messages, tools=...)`) and,
for earlier turns, how its own calls looked; the model then writes a call in the format it was trained
on. Each family of models has its own format, and the template is where it shows: `detect` reads the
markers out of the template's text and returns the family's `ToolFormat`, or None when the template has
no tool-call format (the server then refuses `tools`).

A `ToolFormat` does four things, all text processing, no model:

- `parse(answer)`: the calls in a whole answer (decoded with its special tokens kept: the markers often
  are special tokens), and the text around them as the content. A call whose JSON does not parse stays in
  the content as text: the client sees what the model wrote rather than losing it or getting an error.
- `start_marker`, `held_back(text)`, `streamable(text)`: what a streaming server may send as content
  before the answer is complete (a call's first characters must not go out as content).
- `grammar(tools, choice)`: a grammar in llguidance's Lark dialect that lets the model write only calls
  (`tool_choice` "required" or a named function), each call's arguments held to the tool's JSON schema.
- `template_messages(messages)`: OpenAI-shaped messages as the family's templates expect them (arguments
  as a mapping or as JSON text).

The families (see each class for its format): hermes (Qwen2.5/Qwen3, Hermes and many fine-tunes),
mistral (both the JSON-list and the name[ARGS] formats), deepseek (V3/R1 and V3.1), harmony (gpt-oss),
qwen3-coder (Qwen3-Coder, Qwen3-Next, Qwen3.5: XML-like calls), glm (GLM-4.5/4.6: XML-like calls) and
llama (Llama 3.1-3.3 and 4: a bare JSON object).

The XML-like formats write each argument's value as raw text, so only the tool's JSON schema tells the
string "3" from the number 3: a format that needs the request's tools to read the calls gets them from
`with_tools(tools)` (a configured copy; the other formats return themselves).
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

# The forced arguments are written as json.dumps and the templates' `tojson` write JSON, so they look like
# the calls the model saw in training (given to llguidance through the schema's "x-guidance" options).
from ..generation.constraints import JSON_OPTIONS

# End-of-turn tokens an answer may end with when decoded with its special tokens (the stop token is not
# always cut off): none of them is content.
END_OF_TURN = (
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|eom_id|>",  # Llama 3.1 after a call it expects a result for
    "<|eot|>",  # Llama 4
    "<|end|>",
    "</s>",
    "<｜end▁of▁sentence｜>",
    "<|observation|>",  # GLM-4.5 ends a turn of calls on it
    "<|user|>",  # and any other turn on the next one's header
    "[e~[",  # MiniMax-M2's end of a message
    "<|END_OF_TURN_TOKEN|>",  # Cohere
    "<|message_sep|>",  # GigaChat
    "<|end_of_text|>",  # Granite
    "<|role_end|>",  # Ling
    "</assistant>",  # poolside Laguna
    "<｜hy_eos:opensource｜>",  # Hunyuan
    "<|end_of_msg|>",  # Kimi-K3, after
    "<|close|>message<|sep|>",  # the message's closing section
)


# A reasoning block's markers (answer_stream.Thinking): a forced call's grammar lets the reasoning come first.
THINK_START, THINK_END = "<think>", "</think>"


@dataclass(frozen=True)
class ToolCall:
    """One call: the function's name and its arguments as compact JSON text (OpenAI's `arguments`)."""

    name: str
    arguments: str


@dataclass(frozen=True)
class ParsedOutput:
    """An answer split into its content (None when it is only calls), its calls, and its reasoning where
    the format keeps reasoning apart from the content (harmony's analysis channel)."""

    content: str | None
    calls: list[ToolCall]
    reasoning: str | None = None


@dataclass(frozen=True)
class CallDraft:
    """A call still being written: its name once the model has written all of it (None before), and its
    arguments so far, a prefix of the whole call's `arguments` (empty where the format cannot tell them
    before the call is complete)."""

    name: str | None
    arguments: str


@dataclass(frozen=True)
class Draft:
    """What a partial answer already says for sure: the content a stream may have sent (`streamable`),
    the reasoning so far (formats that keep it apart), and the calls so far: complete ones (ToolCall),
    then at most one still being written (CallDraft). As the answer grows, each part only grows."""

    content: str
    calls: list[ToolCall | CallDraft]
    reasoning: str = ""


class ToolFormat:
    """A family's tool-call format. Subclasses give the markers, `_segments` (the answer cut into text and
    calls) and the grammar's rules; the rest is shared."""

    name: ClassVar[str]
    # The text at which a call begins, and any other text that may begin one (held back while streaming).
    start_marker: ClassVar[str]
    _other_starts: ClassVar[tuple[str, ...]] = ()
    # Markers that are single tokens (added to the vocabulary) in the family's checkpoints: llguidance
    # matches an added token only as that token, never as its spelling, so a grammar must name it.
    _token_markers: ClassVar[frozenset[str]] = frozenset()
    # Whether the family's templates want a call's arguments as a mapping (they `tojson` it) or as the
    # JSON text itself (they concatenate it into the prompt).
    arguments_as_dict: ClassVar[bool] = True

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def with_tools(self, tools: Iterable[Mapping[str, Any]] | None) -> ToolFormat:
        """This format for a request that offers `tools` (OpenAI's list): a configured copy where reading
        the calls needs the tools' schemas (the XML-like formats), else the format itself."""
        return self

    # -- parsing --------------------------------------------------------------------------------------

    def parse(self, text: str, cut: bool = False) -> ParsedOutput:
        """The calls in a whole answer and the text around them (stripped) as the content. `cut`: the answer
        ended at its length limit, so a call it ends in was cut short: it is no call, and no content either
        (its markup would otherwise reach the client as text)."""
        pieces, calls = [], []
        # (read as a partial answer when cut: the call it ends in is then a CallDraft, which is left out)
        for segment in self._segments(without_end_of_turn(text), partial=cut):
            if isinstance(segment, ToolCall):
                calls.append(segment)
            elif isinstance(segment, str):
                pieces.append(segment)
        while cut and pieces and not pieces[-1].strip():
            pieces.pop()
        if cut and pieces and pieces[-1].lstrip().startswith(self._starts):
            pieces.pop()
        content = "".join(pieces).strip()
        return ParsedOutput(content if content or not calls else None, calls)

    def _segments(self, text: str, partial: bool = False) -> Iterator[str | ToolCall | CallDraft]:
        """The answer in order: text (a malformed call's own text included) and the calls. With `partial`
        (an answer still being written) a call that runs to the end of the text is its CallDraft."""
        raise NotImplementedError

    def draft(self, text: str) -> Draft:
        """What a partial answer says so far (Draft): how a server streams calls as they are written.
        Each call's arguments in the draft are a prefix of those `parse` finds once the answer is whole."""
        calls = [s for s in self._segments(without_end_of_turn(text), partial=True) if not isinstance(s, str)]
        return Draft(self.streamable(text), calls)

    # -- streaming ------------------------------------------------------------------------------------

    @property
    def _starts(self) -> tuple[str, ...]:
        return (self.start_marker, *self._other_starts)

    def held_back(self, text: str) -> int:
        """How many trailing characters of a partial answer may be the beginning of a call's marker (or
        of an end-of-turn token), so they must not be streamed as content yet."""
        return partial_marker_length(text, (*self._starts, *END_OF_TURN))

    def streamable(self, text: str) -> str:
        """The content a streaming server may have sent for this partial answer: the text before the first
        call's marker, without a trailing piece that may begin one. As the answer grows it only grows,
        and it is always a prefix of `parse(whole answer).content` (the rest follows once it is parsed)."""
        text = without_end_of_turn(text)
        first = min((i for i in (text.find(m) for m in self._starts) if i >= 0), default=-1)
        if first >= 0:
            return text[:first].strip()
        return text[: len(text) - self.held_back(text)].strip()

    # -- grammar --------------------------------------------------------------------------------------

    def grammar(
        self,
        tools: list[dict],
        choice: str | dict,
        *,
        added_tokens: Mapping[str, int] | None = None,
        parallel: bool = True,
        thinking: str | None = None,
        think_markers: tuple[str, str] = (THINK_START, THINK_END),
    ) -> str:
        """A Lark grammar (llguidance's dialect) whose strings are exactly tool calls in this format.

        `tools`: OpenAI's [{"type": "function", "function": {"name", "description", "parameters"}}].
        `choice`: "required" (one or more calls of any of the tools; exactly one when `parallel` is false)
        or {"type": "function", "function": {"name": N}} (exactly one call of N). "auto" and "none" need
        no grammar; they, and a name not among the tools, raise ValueError.
        `added_tokens`: the tokenizer's added tokens and their ids (`hf_tokenizer.get_added_vocab()`).
        A marker among them is written as that token (`<[id]>`), any other marker as plain text. Without
        them, the markers that are tokens in the family's checkpoints are written by name (`<|call|>`),
        which llguidance resolves in the vocabulary; a marker that cannot be written so (Mistral's
        `[TOOL_CALLS]`: `<[...]>` is llguidance's syntax for token ids) raises ValueError.
        `thinking`: where the template has a reasoning block (`answer_stream.Thinking.grammar_mode`), the
        reasoning comes first and the calls are forced once it closes, never inside it: "open" (the prompt
        opened the block: any text up to `</think>`), "optional" (the model may write a block first), with
        the block's `think_markers` (a family's own, where it has them).
        """
        functions = _chosen_functions(tools, choice)
        many = parallel and choice == "required"
        lark = _LarkWriter(added_tokens, self._token_markers)
        start = self._start_rule(lark, many)
        begin, end = think_markers
        # (a regex never matches a special token: where the block's end holds one, any text, then the end)
        tokened = lark.holds_token(end)
        if thinking is not None:
            reasoning = f"REASONING {lark.spelled(end)}" if tokened else "REASONING"
            # ("optional": a block, or its closing marker alone, as models that choose not to reason write it)
            reasoning = reasoning if thinking == "open" else f"({lark.spelled(begin)} {reasoning} | {lark.spelled(end)})?"
            start = f"{reasoning} THINK_GAP? {start}"
        rules = [f"start: {start}", "call: " + " | ".join(f"call_{i}" for i in range(len(functions)))]
        if thinking is not None:
            rules += [r"REASONING: /(?s:.*)/" if tokened else _text_until("REASONING", end, end), r"THINK_GAP: /[\r\n\t ]+/"]
        for i, (name, schema) in enumerate(functions):
            rules.append(f"call_{i}: {self._call_rule(lark, name, f'args_{i}')}")
            rules.extend(self._arguments_rules(lark, f"args_{i}", schema))
        rules.extend(self._extra_rules(lark))
        return "\n".join(rules) + "\n"

    def _start_rule(self, lark: _LarkWriter, many: bool) -> str:
        """The top rule over `call` (one call, or one or more when `many`)."""
        raise NotImplementedError

    def _call_rule(self, lark: _LarkWriter, name: str, args: str) -> str:
        """One call of function `name` whose arguments are the rule `args`."""
        raise NotImplementedError

    def _arguments_rules(self, lark: _LarkWriter, rule: str, schema: dict) -> list[str]:
        """The rule `rule` for a call's arguments held to `schema` (and any rules it needs): a JSON object."""
        return [f"{rule}: %json {json.dumps({**schema, 'x-guidance': JSON_OPTIONS})}"]

    def _extra_rules(self, lark: _LarkWriter) -> list[str]:
        return []

    # -- prompts --------------------------------------------------------------------------------------

    def template_messages(self, messages: Iterable[Mapping[str, Any]]) -> list[dict]:
        """`to_template_messages` with the arguments as this family's templates want them."""
        return to_template_messages(messages, arguments_as_dict=self.arguments_as_dict)


class HermesFormat(ToolFormat):
    """Hermes's format, which Qwen2.5, Qwen3 and many fine-tunes took up: each call is a JSON object in
    its own block, several blocks in a row for parallel calls:

        <tool_call>
        {"name": "get_weather", "arguments": {"city": "Paris"}}
        </tool_call>

    `<tool_call>` and `</tool_call>` are added tokens in Qwen's and Hermes's vocabularies."""

    name = "hermes"
    start_marker = "<tool_call>"
    _end = "</tool_call>"
    _token_markers = frozenset({"<tool_call>", "</tool_call>"})

    def _segments(self, text: str, partial: bool = False) -> Iterator[str | ToolCall | CallDraft]:
        position = 0
        while (begin := text.find(self.start_marker, position)) >= 0:
            yield text[position:begin]
            after = begin + len(self.start_marker)
            # The JSON object, then the closing marker (or the end of an answer cut short).
            call, end = _object_call(text, after)
            rest = text[end:].lstrip() if call is not None else ""
            if call is not None and (rest.startswith(self._end) or not rest):
                position = len(text) - len(rest) + (len(self._end) if rest else 0)
                yield call
                continue
            close = text.find(self._end, after)
            if partial and close < 0:  # the call being written
                yield _object_draft(text, after)
                return
            position = len(text) if close < 0 else close + len(self._end)
            yield text[begin:position]
        yield text[position:]

    def _start_rule(self, lark: _LarkWriter, many: bool) -> str:
        newline = lark.text("\n")  # between blocks, as the templates write them
        return f"call ({newline} call)*" if many else "call"

    def _call_rule(self, lark: _LarkWriter, name: str, args: str) -> str:
        # The object as json.dumps writes {"name": ..., "arguments": ...}: the arguments are the schema's.
        head = lark.text('\n{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": ')
        tail = lark.text("}\n")
        return f"{lark.marker(self.start_marker)} {head} {args} {tail} {lark.marker(self._end)}"


class MistralFormat(ToolFormat):
    """Mistral's formats, both behind the control token `[TOOL_CALLS]`:

        [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, ...]     (tokenizers v2-v7)
        [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]...                   (v11 and later)

    v11 may put `[CALL_ID]id` between the name and `[ARGS]`; the id is dropped (the server makes its own).
    Both are parsed whatever the template; the grammar writes the one the template shows (`args_style`).
    `[TOOL_CALLS]` and `[ARGS]` are special tokens in Mistral's vocabularies; llguidance's Lark can name
    them only by id, so the grammar needs `added_tokens`."""

    name = "mistral"
    start_marker = "[TOOL_CALLS]"
    _token_markers = frozenset({"[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"})

    def __init__(self, args_style: bool = False):
        self.args_style = args_style

    def __repr__(self) -> str:
        return f"MistralFormat(args_style={self.args_style})"

    def _segments(self, text: str, partial: bool = False) -> Iterator[str | ToolCall | CallDraft]:
        first, *blocks = text.split(self.start_marker)
        yield first
        for k, block in enumerate(blocks):
            calls, rest = self._read_block(block, partial and k == len(blocks) - 1)
            if calls is None:
                yield self.start_marker + block
            else:
                yield from calls
                yield rest

    @staticmethod
    def _read_block(block: str, partial: bool) -> tuple[list[ToolCall | CallDraft] | None, str]:
        """The calls after one `[TOOL_CALLS]` and the text after them; (None, "") when malformed. With
        `partial` (the answer's last block, still being written) the call being written is a CallDraft."""
        stripped = block.lstrip()
        if stripped.startswith(("[", "{")):
            # The JSON list (or a lone object) of {"name", "arguments"}.
            listed = stripped.startswith("[")
            calls: list[ToolCall | CallDraft] = []
            position = 1 if listed else 0
            while True:
                call, end = _object_call(stripped, position)
                if call is None:
                    return ([*calls, _object_draft(stripped, position)], "") if partial else (None, "")
                calls.append(call)
                after = stripped[end:].lstrip()
                if not listed:
                    return calls, stripped[end:]
                if after.startswith("]"):
                    return calls, after[1:]
                if after.startswith(","):
                    position = len(stripped) - len(after) + 1
                elif partial and not after:
                    return calls, ""
                else:
                    return None, ""
        # name[ARGS]{...}, maybe name[CALL_ID]id[ARGS]{...}
        head, sep, tail = block.partition("[ARGS]")
        name = head.split("[CALL_ID]")[0].strip()
        if partial and not sep:
            return [CallDraft(None, "")], ""
        if not sep or not _is_name(name):
            return None, ""
        arguments, end = _arguments_at(tail, 0)
        if arguments is None:
            return ([CallDraft(name, _arguments_prefix(tail, 0) or "")], "") if partial else (None, "")
        return [ToolCall(name, arguments)], tail[end:]

    def _start_rule(self, lark: _LarkWriter, many: bool) -> str:
        if self.args_style:
            return "call+" if many else "call"
        # The SentencePiece tokenizers write a space before the list; tekken does not.
        opening = f"{lark.marker('[TOOL_CALLS]')} {lark.text(' ')}? {lark.text('[')}"
        return f"{opening} call ({lark.text(', ')} call)* {lark.text(']')}" if many else f"{opening} call {lark.text(']')}"

    def _call_rule(self, lark: _LarkWriter, name: str, args: str) -> str:
        if self.args_style:
            return f"{lark.marker('[TOOL_CALLS]')} {lark.text(name)} {lark.marker('[ARGS]')} {args}"
        head = lark.text('{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": ')
        return f"{head} {args} {lark.text('}')}"


class DeepSeekFormat(ToolFormat):
    """DeepSeek's format, all markers special tokens (fullwidth bars, ▁ for spaces). V3 and R1 give the
    call's type, then the name and the arguments in a fenced JSON block; calls are a line apart:

        <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
        ```json
        {"city": "Paris"}
        ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

    V3.1 dropped the type and the fence: `<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}
    <｜tool▁call▁end｜>`, calls back to back. Both are parsed; the grammar writes the template's (`fenced`).
    The templates concatenate a call's arguments into the prompt, so they must stay JSON text."""

    name = "deepseek"
    start_marker = "<｜tool▁calls▁begin｜>"
    _other_starts = ("<｜tool▁call▁begin｜>",)
    _calls_end = "<｜tool▁calls▁end｜>"
    _call_begin = "<｜tool▁call▁begin｜>"
    _call_end = "<｜tool▁call▁end｜>"
    _sep = "<｜tool▁sep｜>"
    _token_markers = frozenset({start_marker, _calls_end, _call_begin, _call_end, _sep})
    arguments_as_dict = False
    # V3's call body after the separator: the name, then the arguments fenced as ```json.
    _fenced_body = re.compile(r"\s*([^\n`]+?)\s*\n\s*```(?:json)?\s*\n?(.*?)\s*```\s*", re.DOTALL)
    _fenced_head = re.compile(r"\s*([^\n`]+?)\s*\n\s*```(?:json)?\s*\n?")

    def __init__(self, fenced: bool = True):
        self.fenced = fenced

    def __repr__(self) -> str:
        return f"DeepSeekFormat(fenced={self.fenced})"

    def _segments(self, text: str, partial: bool = False) -> Iterator[str | ToolCall | CallDraft]:
        position = 0
        while (begin := text.find(self._call_begin, position)) >= 0:
            yield self._outside(text[position:begin])
            close = text.find(self._call_end, begin)
            if partial and close < 0:  # the call being written
                yield self._draft_call(text[begin + len(self._call_begin) :])
                return
            end = len(text) if close < 0 else close + len(self._call_end)
            call = self._read_call(text[begin + len(self._call_begin) : len(text) if close < 0 else close])
            yield call if call is not None else text[begin:end]
            position = end
        yield self._outside(text[position:])

    def _outside(self, text: str) -> str:
        """Text between calls, without the markers that wrap the list of calls (they carry nothing)."""
        return text.replace(self.start_marker, "").replace(self._calls_end, "")

    def _read_call(self, body: str) -> ToolCall | None:
        head, sep, tail = body.partition(self._sep)
        if not sep:
            return None
        fenced = self._fenced_body.fullmatch(tail)
        name, arguments = (fenced.group(1), fenced.group(2)) if fenced else (head.strip(), tail.strip())
        arguments, end = _arguments_at(arguments, 0)
        complete = end == len(fenced.group(2) if fenced else tail.strip())
        return ToolCall(name, arguments) if arguments is not None and complete and _is_name(name) else None

    def _draft_call(self, body: str) -> CallDraft:
        head, sep, tail = body.partition(self._sep)
        if not sep:
            return CallDraft(None, "")
        if tail.lstrip().startswith("{"):  # V3.1: the name before the separator
            name, start = head.strip(), 0
        else:  # V3: the name after it, then the fence
            fence = self._fenced_head.match(tail)
            if fence is None:
                return CallDraft(None, "")
            name, start = fence.group(1), fence.end()
        return CallDraft(name, _arguments_prefix(tail, start) or "") if _is_name(name) else CallDraft(None, "")

    def _start_rule(self, lark: _LarkWriter, many: bool) -> str:
        between = lark.text("\n") + " " if self.fenced else ""  # V3 puts a newline between calls
        calls = f"call ({between}call)*" if many else "call"
        return f"{lark.marker(self.start_marker)} {calls} {lark.marker(self._calls_end)}"

    def _call_rule(self, lark: _LarkWriter, name: str, args: str) -> str:
        begin, sep, end = lark.marker(self._call_begin), lark.marker(self._sep), lark.marker(self._call_end)
        if not self.fenced:
            return f"{begin} {lark.text(name)} {sep} {args} {end}"
        fence_open, fence_close = lark.text(name + "\n```json\n"), lark.text("\n```")
        return f"{begin} {lark.text('function')} {sep} {fence_open} {args} {fence_close} {end}"


class HarmonyFormat(ToolFormat):
    """OpenAI's harmony format (gpt-oss). The answer is a series of messages, each a header then
    `<|message|>` then its text then a terminator (`<|end|>`, `<|call|>` that ends the turn on a call,
    `<|return|>` that ends it on the answer); messages after the first begin with `<|start|>assistant`
    (the prompt ends with the first one's). The header's channel says what the text is: `analysis` is
    reasoning, `final` the answer; a call goes to `commentary` with a recipient, in either header order:

        <|channel|>analysis<|message|>The user wants the weather.<|end|>
        <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>
        <|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>

    A commentary message without a recipient is a preamble meant for the user: content, like `final`.
    All the markers are special tokens. `<|call|>` ends the turn, so the grammar allows one call (after
    an optional analysis message), whatever `parallel` says."""

    name = "harmony"
    # In both header orders the recipient marks a call; the content is channel-delimited, so a streaming
    # server should use `streamable` rather than hold back at a marker.
    start_marker = "to=functions."
    _token_markers = frozenset({"<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|call|>", "<|return|>"})
    _terminators = re.compile(r"<\|(?:end|call|return)\|>")

    def parse(self, text: str, cut: bool = False) -> ParsedOutput:
        # (a call cut short is no message of its own: `_read` keeps only whole ones)
        if "<|message|>" not in text:  # not harmony at all: all of it is the answer
            return ParsedOutput(text.strip(), [])
        content, reasoning, calls = self._read(text, partial=False)
        joined = "\n".join(content)
        return ParsedOutput(joined if joined or not calls else None, calls, "\n".join(reasoning) or None)

    def streamable(self, text: str) -> str:
        """The content so far: the final and preamble messages' text, the last one as far as it goes;
        nothing after a call or a malformed message that is not complete yet."""
        if "<|message|>" not in text:
            # A header so far (the first message's begins with `<|channel|>` or ` to=`), or an answer
            # that is not harmony at all.
            if "<|" in text or text.lstrip().startswith("to="):
                return ""
            return text[: len(text) - partial_marker_length(text, ("<|", "to="))].strip()
        return "\n".join(self._read(text, partial=True)[0])

    def draft(self, text: str) -> Draft:
        if "<|message|>" not in text:
            return Draft(self.streamable(text), [])
        content, reasoning, calls = self._read(text, partial=True)
        return Draft("\n".join(content), calls, "\n".join(reasoning))

    def _read(self, text: str, partial: bool) -> tuple[list[str], list[str], list[ToolCall | CallDraft]]:
        content: list[str] = []
        reasoning: list[str] = []
        calls: list[ToolCall | CallDraft] = []
        # Each piece is one message, `<|start|>` included (all but the first).
        for raw in re.split(r"(?=<\|start\|>)", text):
            header, sep, rest = raw.removeprefix("<|start|>").partition("<|message|>")
            if not sep:  # a header cut short (or nothing): no text yet
                continue
            ending = self._terminators.search(rest)
            body = rest[: ending.start()] if ending else rest
            if partial and not ending:  # the terminator may have begun
                body = body[: len(body) - partial_marker_length(body, ("<|end|>", "<|call|>", "<|return|>", "<|start|>"))]
            after = rest[ending.end() :] if ending else ""
            if partial:  # text after a terminator may be the next message's `<|start|>` beginning
                after = after[: len(after) - partial_marker_length(after, ("<|start|>",))]
            after = after.strip()
            channel = re.search(r"<\|channel\|>\s*(\w+)", header)
            recipient = re.search(r"\bto=([^\s<]+)", header)
            if recipient is None:
                if channel is not None and channel.group(1) == "analysis":
                    reasoning.append(body.strip())
                else:  # final, or a commentary preamble
                    content.append(body.strip())
            elif partial and not ending:  # a call still being written: its draft, and nothing after it
                name = recipient.group(1).removeprefix("functions.")
                if recipient.group(1).startswith("functions.") and _is_name(name):
                    calls.append(CallDraft(name, _arguments_prefix(body, 0) or ""))
                break
            else:
                arguments, end = _arguments_at(body, 0)
                arguments = arguments if end == len(body.rstrip()) else None
                name = recipient.group(1).removeprefix("functions.")
                if recipient.group(1).startswith("functions.") and arguments is not None and _is_name(name):
                    calls.append(ToolCall(name, arguments))
                else:  # malformed, or a built-in tool's call: left as the model wrote it
                    content.append(raw.strip())
            if after:
                content.append(after)
        return [c for c in content if c], [r for r in reasoning if r], calls

    def _start_rule(self, lark: _LarkWriter, many: bool) -> str:
        return "analysis? call"

    def _call_rule(self, lark: _LarkWriter, name: str, args: str) -> str:
        return (
            f"{lark.marker('<|channel|>')} {lark.text('commentary to=functions.' + name + ' ')} {lark.marker('<|constrain|>')} "
            f"{lark.text('json')} {lark.marker('<|message|>')} {args} {lark.marker('<|call|>')}"
        )

    def _extra_rules(self, lark: _LarkWriter) -> list[str]:
        # Reasoning first, if the model wants: any text up to `<|end|>` (a regex never matches a special
        # token), then the next message's header.
        return [
            f"analysis: {lark.marker('<|channel|>')} {lark.text('analysis')} {lark.marker('<|message|>')} REASONING "
            f"{lark.marker('<|end|>')} {lark.marker('<|start|>')} {lark.text('assistant')}",
            r"REASONING: /(?s:.*)/",
        ]


class _XmlFormat(ToolFormat):
    """What the XML-like formats share: each call is a `<tool_call>` block naming the function and giving
    each argument as a key and its value written as raw text, one after the other; parallel calls are
    blocks in a row (a newline apart, as the templates write them).

    A value is text, so its type comes from the tool's JSON schema (`with_tools`): a string parameter's
    value is the text as written; any other's is read as JSON (and, failing that, as a Python literal: some
    templates render earlier calls' values with Python's `str`), else kept as the text. Without the tools
    (or for a parameter the schema does not name or type) every value stays a string: it cannot be wrong
    about a string, and a client that expects a number can still read one from it.

    A call's arguments are built as compact JSON parameter by parameter, in the order written: while the
    call is written its draft is `{` and the parameters whose value is complete, so what a stream sent is
    always a prefix of the whole (the closing `}` comes with the call's end)."""

    start_marker = "<tool_call>"
    _end = "</tool_call>"
    _wrapper: ClassVar[tuple[str, str] | None] = None  # markers around a turn's blocks, which carry nothing

    def __init__(self, schemas: Mapping[str, Mapping[str, Any]] | None = None):
        # function name -> its parameters' JSON schema; kept as given (not copied)
        self.schemas = schemas if schemas is not None else {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({sorted(self.schemas)!r})"

    def with_tools(self, tools: Iterable[Mapping[str, Any]] | None) -> ToolFormat:
        return type(self)(_schemas_of(tools))

    def _outside(self, text: str) -> str:
        for marker in self._wrapper or ():
            text = text.replace(marker, "")
        return text

    def _segments(self, text: str, partial: bool = False) -> Iterator[str | ToolCall | CallDraft]:
        position = 0
        while (begin := text.find(self.start_marker, position)) >= 0:
            yield self._outside(text[position:begin])
            after = begin + len(self.start_marker)
            close = text.find(self._end, after)
            if partial and close < 0:  # the call being written
                yield self._read_call(text[after:], complete=False)
                return
            # (a last block without its closing marker: an answer cut at the end of the call)
            end = len(text) if close < 0 else close + len(self._end)
            call = self._read_call(text[after : len(text) if close < 0 else close], complete=True)
            yield call if isinstance(call, ToolCall) else text[begin:end]
            position = end
        yield self._outside(text[position:])

    def _read_call(self, body: str, complete: bool) -> ToolCall | CallDraft | None:
        """The call in a block's body (the text between the markers). `complete`: the whole body, a call
        or None if it is malformed; else the body so far, the CallDraft of what it says for sure."""
        raise NotImplementedError

    def _end_of_call(self, name: str, pairs: list[str], complete: bool, closed: bool) -> ToolCall | CallDraft | None:
        arguments = "{" + ",".join(pairs) + ("}" if closed else "")
        if complete:
            return ToolCall(name, arguments) if closed else None
        return CallDraft(name, arguments)

    def _pair(self, function: str, key: str, raw: str) -> str:
        """One parameter as it goes into the arguments' compact JSON: `"key":value`."""
        parameters = self.schemas.get(function)
        properties = parameters.get("properties") if isinstance(parameters, Mapping) else None
        value = _typed_value(raw, properties.get(key) if isinstance(properties, Mapping) else None)
        return json.dumps(key, ensure_ascii=False) + ":" + json.dumps(value, ensure_ascii=False, separators=(",", ":"))

    # -- grammar: each parameter in the format's words, its value held to the property's schema ----------

    def _arguments_rules(self, lark: _LarkWriter, rule: str, schema: dict) -> list[str]:
        properties = schema.get("properties") if isinstance(schema.get("properties"), Mapping) else {}
        required = [p for p in schema.get("required") or [] if isinstance(p, str)]
        # Required parameters first, in the schema's order, then each optional one, or not.
        order = [p for p in properties if p in required] + [p for p in required if p not in properties]
        order += [p for p in properties if p not in required]
        shared = {k: schema[k] for k in ("$defs", "definitions") if k in schema}  # for the properties' $refs
        rules, items = [], []
        for k, key in enumerate(order):
            prop = properties.get(key)
            prop = dict(prop) if isinstance(prop, Mapping) else {}
            types = _value_types(prop)
            if _written_as_text(types):
                enum = prop.get("enum")
                if types == {"string"} and isinstance(enum, list) and enum and all(isinstance(e, str) for e in enum):
                    value = "(" + " | ".join(lark.text(e) for e in enum) + ")"
                else:
                    value = self._string_value(lark)
            else:
                value = f"{rule}_{k}_value"
                rules.append(f"{value}: %json {json.dumps({**shared, **prop, 'x-guidance': JSON_OPTIONS})}")
            rules.append(f"{rule}_{k}: {self._parameter_rule(lark, key, value, types)}")
            items.append(f"{rule}_{k}" + ("" if key in required else "?"))
        return [f"{rule}: {' '.join(items)}", *rules]

    def _parameter_rule(self, lark: _LarkWriter, key: str, value: str, types: set[str] | None = None) -> str:
        raise NotImplementedError

    def _string_value(self, lark: _LarkWriter) -> str:
        """The expression for a string value: any text up to the value's closing marker."""
        raise NotImplementedError


class Qwen3CoderFormat(_XmlFormat):
    """Qwen3-Coder's format (also Qwen3-Next and Qwen3.5): each call a block with the function and its
    parameters as XML-like tags, each value on its own lines:

        <tool_call>
        <function=get_weather>
        <parameter=city>
        Paris
        </parameter>
        <parameter=days>
        3
        </parameter>
        </function>
        </tool_call>

    A value is the text between `<parameter=NAME>` and `</parameter>`, less the newline after the one
    and before the other; it is typed by the tool's schema (see `_XmlFormat`). `<tool_call>` and
    `</tool_call>` are added tokens in Qwen's vocabulary; the tags inside are text."""

    name = "qwen3-coder"
    _token_markers = frozenset({"<tool_call>", "</tool_call>"})
    _function = re.compile(r"\s*<function=([^>\n]*)>")
    _parameter = re.compile(r"\s*<parameter=([^>\n]*)>")
    _function_end = re.compile(r"\s*</function>")

    def _read_call(self, body: str, complete: bool) -> ToolCall | CallDraft | None:
        head = self._function.match(body)
        name = head.group(1).strip() if head is not None else None
        if not _is_name(name):
            return None if complete else CallDraft(None, "")
        position, pairs = head.end(), []
        while (parameter := self._parameter.match(body, position)) is not None:
            close = body.find("</parameter>", parameter.end())
            key = parameter.group(1).strip()
            if close < 0 or not key:
                return self._end_of_call(name, pairs, complete, closed=False)
            raw = body[parameter.end() : close]
            raw = raw[1:] if raw.startswith("\n") else raw
            raw = raw[:-1] if raw.endswith("\n") else raw
            pairs.append(self._pair(name, key, raw))
            position = close + len("</parameter>")
        end = self._function_end.match(body, position)
        closed = end is not None and not body[end.end() :].strip()
        return self._end_of_call(name, pairs, complete, closed)

    def _start_rule(self, lark: _LarkWriter, many: bool) -> str:
        return f"call ({lark.text(chr(10))} call)*" if many else "call"

    def _call_rule(self, lark: _LarkWriter, name: str, args: str) -> str:
        head = lark.text(f"\n<function={name}>\n")
        return f"{lark.marker(self.start_marker)} {head} {args} {lark.text('</function>' + chr(10))} {lark.marker(self._end)}"

    def _parameter_rule(self, lark: _LarkWriter, key: str, value: str, types: set[str] | None = None) -> str:
        if value == self._string_value(lark):  # the lexeme ends with the value's newline and closing tag
            return f"{lark.text(f'<parameter={key}>' + chr(10))} {value} {lark.text(chr(10))}"
        return f"{lark.text(f'<parameter={key}>' + chr(10))} {value} {lark.text(chr(10) + '</parameter>' + chr(10))}"

    def _string_value(self, lark: _LarkWriter) -> str:
        return "PARAMETER_TEXT"

    def _extra_rules(self, lark: _LarkWriter) -> list[str]:
        # Any text, then the line that closes it. llguidance's lexer does not backtrack, so the lexeme takes
        # in its closing tag (the first one: the value cannot contain it, or it would be read cut there).
        return [_text_until("PARAMETER_TEXT", "\n</parameter>", "</parameter>")]


class GlmFormat(_XmlFormat):
    """GLM-4.5's and GLM-4.6's format (zai-org): each call a block with the function's name on its first
    line, then each argument as a key and a value, the value written as raw text:

        <tool_call>get_weather
        <arg_key>city</arg_key>
        <arg_value>Paris</arg_value>
        <arg_key>days</arg_key>
        <arg_value>3</arg_value>
        </tool_call>

    The name runs up to the line's end (or to the first `<arg_key>`); a value is all the text between its
    tags, typed by the tool's schema (see `_XmlFormat`; the templates write the non-strings with tojson).
    All six tags are special tokens in GLM's vocabulary."""

    name = "glm"
    _arg_key, _arg_key_end, _arg_value, _arg_value_end = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"
    _name_sep = ""  # what follows the name (Hunyuan's separator)
    _token_markers = frozenset({"<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"})
    _name_end = re.compile(r"[^\n<]*")

    @property
    def _key(self) -> re.Pattern:
        return re.compile(rf"\s*{re.escape(self._arg_key)}([^<]*){re.escape(self._arg_key_end)}\s*{re.escape(self._arg_value)}")

    def _read_call(self, body: str, complete: bool) -> ToolCall | CallDraft | None:
        head = self._name_end.match(body)
        name = head.group().strip()
        if (not complete and head.end() == len(body)) or not _is_name(name):  # (the name may go on)
            return None if complete else CallDraft(None, "")
        position, pairs = head.end(), []
        if self._name_sep:
            if not body.startswith(self._name_sep, position):
                return None if complete or not self._name_sep.startswith(body[position:]) else CallDraft(None, "")
            position += len(self._name_sep)
        while (key := self._key.match(body, position)) is not None:
            close = body.find(self._arg_value_end, key.end())
            if close < 0 or not key.group(1).strip():
                return self._end_of_call(name, pairs, complete, closed=False)
            pairs.append(self._pair(name, key.group(1).strip(), body[key.end() : close]))
            position = close + len(self._arg_value_end)
        # The block's closing marker closes the call: only a complete body has it.
        return self._end_of_call(name, pairs, complete, closed=complete and not body[position:].strip())

    def _start_rule(self, lark: _LarkWriter, many: bool) -> str:
        return f"call ({lark.text(chr(10))} call)*" if many else "call"

    def _call_rule(self, lark: _LarkWriter, name: str, args: str) -> str:
        head = lark.text(name) + (f" {lark.marker(self._name_sep)}" if self._name_sep else "")
        return f"{lark.marker(self.start_marker)} {head} {lark.text(chr(10))} {args} {lark.marker(self._end)}"

    def _parameter_rule(self, lark: _LarkWriter, key: str, value: str, types: set[str] | None = None) -> str:
        key_part = f"{lark.marker(self._arg_key)} {lark.text(key)} {lark.marker(self._arg_key_end)} {lark.text(chr(10))}"
        if value == self._string_value(lark) and not lark.is_token(self._arg_value_end):
            return f"{key_part} {lark.marker(self._arg_value)} {value} {lark.text(chr(10))}"  # the lexeme closes it
        return f"{key_part} {lark.marker(self._arg_value)} {value} {lark.marker(self._arg_value_end)} {lark.text(chr(10))}"

    def _string_value(self, lark: _LarkWriter) -> str:
        return "ARG_TEXT"

    def _extra_rules(self, lark: _LarkWriter) -> list[str]:
        if lark.is_token(self._arg_value_end):  # a regex never matches a special token: any text, up to it
            return [r"ARG_TEXT: /(?s:.*)/"]
        return [_text_until("ARG_TEXT", self._arg_value_end, self._arg_value_end)]


class HunyuanFormat(GlmFormat):
    """Tencent Hunyuan's (Hy3) calls: GLM's (see `GlmFormat`) with its own tags, each name ending in the
    template's suffix (`:opensource`), a separator after the function's name, and a block around the turn's
    calls:

        <tool_calls:opensource>
        <tool_call:opensource>get_weather<tool_sep:opensource>
        <arg_key:opensource>city</arg_key:opensource>
        <arg_value:opensource>Paris</arg_value:opensource>
        </tool_call:opensource>
        </tool_calls:opensource>"""

    name = "hunyuan"
    _token_markers = frozenset()
    _suffix_setting = re.compile(r"set HYTK\s*=\s*'([^']*)'")

    def __init__(self, schemas: Mapping[str, Mapping[str, Any]] | None = None, suffix: str = ":opensource"):
        super().__init__(schemas)
        self.suffix = suffix
        self.start_marker, self._end = f"<tool_call{suffix}>", f"</tool_call{suffix}>"
        self._wrapper = (f"<tool_calls{suffix}>", f"</tool_calls{suffix}>")
        self._other_starts = (self._wrapper[0],)
        self._arg_key, self._arg_key_end = f"<arg_key{suffix}>", f"</arg_key{suffix}>"
        self._arg_value, self._arg_value_end = f"<arg_value{suffix}>", f"</arg_value{suffix}>"
        self._name_sep = f"<tool_sep{suffix}>"

    def __repr__(self) -> str:
        return f"HunyuanFormat({sorted(self.schemas)!r}, suffix={self.suffix!r})"

    def with_tools(self, tools: Iterable[Mapping[str, Any]] | None) -> ToolFormat:
        return HunyuanFormat(_schemas_of(tools), self.suffix)

    @classmethod
    def of(cls, template: str) -> HunyuanFormat | None:
        """The format of a Hunyuan template, which builds its tags from a suffix (`HYTK`)."""
        setting = cls._suffix_setting.search(template)
        return cls(suffix=setting.group(1)) if setting is not None and "<tool_call{}>" in template else None

    def _start_rule(self, lark: _LarkWriter, many: bool) -> str:
        begin, end = (lark.marker(m) for m in self._wrapper)
        return f"{begin} {lark.text(chr(10))} {super()._start_rule(lark, many)} {lark.text(chr(10))} {end}"


class _InvokeFormat(_XmlFormat):
    """What the invoke formats share (DeepSeek V3.2/V4's DSML, MiniMax-M2's): one block holds all of a turn's
    calls, each an `invoke` element naming the function, each argument a `parameter` element naming its key:

        <BLOCK>
        <invoke name="get_weather">
        <parameter name="city">Paris</parameter>
        </invoke>
        </BLOCK>

    A value is the text between a parameter's tags, typed by its `string` attribute where the format writes
    one, else by the tool's schema (see `_XmlFormat`). Subclasses give the block's markers and the element
    names (`_tag`: the prefix of every element's name)."""

    _tag: ClassVar[str] = ""
    _typed_by_attribute: ClassVar[bool] = False

    @property
    def _invoke(self) -> re.Pattern:
        return re.compile(rf'\s*<{re.escape(self._tag)}invoke name="([^"\n]*)">')

    @property
    def _parameter(self) -> re.Pattern:
        return re.compile(rf'\s*<{re.escape(self._tag)}parameter name="([^"\n]*)"(?: string="(true|false)")?>')

    @property
    def _invoke_end(self) -> str:
        return f"</{self._tag}invoke>"

    @property
    def _parameter_end(self) -> str:
        return f"</{self._tag}parameter>"

    def _segments(self, text: str, partial: bool = False) -> Iterator[str | ToolCall | CallDraft]:
        position = 0
        while (begin := text.find(self.start_marker, position)) >= 0:
            yield text[position:begin]
            close = text.find(self._end, begin)
            body_end = len(text) if close < 0 else close
            end = len(text) if close < 0 else close + len(self._end)
            calls: list[ToolCall] = []
            at = begin + len(self.start_marker)
            while (head := self._invoke.match(text[:body_end], at)) is not None:
                stop = text.find(self._invoke_end, head.end(), body_end)
                call = self._read_invoke(head.group(1), text[head.end() : stop], complete=True) if stop >= 0 else None
                if not isinstance(call, ToolCall):
                    break
                calls.append(call)
                at = stop + len(self._invoke_end)
            if partial and close < 0:  # the block being written: its calls so far, then the one being written
                yield from calls
                head = self._invoke.match(text, at)
                if head is not None:
                    yield self._read_invoke(head.group(1), text[head.end() :], complete=False)
                return
            if calls and not text[at:body_end].strip():
                yield from calls
            else:  # a malformed block stays the text it is
                yield text[begin:end]
            position = end
        yield text[position:]

    def _read_invoke(self, name: str, body: str, complete: bool) -> ToolCall | CallDraft | None:
        """The call in an invoke element's body (up to its closing tag when `complete`, else so far)."""
        name = name.strip()
        if not _is_name(name):
            return None if complete else CallDraft(None, "")
        position, pairs = 0, []
        while (parameter := self._parameter.match(body, position)) is not None:
            close = body.find(self._parameter_end, parameter.end())
            key = parameter.group(1).strip()
            if close < 0 or not key:
                return self._end_of_call(name, pairs, complete, closed=False)
            raw, string = body[parameter.end() : close], self._is_string(parameter.group(2))
            if string is None:
                pairs.append(self._pair(name, key, raw))
            else:  # the format says which values are strings: the others are JSON, or the call is malformed
                try:
                    value = raw if string else json.loads(raw)
                except ValueError:
                    return None if complete else self._end_of_call(name, pairs, complete, closed=False)
                pairs.append(
                    json.dumps(key, ensure_ascii=False) + ":" + json.dumps(value, ensure_ascii=False, separators=(",", ":"))
                )
            position = close + len(self._parameter_end)
        return self._end_of_call(name, pairs, complete, closed=complete and not body[position:].strip())

    @staticmethod
    def _is_string(attribute: str | None) -> bool | None:
        """What a parameter's typing attribute says: a string (True), JSON (False), or nothing (None)."""
        return None if attribute is None else attribute == "true"

    def _start_rule(self, lark: _LarkWriter, many: bool) -> str:
        calls = "call+" if many else "call"
        return f"{lark.marker(self.start_marker)} {lark.text(chr(10))} {calls} {lark.marker(self._end)}"

    def _call_rule(self, lark: _LarkWriter, name: str, args: str) -> str:
        head = lark.text(f'<{self._tag}invoke name="{name}">' + "\n")
        return f"{head} {args} {lark.text(self._invoke_end + chr(10))}"

    def _parameter_rule(self, lark: _LarkWriter, key: str, value: str, types: set[str] | None = None) -> str:
        string = _written_as_text(types)  # (as the value's rule reads it)
        attribute = (' string="true"' if string else ' string="false"') if self._typed_by_attribute else ""
        head = lark.text(f'<{self._tag}parameter name="{key}"{attribute}>')
        if value == self._string_value(lark):  # the lexeme takes in the closing tag
            return f"{head} {value} {lark.text(chr(10))}"
        return f"{head} {value} {lark.text(self._parameter_end + chr(10))}"

    def _string_value(self, lark: _LarkWriter) -> str:
        return "PARAMETER_TEXT"

    def _extra_rules(self, lark: _LarkWriter) -> list[str]:
        return [_text_until("PARAMETER_TEXT", self._parameter_end, self._parameter_end)]


class DsmlFormat(_InvokeFormat):
    """DeepSeek V3.2's and V4's DSML calls: the invoke format (see `_InvokeFormat`), every element's name
    prefixed with `｜DSML｜`, each parameter saying whether its value is a string (as written) or JSON:

        <｜DSML｜tool_calls>
        <｜DSML｜invoke name="get_weather">
        <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
        <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
        </｜DSML｜invoke>
        </｜DSML｜tool_calls>

    V3.2 names the block `function_calls`, V4 `tool_calls` (`block`). The markers are text."""

    name = "dsml"
    _tag = "｜DSML｜"
    _typed_by_attribute = True

    def __init__(self, schemas: Mapping[str, Mapping[str, Any]] | None = None, block: str = "tool_calls"):
        super().__init__(schemas)
        self.block = block

    def __repr__(self) -> str:
        return f"DsmlFormat({sorted(self.schemas)!r}, block={self.block!r})"

    def with_tools(self, tools: Iterable[Mapping[str, Any]] | None) -> ToolFormat:
        return DsmlFormat(_schemas_of(tools), self.block)

    @property
    def start_marker(self) -> str:  # type: ignore[override]
        return f"<{self._tag}{self.block}>"

    @property
    def _end(self) -> str:  # type: ignore[override]
        return f"</{self._tag}{self.block}>"


class MiniMaxFormat(_InvokeFormat):
    """MiniMax-M2's calls: the invoke format (see `_InvokeFormat`) in a `<minimax:tool_call>` block, each
    value typed by the tool's schema:

        <minimax:tool_call>
        <invoke name="get_weather">
        <parameter name="city">Paris</parameter>
        </invoke>
        </minimax:tool_call>"""

    name = "minimax"
    start_marker = "<minimax:tool_call>"
    _end = "</minimax:tool_call>"
    _token_markers = frozenset({"<minimax:tool_call>", "</minimax:tool_call>"})


class _JsonArgumentsFormat(ToolFormat):
    """What the formats that mark each call's parts with special tokens and write its arguments as JSON
    share (Solar-Open's, Kimi-K2's): a call begins, its head names the function (after an id, some), its
    arguments follow a separator, and it ends; a section's markers wrap a turn's calls and carry nothing.
    Subclasses give the markers and `_name_in(head)`."""

    _section_end: ClassVar[str]
    _call_begin: ClassVar[str]
    _argument_begin: ClassVar[str]
    _call_end: ClassVar[str]

    def _name_in(self, head: str) -> str | None:
        raise NotImplementedError

    def _segments(self, text: str, partial: bool = False) -> Iterator[str | ToolCall | CallDraft]:
        position = 0
        while (begin := text.find(self._call_begin, position)) >= 0:
            yield self._outside(text[position:begin])
            close = text.find(self._call_end, begin)
            body = text[begin + len(self._call_begin) : len(text) if close < 0 else close]
            head, sep, arguments = body.partition(self._argument_begin)
            name = self._name_in(head) if sep else None
            if partial and close < 0:  # the call being written
                yield CallDraft(name, _arguments_prefix(arguments, 0) or "") if _is_name(name) else CallDraft(None, "")
                return
            end = len(text) if close < 0 else close + len(self._call_end)
            parsed, stop = _arguments_at(arguments, 0) if sep else (None, 0)
            whole = parsed is not None and not arguments[stop:].strip() and _is_name(name)
            yield ToolCall(name, parsed) if whole else text[begin:end]
            position = end
        yield self._outside(text[position:])

    def _outside(self, text: str) -> str:
        return text.replace(self.start_marker, "").replace(self._section_end, "")

    def _start_rule(self, lark: _LarkWriter, many: bool) -> str:
        calls = "call+" if many else "call"
        return f"{lark.marker(self.start_marker)} {calls} {lark.marker(self._section_end)}"


class SolarFormat(_JsonArgumentsFormat):
    """Upstage Solar-Open's calls, all markers special tokens: each call its id, its name and its JSON
    arguments, the turn's calls between `<|tool_calls|>` and `<|calls|>`:

        <|tool_calls|><|tool_call:begin|>call_1<|tool_call:name|>get_weather<|tool_call:args|>{"city": "Paris"}
        <|tool_call:end|><|calls|>

    (on one line)."""

    name = "solar"
    start_marker = "<|tool_calls|>"
    _other_starts = ("<|tool_call:begin|>",)
    _section_end = "<|calls|>"
    _call_begin = "<|tool_call:begin|>"
    _name_marker = "<|tool_call:name|>"
    _argument_begin = "<|tool_call:args|>"
    _call_end = "<|tool_call:end|>"
    _token_markers = frozenset({start_marker, _section_end, _call_begin, _name_marker, _argument_begin, _call_end})

    def _name_in(self, head: str) -> str | None:
        call_id, sep, name = head.partition(self._name_marker)
        return name.strip() if sep else None

    def _call_rule(self, lark: _LarkWriter, name: str, args: str) -> str:
        begin, sep, argument, end = (
            lark.marker(m) for m in (self._call_begin, self._name_marker, self._argument_begin, self._call_end)
        )
        return f"{begin} CALL_ID {sep} {lark.text(name)} {argument} {args} {end}"

    def _extra_rules(self, lark: _LarkWriter) -> list[str]:
        return ["CALL_ID: /call_[0-9a-zA-Z]{1,24}/"]


class KimiFormat(_JsonArgumentsFormat):
    """Moonshot's Kimi-K2 calls, all markers special tokens: a section of calls, each its id
    (`functions.NAME:INDEX`, the index counting the turn's calls) and its arguments as JSON:

        <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>
        {"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>

    (on one line). The template writes the arguments with tojson: they go to it as a mapping."""

    name = "kimi"
    start_marker = "<|tool_calls_section_begin|>"
    _other_starts = ("<|tool_call_begin|>",)
    _section_end = "<|tool_calls_section_end|>"
    _call_begin = "<|tool_call_begin|>"
    _argument_begin = "<|tool_call_argument_begin|>"
    _call_end = "<|tool_call_end|>"
    _token_markers = frozenset({start_marker, _section_end, _call_begin, _argument_begin, _call_end})
    _id = re.compile(r"\s*(?:functions\.)?([^\s:<]+)(?::\d+)?\s*")

    def _name_in(self, head: str) -> str | None:
        match = self._id.fullmatch(head)
        return match.group(1) if match is not None else None

    def _call_rule(self, lark: _LarkWriter, name: str, args: str) -> str:
        begin, argument, end = lark.marker(self._call_begin), lark.marker(self._argument_begin), lark.marker(self._call_end)
        return f"{begin} {lark.text(f'functions.{name}:')} CALL_INDEX {argument} {args} {end}"

    def _extra_rules(self, lark: _LarkWriter) -> list[str]:
        return ["CALL_INDEX: /[0-9]+/"]


class PythonicFormat(ToolFormat):
    """Liquid LFM2's calls: Python calls with keyword arguments, in a list between two special tokens:

        <|tool_call_start|>[get_weather(city="Paris", days=3), get_time(zone="UTC")]<|tool_call_end|>

    The values are Python literals (JSON's true, false and null are read too). A call's name streams as
    soon as it is written, its arguments once the call is complete. LFM2's template shows an earlier turn's
    calls only as its text: `template_messages` writes them into the content so."""

    name = "pythonic"
    start_marker = "<|tool_call_start|>"
    _end = "<|tool_call_end|>"
    _token_markers = frozenset({start_marker, _end})
    _constants = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}

    def _segments(self, text: str, partial: bool = False) -> Iterator[str | ToolCall | CallDraft]:
        position = 0
        while (begin := text.find(self.start_marker, position)) >= 0:
            yield text[position:begin]
            close = text.find(self._end, begin)
            body = text[begin + len(self.start_marker) : len(text) if close < 0 else close]
            pieces = self._calls_in(body)
            if partial and close < 0:  # the list being written: its complete calls, then the one being written
                for piece, whole in pieces:
                    call = self._read(piece) if whole else None
                    if call is None:
                        head = re.match(r"\s*([A-Za-z_][\w.\-]*)\s*\(", piece)
                        yield CallDraft(head.group(1) if head is not None else None, "")
                        return
                    yield call
                return
            end = len(text) if close < 0 else close + len(self._end)
            calls = [self._read(piece) if whole else None for piece, whole in pieces]
            ok = calls and all(c is not None for c in calls) and body.strip().startswith("[") and body.strip().endswith("]")
            yield from calls if ok else [text[begin:end]]
            position = end
        yield text[position:]

    @staticmethod
    def _calls_in(body: str) -> list[tuple[str, bool]]:
        """The list's calls as text, each with whether its parentheses closed (strings and nesting skipped)."""
        start = body.find("[")
        if start < 0:
            return []
        pieces, depth, quote, begin, i = [], 0, None, start + 1, start + 1
        while i < len(body):
            c = body[i]
            if quote:
                if c == "\\":
                    i += 1
                elif c == quote:
                    quote = None
            elif c in "\"'":
                quote = c
            elif c in "([{":
                depth += 1
            elif c in ")]}":
                if depth == 0:  # the list's closing bracket
                    break
                depth -= 1
                if depth == 0 and c == ")":
                    pieces.append((body[begin : i + 1], True))
                    begin = i + 1
            elif c == "," and depth == 0:
                begin = i + 1
            i += 1
        rest = body[begin:i].strip().lstrip(",").strip()
        if rest:
            pieces.append((rest, False))
        return pieces

    def _read(self, piece: str) -> ToolCall | None:
        try:
            node = ast.parse(piece.strip(), mode="eval").body
        except SyntaxError:
            return None
        if not isinstance(node, ast.Call) or node.args or not isinstance(node.func, (ast.Name, ast.Attribute)):
            return None
        name = ast.unparse(node.func)
        try:
            arguments = {k.arg: self._value(k.value) for k in node.keywords if k.arg is not None}
        except ValueError:
            return None
        return ToolCall(name, json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))) if _is_name(name) else None

    def _value(self, node: ast.AST) -> Any:
        if isinstance(node, ast.Name) and node.id in self._constants:
            return self._constants[node.id]
        if isinstance(node, ast.List | ast.Tuple):
            return [self._value(e) for e in node.elts]
        if isinstance(node, ast.Dict) and all(k is not None for k in node.keys):
            return {str(self._value(k)): self._value(v) for k, v in zip(node.keys, node.values)}
        return ast.literal_eval(node)

    def template_messages(self, messages: Iterable[Mapping[str, Any]]) -> list[dict]:
        out = []
        for m in to_template_messages(messages):
            if m.get("role") == "assistant" and m.get("tool_calls"):
                written = ", ".join(self._written(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"])
                m = {**m, "content": (m.get("content") or "") + f"{self.start_marker}[{written}]{self._end}"}
                m.pop("tool_calls")
            out.append(m)
        return out

    @staticmethod
    def _written(name: str, arguments: Any) -> str:
        values = json.loads(arguments) if isinstance(arguments, str) else dict(arguments)
        return f"{name}(" + ", ".join(f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in values.items()) + ")"

    # -- grammar: keyword arguments, each value a JSON value (a string as a double-quoted literal) ------------

    def _start_rule(self, lark: _LarkWriter, many: bool) -> str:
        calls = f"call ({lark.text(', ')} call)*" if many else "call"
        return f"{lark.marker(self.start_marker)} {lark.text('[')} {calls} {lark.text(']')} {lark.marker(self._end)}"

    def _call_rule(self, lark: _LarkWriter, name: str, args: str) -> str:
        return f"{lark.text(name + '(')} {args} {lark.text(')')}"

    def _arguments_rules(self, lark: _LarkWriter, rule: str, schema: dict) -> list[str]:
        properties = schema.get("properties") if isinstance(schema.get("properties"), Mapping) else {}
        required = [p for p in schema.get("required") or [] if isinstance(p, str) and p in properties]
        shared = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
        rules, items = [], []
        for k, key in enumerate([*required, *(p for p in properties if p not in required)]):
            prop = dict(properties[key]) if isinstance(properties[key], Mapping) else {}
            rules.append(f"{rule}_{k}_value: %json {json.dumps({**shared, **prop, 'x-guidance': JSON_OPTIONS})}")
            comma = lark.text(", ") + " " if k else ""
            item = f"{comma}{lark.text(key + '=')} {rule}_{k}_value"
            items.append(item if key in required else f"({item})?")
        return [f"{rule}: {' '.join(items)}", *rules]


class GigaChatFormat(ToolFormat):
    """GigaChat 3's call: the function's name and arguments as one JSON object after `<|function_call|>`,
    which ends the turn:

        <|function_call|>{"name": "get_weather", "arguments": {"city": "Paris"}}

    The templates show one call per turn (they render an assistant turn's first call only): the grammar
    forces one, and the answer's first call is its call."""

    name = "gigachat"
    start_marker = "<|function_call|>"
    _token_markers = frozenset({start_marker})

    def _segments(self, text: str, partial: bool = False) -> Iterator[str | ToolCall | CallDraft]:
        position = 0
        while (begin := text.find(self.start_marker, position)) >= 0:
            yield text[position:begin]
            after = begin + len(self.start_marker)
            call, end = _object_call(text, after)
            if call is not None:
                yield call
                position = end
                continue
            if partial:  # the call being written
                yield _object_draft(text, after)
                return
            yield text[begin:]
            return
        yield text[position:]

    def _start_rule(self, lark: _LarkWriter, many: bool) -> str:
        return "call"  # one call per turn

    def _call_rule(self, lark: _LarkWriter, name: str, args: str) -> str:
        head = lark.text('{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": ')
        return f"{lark.marker(self.start_marker)} {head} {args} {lark.text('}')}"


class _Sectioned:
    """For formats whose answer is in sections (a reasoning one, a response one, then the calls): the
    reasoning is told apart (`ParsedOutput.reasoning`, the draft's), and the response's markers dropped. The
    prompt may have opened the reasoning section: then the answer begins inside it."""

    _thinking: ClassVar[tuple[str, str]]
    _response: ClassVar[tuple[str, str]]

    def parse(self, text: str, cut: bool = False) -> ParsedOutput:
        reasoning, text = self._reasoning(without_end_of_turn(text))
        parsed = super().parse(text, cut)  # type: ignore[misc]
        return ParsedOutput(parsed.content, parsed.calls, reasoning)

    def draft(self, text: str) -> Draft:
        reasoning, rest = self._reasoning(without_end_of_turn(text))
        return Draft(self.streamable(rest), super().draft(rest).calls, reasoning or "")  # type: ignore[misc]

    def streamable(self, text: str) -> str:
        return super().streamable(self._reasoning(without_end_of_turn(text))[1])  # type: ignore[misc]

    def held_back(self, text: str) -> int:
        own = super().held_back(text)  # type: ignore[misc]
        return max(own, partial_marker_length(text, (*self._thinking, *self._response)))

    def _reasoning(self, text: str) -> tuple[str | None, str]:
        """(the reasoning, the rest) of an answer, the response's markers dropped."""
        begin, end = self._thinking
        reasoning = None
        if (start := text.find(begin)) >= 0:
            close = text.find(end, start)
            reasoning = text[start + len(begin) : len(text) if close < 0 else close].strip() or None
            text = text[:start] + ("" if close < 0 else text[close + len(end) :])
        elif (close := text.find(end)) >= 0:  # the prompt opened the section
            reasoning, text = text[:close].strip() or None, text[close + len(end) :]
        return reasoning, text.replace(self._response[0], "").replace(self._response[1], "")


class CohereFormat(_Sectioned, ToolFormat):
    """Cohere Command's actions (Command A, Cohere2-MoE): the turn's calls as one JSON list between
    `<|START_ACTION|>` and `<|END_ACTION|>`, each with an id, the tool's name and its parameters; the answer's
    text between `<|START_RESPONSE|>` and `<|END_RESPONSE|>`, its reasoning between `<|START_THINKING|>` and
    `<|END_THINKING|>`:

        <|START_ACTION|>[
            {"tool_call_id": "0", "tool_name": "get_weather", "parameters": {"city": "Paris"}}
        ]<|END_ACTION|>"""

    name = "cohere"
    start_marker = "<|START_ACTION|>"
    _end = "<|END_ACTION|>"
    _thinking = ("<|START_THINKING|>", "<|END_THINKING|>")
    _response = ("<|START_RESPONSE|>", "<|END_RESPONSE|>")
    _token_markers = frozenset({start_marker, _end, *_thinking, *_response})

    def _segments(self, text: str, partial: bool = False) -> Iterator[str | ToolCall | CallDraft]:
        position = 0
        while (begin := text.find(self.start_marker, position)) >= 0:
            yield text[position:begin]
            close = text.find(self._end, begin)
            body = text[begin + len(self.start_marker) : len(text) if close < 0 else close]
            if partial and close < 0:  # the list being written: its whole calls, then the one being written
                yield from self._listed(body, partial=True)
                return
            end = len(text) if close < 0 else close + len(self._end)
            calls = self._listed(body, partial=False)
            yield from calls if calls else [text[begin:end]]
            position = end
        yield text[position:]

    @staticmethod
    def _listed(body: str, partial: bool) -> list[ToolCall | CallDraft]:
        """The calls in an action list (all of them, or [] if it is malformed); while `partial`, the
        complete objects so far, then a draft of the one being written. The arguments are the parameters
        as written (minified), so what streamed of them is a prefix of the whole."""
        calls: list[ToolCall | CallDraft] = []
        position = body.find("[")
        if position < 0:
            return [CallDraft(None, "")] if partial else []
        position += 1
        while True:
            while position < len(body) and body[position] in " \t\r\n,":
                position += 1
            if position >= len(body) or body[position] == "]":
                break
            value, end = _json_at(body, position)
            head = re.search(r'"tool_name"\s*:\s*("(?:[^"\\]|\\.)*")', body[position : end if value is not None else len(body)])
            name = json.loads(head.group(1)) if head is not None else None
            start = re.search(r'"parameters"\s*:\s*', body[position : end if value is not None else len(body)])
            if value is None:  # the object being written (or a malformed one)
                if not partial:
                    return []
                arguments = _arguments_prefix(body, position + start.end()) if start is not None and _is_name(name) else None
                calls.append(CallDraft(name if _is_name(name) else None, arguments or ""))
                return calls
            arguments = _arguments_at(body, position + start.end())[0] if start is not None else None
            if arguments is None or not _is_name(name) or not isinstance(value, dict):
                return calls if partial else []
            calls.append(ToolCall(name, arguments))
            position = end
        if not partial and body[position:].strip() != "]":
            return []
        return calls

    def _start_rule(self, lark: _LarkWriter, many: bool) -> str:
        calls = f"call ({lark.text(',' + chr(10))} call)*" if many else "call"
        return f"{lark.marker(self.start_marker)} {lark.text('[' + chr(10))} {calls} {lark.text(chr(10) + ']')} {lark.marker(self._end)}"

    def _call_rule(self, lark: _LarkWriter, name: str, args: str) -> str:
        head = (
            lark.text('    {"tool_call_id": "')
            + " CALL_NUMBER "
            + lark.text('", "tool_name": ' + json.dumps(name) + ', "parameters": ')
        )
        return f"{head} {args} {lark.text('}')}"

    def _extra_rules(self, lark: _LarkWriter) -> list[str]:
        return ["CALL_NUMBER: /[0-9]+/"]


class KimiXtmlFormat(_Sectioned, _InvokeFormat):
    """Moonshot's Kimi-K3 answer: tagged sections, each `<|open|>NAME attributes<|sep|>` ...
    `<|close|>NAME<|sep|>` (`<|open|>`, `<|close|>` and `<|sep|>` special tokens): the reasoning (`think`, opened by the prompt when
    thinking is on), the response (its content), then the calls, each argument typed by its `type`:

        hm<|close|>think<|sep|><|open|>response<|sep|>Checking.<|close|>response<|sep|><|open|>tools<|sep|>
        <|open|>call tool="get_weather" index="1"<|sep|><|open|>argument key="city" type="string"<|sep|>Paris
        <|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|>

    (on one line). A call's arguments may also come as one JSON object (`<|open|>json type="object"<|sep|>`)."""

    name = "kimi-xtml"
    start_marker = "<|open|>tools<|sep|>"
    _end = "<|close|>tools<|sep|>"
    _thinking = ("<|open|>think<|sep|>", "<|close|>think<|sep|>")
    _response = ("<|open|>response<|sep|>", "<|close|>response<|sep|>")
    _token_markers = frozenset({"<|open|>", "<|close|>", "<|sep|>"})
    _invoke = re.compile(r'\s*<\|open\|>call tool="([^"\n]*)"(?: index="\d+")?<\|sep\|>')
    _parameter = re.compile(r'\s*<\|open\|>argument key="([^"\n]*)" type="([a-z]+)"<\|sep\|>')
    _invoke_end = "<|close|>call<|sep|>"
    _parameter_end = "<|close|>argument<|sep|>"
    _json = re.compile(r'\s*<\|open\|>json type="object"<\|sep\|>')
    _json_end = "<|close|>json<|sep|>"
    # a JSON schema type as the format names it
    _types = {"string": "string", "integer": "number", "number": "number", "boolean": "boolean", "null": "null"}

    @staticmethod
    def _is_string(attribute: str | None) -> bool | None:
        return None if attribute is None else attribute == "string"

    def _read_invoke(self, name: str, body: str, complete: bool) -> ToolCall | CallDraft | None:
        whole = self._json.match(body)
        if whole is None:
            return super()._read_invoke(name, body, complete)
        close = body.find(self._json_end, whole.end())
        arguments, end = _arguments_at(body[: len(body) if close < 0 else close], whole.end())
        if complete:
            ok = close >= 0 and arguments is not None and not body[close + len(self._json_end) :].strip() and _is_name(name)
            return ToolCall(name.strip(), arguments) if ok else None
        return CallDraft(name.strip(), _arguments_prefix(body, whole.end()) or "") if _is_name(name) else CallDraft(None, "")

    def _start_rule(self, lark: _LarkWriter, many: bool) -> str:
        # Out of the reasoning (if the prompt opened it) and the response, then the tools' section.
        # Into the response (after reasoning) or not (the prompt opened it), out of it, into the tools' section.
        calls = "call+" if many else "call"
        tools = lark.spelled(self._response[1] + self.start_marker)
        return f"({lark.spelled(self._response[0])})? {tools} {calls} {lark.spelled(self._end)}"

    def _call_rule(self, lark: _LarkWriter, name: str, args: str) -> str:
        head = lark.spelled(f'<|open|>call tool="{name}" index="') + " CALL_INDEX " + lark.spelled('"<|sep|>')
        return f"{head} {args} {lark.spelled(self._invoke_end)}"

    def _parameter_rule(self, lark: _LarkWriter, key: str, value: str, types: set[str] | None = None) -> str:
        listed = sorted(types or {"string"})
        string = _written_as_text(types)
        kind = "string" if string else next((self._types[t] for t in listed if t in self._types), listed[0])
        head = lark.spelled(f'<|open|>argument key="{key}" type="{kind}"<|sep|>')
        return f"{head} {value} {lark.spelled(self._parameter_end)}"

    def _extra_rules(self, lark: _LarkWriter) -> list[str]:
        return ["PARAMETER_TEXT: /[^<]*/", "CALL_INDEX: /[0-9]+/"]


class MiniMaxM3Format(_InvokeFormat):
    """MiniMax-M3's calls: the invoke format (see `_InvokeFormat`) with each tag after a separator token
    `]<]minimax[>[` (SEP below), each argument an element named by its key; an object's fields and an array's
    `<item>`s are elements in turn, a scalar is text typed by the tool's schema (see `_XmlFormat`):

        SEP<tool_call>
        SEP<invoke name="get_weather">SEP<city>ParisSEP</city>SEP<days>3SEP</days>SEP</invoke>
        SEP</tool_call>

    The separators carry nothing: the calls are read from the text without them."""

    name = "minimax-m3"
    SEP = "]<]minimax[>["
    start_marker = "<tool_call>"
    _end = "</tool_call>"
    _other_starts = (SEP,)
    _token_markers = frozenset({SEP})
    _open = re.compile(r"\s*<([A-Za-z_][\w.\-:]*)>")

    def _segments(self, text: str, partial: bool = False) -> Iterator[str | ToolCall | CallDraft]:
        return super()._segments(text.replace(self.SEP, ""), partial)

    def _read_invoke(self, name: str, body: str, complete: bool) -> ToolCall | CallDraft | None:
        name = name.strip()
        if not _is_name(name):
            return None if complete else CallDraft(None, "")
        parameters = self.schemas.get(name)
        properties = parameters.get("properties") if isinstance(parameters, Mapping) else None
        position, pairs = 0, []
        while (tag := self._open.match(body, position)) is not None:
            key = tag.group(1)
            try:
                value, position = self._value(
                    body, tag.end(), key, properties.get(key) if isinstance(properties, Mapping) else None
                )
            except ValueError:  # cut short, or malformed
                return self._end_of_call(name, pairs, complete, closed=False)
            pairs.append(json.dumps(key, ensure_ascii=False) + ":" + json.dumps(value, ensure_ascii=False, separators=(",", ":")))
        return self._end_of_call(name, pairs, complete, closed=complete and not body[position:].strip())

    def _value(self, text: str, position: int, tag: str, schema: Any) -> tuple[Any, int]:
        """The value of element `tag` whose content begins at `position`, and where its closing tag ends."""
        schema = schema if isinstance(schema, Mapping) else {}
        closing = f"</{tag}>"
        child = self._open.match(text, position)
        if child is not None and not text.startswith(closing, position):  # an array's items or an object's fields
            items, fields = [], {}
            while (child := self._open.match(text, position)) is not None:
                key = child.group(1)
                sub = schema.get("items") if key == "item" else (schema.get("properties") or {}).get(key)
                value, position = self._value(text, child.end(), key, sub)
                items.append(value) if key == "item" else fields.__setitem__(key, value)
            end = re.compile(rf"\s*{re.escape(closing)}").match(text, position)
            if end is None:
                raise ValueError(closing)
            return (items if items and not fields else fields), end.end()
        close = text.find(closing, position)
        if close < 0:
            raise ValueError(closing)
        return _typed_value(text[position:close], schema or None), close + len(closing)

    # -- grammar: each argument as elements, by its schema --------------------------------------------------

    def _start_rule(self, lark: _LarkWriter, many: bool) -> str:
        sep = lark.marker(self.SEP)
        calls = "call+" if many else "call"
        return f"{sep} {lark.text(self.start_marker + chr(10))} {calls} {sep} {lark.text(self._end)}"

    def _call_rule(self, lark: _LarkWriter, name: str, args: str) -> str:
        sep = lark.marker(self.SEP)
        return f"{sep} {lark.text(f'<invoke name={json.dumps(name)}>')} {args} {sep} {lark.text('</invoke>' + chr(10))}"

    def _arguments_rules(self, lark: _LarkWriter, rule: str, schema: dict) -> list[str]:
        rules: list[str] = []
        rules.append(f"{rule}: {self._fields(lark, rule, schema, rules, 0)}")
        return rules

    def _fields(self, lark: _LarkWriter, rule: str, schema: Mapping, rules: list[str], depth: int) -> str:
        properties = schema.get("properties") if isinstance(schema.get("properties"), Mapping) else {}
        required = [p for p in schema.get("required") or [] if p in properties]
        items = []
        for k, key in enumerate([*required, *(p for p in properties if p not in required)]):
            element = self._element(lark, f"{rule}_{k}", key, properties[key], rules, depth)
            items.append(element if key in required else f"({element})?")
        return " ".join(items) if items else '""'

    def _element(self, lark: _LarkWriter, rule: str, key: str, schema: Any, rules: list[str], depth: int) -> str:
        """One element: its tag, its value by `schema`, its closing tag."""
        sep, schema = lark.marker(self.SEP), dict(schema) if isinstance(schema, Mapping) else {}
        types = _value_types(schema)
        head, tail = f"{sep} {lark.text(f'<{key}>')}", f"{sep} {lark.text(f'</{key}>')}"
        if types == {"object"} and depth < 4:
            return f"{head} {self._fields(lark, rule, schema, rules, depth + 1)} {tail}"
        if types == {"array"} and depth < 4:
            item = self._element(lark, f"{rule}_item", "item", schema.get("items"), rules, depth + 1)
            return f"{head} ({item})* {tail}"
        if _written_as_text(types):
            enum = schema.get("enum")
            if isinstance(enum, list) and enum and all(isinstance(e, str) for e in enum):
                return f"{head} ({' | '.join(lark.text(e) for e in enum)}) {tail}"
            if lark.is_token(self.SEP):  # (a regex never matches a special token: any text, up to it)
                return f"{head} M3_TEXT {tail}"
            return f"{head} M3_TEXT {lark.text(f'</{key}>')}"  # (the lexeme takes in the separator)
        rules.append(f"{rule}_value: %json {json.dumps({**schema, 'x-guidance': JSON_OPTIONS})}")
        return f"{head} {rule}_value {tail}"

    def _extra_rules(self, lark: _LarkWriter) -> list[str]:
        if lark.is_token(self.SEP):
            return [r"M3_TEXT: /[^\x00]*/"]
        return [_text_until("M3_TEXT", self.SEP, self.SEP)]


class LlamaFormat(ToolFormat):
    """Llama 3.1-3.3's and Llama 4's JSON calls: the answer is the call, a bare JSON object naming the
    function and giving its "parameters" (some write "arguments"):

        {"name": "get_weather", "parameters": {"city": "Paris"}}

    Several calls are objects in a row, separated by `;` or whitespace. There is no marker, so an answer
    is calls only when it begins with `{"name"`: JSON elsewhere in prose is content. Llama 3.1 may put
    `<|python_tag|>` before its calls (the token that opens its built-in tools' code) and Llama 4's
    template wraps what it says before its calls in `<|python_start|>`...`<|python_end|>`: after any of
    these tokens a call may begin too; the text before them is content and they themselves are dropped.
    Text after the calls is content as well.

    Streaming: an answer that begins like a call (`{`, `{"na`...) is held back until it is one or cannot
    be one, so JSON that is not a call goes out only with the answer's end."""

    name = "llama"
    start_marker = '{"name"'
    _wrappers = ("<|python_tag|>", "<|python_start|>", "<|python_end|>")
    _token_markers = frozenset(_wrappers)
    _head = re.compile(r'\s*\{\s*"name"')
    # What may still grow into the head: `{`, then `"name"` begun.
    _head_begun = re.compile(r'\s*(?:\{\s*(?:"(?:n(?:a(?:m(?:e)?)?)?)?)?)?')
    _between = re.compile(r"\s*;?\s*(?:<\|python_end\|>\s*)?")
    _close = re.compile(r"\s*\}")

    def held_back(self, text: str) -> int:
        return partial_marker_length(text, (*self._wrappers, *END_OF_TURN))

    def streamable(self, text: str) -> str:
        """Nothing while the answer may be (or is) calls from its start; else the text before the first
        of the wrapper tokens (after them may come calls), less a trailing piece that may begin one."""
        text = without_end_of_turn(text)
        if self._head.match(text) or self._head_begun.fullmatch(text):
            return ""
        first = min((i for i in (text.find(m) for m in self._wrappers) if i >= 0), default=-1)
        if first >= 0:
            return text[:first].strip()
        return text[: len(text) - self.held_back(text)].strip()

    def _segments(self, text: str, partial: bool = False) -> Iterator[str | ToolCall | CallDraft]:
        start = self._calls_start(text, partial)
        if start is None:  # no call: all of it is content (wrapper tokens and all)
            yield text
            return
        calls: list[ToolCall] = []
        position = start
        while True:
            call, end = self._call_at(text, position)
            if call is None:
                if partial:  # the call being written (or a malformed one, which cannot be told yet)
                    yield from calls
                    yield self._draft_at(text, position)
                    return
                if not calls:  # the first call malformed: the answer is content as written
                    yield text
                    return
                yield from calls
                yield text[position:]
                return
            calls.append(call)
            position = self._between.match(text, end).end()
            if self._head.match(text, position):
                continue
            yield from calls
            if not (partial and self._head_begun.fullmatch(text, position)):  # (may be the next call's beginning)
                yield self._outside(text[:start]) + text[position:]
            return

    def _calls_start(self, text: str, partial: bool) -> int | None:
        """Where the calls begin: at the answer's start or after a wrapper token, wherever an object that
        names a function begins (or, in a partial answer, may be beginning); None where none does."""
        starts = [0] + [m.end() for m in re.finditer("|".join(re.escape(w) for w in self._wrappers), text)]
        for start in starts:
            if self._head.match(text, start) or (partial and self._head_begun.fullmatch(text, start)):
                return start + len(text[start:]) - len(text[start:].lstrip())
        return None

    def _outside(self, text: str) -> str:
        for wrapper in self._wrappers:
            text = text.replace(wrapper, "")
        return text

    def _call_at(self, text: str, start: int) -> tuple[ToolCall | None, int]:
        """The call object at `start`: the name first, then the arguments, nothing else; (None, start)
        otherwise (an object that only looks like a call, {"name": "Bob", "age": 3}, is not one)."""
        head = _NAME_FIRST.match(text, start)
        if head is None:
            return None, start
        arguments, end = _arguments_at(text, head.end())
        close = self._close.match(text, end) if arguments is not None else None
        name = json.loads(head.group(1))
        if close is None or not _is_name(name):
            return None, start
        return ToolCall(name, arguments), close.end()

    def _draft_at(self, text: str, start: int) -> CallDraft:
        head = _NAME_FIRST.match(text, start)
        if head is None or not _is_name(name := json.loads(head.group(1))):
            return CallDraft(None, "")
        return CallDraft(name, _arguments_prefix(text, head.end()) or "")

    def _start_rule(self, lark: _LarkWriter, many: bool) -> str:
        return f"call ({lark.text('; ')} call)*" if many else "call"

    def _call_rule(self, lark: _LarkWriter, name: str, args: str) -> str:
        head = lark.text('{"name": ' + json.dumps(name, ensure_ascii=False) + ', "parameters": ')
        return f"{head} {args} {lark.text('}')}"


FAMILIES: dict[str, type[ToolFormat]] = {
    cls.name: cls
    for cls in (
        HermesFormat,
        MistralFormat,
        DeepSeekFormat,
        DsmlFormat,
        KimiFormat,
        MiniMaxFormat,
        SolarFormat,
        GigaChatFormat,
        CohereFormat,
        HunyuanFormat,
        PythonicFormat,
        KimiXtmlFormat,
        MiniMaxM3Format,
        HarmonyFormat,
        Qwen3CoderFormat,
        GlmFormat,
        LlamaFormat,
    )
}


def detect(chat_template: str | None) -> ToolFormat | None:
    """The tool-call format a chat template shows, from the markers in its text; None when it shows none.
    The XML-like formats come without the tools: `with_tools` gives them those of a request."""
    if not chat_template:
        return None
    t = chat_template
    if "<|channel|>" in t and "<|call|>" in t:
        return HarmonyFormat()
    if "<|open|>" in t and "argument" in t and "'tools'" in t:  # Kimi-K3's tagged sections
        return KimiXtmlFormat()
    if MiniMaxM3Format.SEP in t:
        return MiniMaxM3Format()
    if DsmlFormat._tag in t:  # (the templates build the block's name from pieces: look for its spelling)
        return DsmlFormat(block="function_calls" if "function_calls>" in t else "tool_calls")
    if KimiFormat.start_marker in t:
        return KimiFormat()
    if MiniMaxFormat.start_marker in t:
        return MiniMaxFormat()
    if SolarFormat._call_begin in t:
        return SolarFormat()
    if GigaChatFormat.start_marker in t or ("function_call=" in t and "<|role_sep|>" in t):
        return GigaChatFormat()
    if CohereFormat.start_marker in t:
        return CohereFormat()
    if (hunyuan := HunyuanFormat.of(t)) is not None:
        return hunyuan
    if "<|tool_list_start|>" in t or PythonicFormat.start_marker in t:  # (LFM2's template names only the tools' list)
        return PythonicFormat()
    if DeepSeekFormat._call_begin in t or DeepSeekFormat.start_marker in t:
        return DeepSeekFormat(fenced="```json" in t)
    if MistralFormat.start_marker in t:
        return MistralFormat(args_style="[ARGS]" in t)
    # The XML-like formats also use <tool_call>: their inner tags tell them apart from Hermes's JSON.
    if "<arg_key>" in t:
        return GlmFormat()
    if "<function=" in t and "<parameter=" in t:
        return Qwen3CoderFormat()
    if HermesFormat.start_marker in t:
        return HermesFormat()
    # Llama's templates have no call marker: they ask for the JSON object in words, and 3.1's name the
    # token its built-in tools' code follows.
    if "<|python_tag|>" in t or '"parameters": dictionary of argument name and its value' in t:
        return LlamaFormat()
    return None


def to_template_messages(messages: Iterable[Mapping[str, Any]], *, arguments_as_dict: bool = True) -> list[dict]:
    """OpenAI-shaped messages as chat templates expect them.

    - An assistant message's `tool_calls[].function.arguments` is JSON text in OpenAI's API; most
      templates `tojson` it (and would write a JSON string of the JSON), so it becomes the mapping it
      encodes (`arguments_as_dict`); DeepSeek's concatenate it, so for them it stays (or becomes) text.
    - A tool message keeps `tool_call_id` and gets `name`, the called function's (from the call with
      that id), for the templates that show it.
    - Content given as text parts becomes one string; None becomes "" (templates concatenate it or look
      inside it); keys whose value is None, and an empty `tool_calls`, are dropped (templates test
      `is defined` and then iterate).
    """
    names: dict[str, str] = {}
    result = []
    for message in messages:
        m = {k: v for k, v in message.items() if v is not None or k == "content"}
        if m.get("content") is None:
            m["content"] = ""
        elif isinstance(m["content"], list) and all(isinstance(p, Mapping) and p.get("type") == "text" for p in m["content"]):
            m["content"] = "".join(p.get("text", "") for p in m["content"])
        if "tool_calls" in m and not m["tool_calls"]:
            del m["tool_calls"]
        if m.get("role") == "assistant" and m.get("tool_calls"):
            m["tool_calls"] = [_template_call(call, arguments_as_dict) for call in m["tool_calls"]]
            for call in m["tool_calls"]:
                if call.get("id") and isinstance(call.get("function"), Mapping):
                    names[call["id"]] = call["function"].get("name")
        elif m.get("role") == "tool" and "name" not in m and names.get(m.get("tool_call_id")):
            m["name"] = names[m["tool_call_id"]]
        result.append(m)
    return result


def _template_call(call: Mapping[str, Any], as_dict: bool) -> dict:
    call = dict(call)
    function = call.get("function")
    if isinstance(function, Mapping):
        function = dict(function)
        arguments = function.get("arguments")
        if as_dict and isinstance(arguments, str):
            try:
                function["arguments"] = json.loads(arguments)
            except ValueError:
                pass  # not JSON: the template shows it as it is
        elif not as_dict and not isinstance(arguments, str) and arguments is not None:
            function["arguments"] = json.dumps(arguments, ensure_ascii=False)
        call["function"] = function
    return call


# -- helpers ----------------------------------------------------------------------------------------------

_DECODER = json.JSONDecoder()


def _json_at(text: str, start: int) -> tuple[Any, int]:
    """The JSON value at `start` (after whitespace) and where it ends; (None, start) if there is none."""
    begin = start + len(text[start:]) - len(text[start:].lstrip())
    try:
        return _DECODER.raw_decode(text, begin)
    except ValueError:
        return None, start


# A call's arguments are the object the model wrote less the whitespace between its tokens (strings kept as
# written), so that what a stream sent of them while they were written is a prefix of the whole. A string
# (closed, or still open at the end of the text) or a run of whitespace: the whitespace goes.
_STRING_OR_SPACE = re.compile(r'"(?:[^"\\]|\\.)*(?:"|\\?\Z)|\s+')
# A call object that names its function first, as the templates write them: the name, then the arguments.
_NAME_FIRST = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*')


def _minified(text: str) -> str:
    return _STRING_OR_SPACE.sub(lambda m: m.group() if m.group().startswith('"') else "", text)


def _arguments_at(text: str, start: int) -> tuple[str | None, int]:
    """A call's arguments at `start` (after whitespace) as compact JSON text, and where they end; (None,
    start) if there are none. An object is kept as written, minified; JSON text encoding an object (some
    models quote their arguments) becomes that object's compact JSON."""
    value, end = _json_at(text, start)
    if isinstance(value, dict):
        begin = start + len(text[start:]) - len(text[start:].lstrip())
        return _minified(text[begin:end]), end
    arguments = _arguments_json(value) if isinstance(value, str) else None
    return (arguments, end) if arguments is not None else (None, start)


def _arguments_prefix(text: str, start: int) -> str | None:
    """The arguments object that begins at `start` (after whitespace) as written so far, minified as
    `_arguments_at` will give it whole (up to its closing brace); None where no object has begun."""
    begin = start + len(text[start:]) - len(text[start:].lstrip())
    if not text.startswith("{", begin):
        return None
    depth = 0
    for match in re.finditer(r'"(?:[^"\\]|\\.)*(?:"|\\?\Z)|[{}\[\]]', text[begin:]):
        token = match.group()
        if token in "{[":
            depth += 1
        elif token in "}]":
            depth -= 1
            if depth == 0:
                return _minified(text[begin : begin + match.end()])
    return _minified(text[begin:])


def _object_call(text: str, start: int) -> tuple[ToolCall | None, int]:
    """The call object ({"name": ..., "arguments": {...}}) at `start` and where it ends; (None, start)
    if there is none."""
    value, end = _json_at(text, start)
    if not isinstance(value, dict):
        return None, start
    head = _NAME_FIRST.match(text, start + len(text[start:]) - len(text[start:].lstrip()))
    if head is not None:
        arguments, arguments_end = _arguments_at(text, head.end())
        name = json.loads(head.group(1))
        if arguments is not None and _is_name(name) and text[arguments_end:end].strip() == "}":
            return ToolCall(name, arguments), end
    call = _call_from_object(value)
    return (call, end) if call is not None else (None, start)


def _object_draft(text: str, start: int) -> CallDraft:
    """The call object being written at `start`: its name and arguments so far where the name comes first."""
    head = _NAME_FIRST.match(text, start + len(text[start:]) - len(text[start:].lstrip()))
    name = json.loads(head.group(1)) if head is not None else None
    if not _is_name(name):
        return CallDraft(None, "")
    return CallDraft(name, _arguments_prefix(text, head.end()) or "")


def _arguments_json(value: Any) -> str | None:
    """Arguments as compact JSON text, from an object or from JSON text encoding one; None otherwise."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    if not isinstance(value, dict):
        return None
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _call_from_object(value: Any) -> ToolCall | None:
    """{"name": ..., "arguments": {...}} (some models write "parameters") as a call; None if it is not one."""
    if not isinstance(value, dict) or not _is_name(value.get("name")):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    arguments = _arguments_json(arguments)
    return ToolCall(value["name"], arguments) if arguments is not None else None


def _is_name(name: Any) -> bool:
    """A plausible function name: non-empty, no whitespace or markup (OpenAI allows [a-zA-Z0-9_-] and
    models add dots and colons)."""
    return isinstance(name, str) and re.fullmatch(r"[^\s<>\[\]{}\"'`]+", name) is not None


def _schemas_of(tools: Iterable[Mapping[str, Any]] | None) -> dict[str, Mapping[str, Any]]:
    """Function name -> its parameters' JSON schema, from OpenAI's `tools` (entries not shaped so skipped)."""
    schemas: dict[str, Mapping[str, Any]] = {}
    for tool in tools or []:
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if isinstance(function, Mapping) and isinstance(function.get("name"), str):
            parameters = function.get("parameters")
            schemas[function["name"]] = parameters if isinstance(parameters, Mapping) else {}
    return schemas


_JSON_TYPES = ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"), (list, "array"), (dict, "object"))


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    return next((name for kind, name in _JSON_TYPES if isinstance(value, kind)), "object")


def _written_as_text(types: set[str] | None) -> bool:
    """Whether an XML-style format writes a value of these JSON types as text, as written (a schema that
    allows a string, or says nothing): reading the text back keeps it a string."""
    return types is None or "string" in types


def _value_types(schema: Any) -> set[str] | None:
    """The JSON types a schema allows (from `type`, `enum`, `const`, `anyOf`/`oneOf`); None where it does
    not say."""
    if not isinstance(schema, Mapping):
        return None
    kind = schema.get("type")
    if isinstance(kind, str):
        return {kind}
    if isinstance(kind, list) and kind and all(isinstance(k, str) for k in kind):
        return set(kind)
    if "const" in schema:
        return {_json_type(schema["const"])}
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return {_json_type(v) for v in schema["enum"]}
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list) and schema[key]:
            parts = [_value_types(s) for s in schema[key]]
            return None if any(p is None for p in parts) else set().union(*parts)
    return None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


# JSON as RFC 8259 has it: no NaN or Infinity (json.dumps would write them back, and they are not JSON).
_STRICT_DECODER = json.JSONDecoder(parse_constant=_no_constant)


def _typed_value(raw: str, schema: Any) -> Any:
    """A value written as raw text, typed by its property's schema: a string where the schema says
    string only (or says nothing); else the JSON it is, or the Python literal (True, {'a': 1}: templates
    that render values with `str`), or, where neither fits the schema's other types, the text."""
    types = _value_types(schema)
    if types is None or types == {"string"}:
        return raw
    text = raw.strip()
    candidates = []
    try:
        candidates.append(_STRICT_DECODER.decode(text))
    except ValueError:
        lowered = {"true": True, "false": False, "null": None, "none": None}
        if text.lower() in lowered:
            candidates.append(lowered[text.lower()])
        else:
            try:
                value = ast.literal_eval(text)
                candidates.append(json.loads(json.dumps(value, allow_nan=False)))  # only what JSON can hold
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                pass
    for value in candidates:
        kind = _json_type(value)
        fits = kind in types or (kind == "integer" and "number" in types)
        if fits or "string" not in types:
            return value
    return raw


def _regex_text(text: str) -> str:
    """`text` as a regex for llguidance's Lark (letters and digits as they are, all else as \\x{..})."""
    return "".join(c if c.isascii() and c.isalnum() else f"\\x{{{ord(c):x}}}" for c in text)


def _text_until(lexeme: str, ending: str, marker: str) -> str:
    """A lexeme: any text that ends with `ending` and has `marker` (which `ending` ends with) nowhere
    before. The lexer takes the longest match without backtracking, so free text followed by a closing
    tag must take the tag in: it ends at the first one."""
    return f"{lexeme}: /(?s:.*){_regex_text(ending)}/ & ~/(?s:.*{_regex_text(marker)}.+)/"


def partial_marker_length(text: str, markers: Iterable[str]) -> int:
    """The length of the longest end of `text` that is the beginning of one of `markers`."""
    longest = 0
    for marker in markers:
        for k in range(min(len(marker), len(text)), longest, -1):
            if text.endswith(marker[:k]):
                longest = k
                break
    return longest


def without_end_of_turn(text: str) -> str:
    while True:
        stripped = text.rstrip()
        for token in END_OF_TURN:
            if stripped.endswith(token):
                text = stripped[: -len(token)]
                break
        else:
            return text


def _chosen_functions(tools: list[dict], choice: str | dict) -> list[tuple[str, dict]]:
    """(name, parameters schema) of the functions `choice` allows, from OpenAI's `tools`."""
    functions: dict[str, dict] = {}
    for tool in tools:
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping) or tool.get("type", "function") != "function":
            raise ValueError("each tool is {'type': 'function', 'function': {'name': ..., 'parameters': ...}}")
        name = function.get("name")
        if not _is_name(name) or name in functions:
            raise ValueError(f"tool names must be distinct names without spaces or markup, not {name!r}")
        # No parameters: a function without arguments.
        schema = function.get("parameters") or {"type": "object", "properties": {}, "additionalProperties": False}
        if not isinstance(schema, Mapping):
            raise ValueError(f"the parameters of tool {name!r} are not a JSON schema object")
        functions[name] = dict(schema)
    if not functions:
        raise ValueError("a tool choice needs at least one tool")
    if choice == "required":
        return list(functions.items())
    if isinstance(choice, Mapping) and choice.get("type") == "function" and isinstance(choice.get("function"), Mapping):
        name = choice["function"].get("name")
        if name not in functions:
            raise ValueError(f"tool_choice names {name!r}, which is not among the tools")
        return [(name, functions[name])]
    raise ValueError(f"no grammar for tool_choice {choice!r}: only 'required' or a named function constrain the answer")


class _LarkWriter:
    """Writes the pieces of a Lark grammar: text as string literals, markers as tokens where they are."""

    def __init__(self, added_tokens: Mapping[str, int] | None, token_markers: frozenset[str]):
        self.added_tokens = added_tokens
        self.token_markers = token_markers

    @staticmethod
    def text(s: str) -> str:
        return json.dumps(s, ensure_ascii=False)

    def is_token(self, m: str) -> bool:
        """Whether `marker(m)` writes a token (else the marker's text)."""
        if self.added_tokens is not None:
            return m in self.added_tokens
        return m in self.token_markers

    def spelled(self, text: str) -> str:
        """`text` as a sequence of its tokens' markers (where it holds marker tokens) and plain text."""
        tokens = sorted(set(self.added_tokens or ()) | set(self.token_markers), key=len, reverse=True)
        found = [t for t in tokens if t and t in text and self.is_token(t)]
        if not found:
            return self.text(text)
        parts = [p for p in re.split("(" + "|".join(re.escape(t) for t in found) + ")", text) if p]
        return " ".join(self.marker(p) if p in found else self.text(p) for p in parts)

    def holds_token(self, text: str) -> bool:
        """Whether `text` holds a marker that is a token (so no regex can match it)."""
        return any(t and t in text and self.is_token(t) for t in set(self.added_tokens or ()) | set(self.token_markers))

    def marker(self, m: str) -> str:
        if self.added_tokens is not None:
            token = self.added_tokens.get(m)
            return f"<[{int(token)}]>" if token is not None else self.text(m)
        if m not in self.token_markers:
            return self.text(m)
        if re.fullmatch(r"<[^<>\[\s][^<>\s]*>", m):
            return m  # llguidance looks the name up among the vocabulary's special tokens
        raise ValueError(f"the marker {m!r} is a special token whose id llguidance needs: pass added_tokens")
