"""An answer told apart while the model writes it: reasoning, content and tool calls, as deltas.

Both streaming endpoints (chat completions and responses) send what the model writes as it comes, in
three kinds: reasoning (a `<think>` block, or harmony's analysis channel), content, and tool calls, each
call's name first and then its arguments in pieces. `AnswerStream` turns the growing text of one answer
(decoded with its special tokens: tool-call markers often are special tokens) into those deltas, and,
when the answer is whole, into the final answer (`FinalAnswer`) that a non-streamed response gives.

Every delta is final: what went out is a prefix of the final answer's part, so a client that
concatenates the deltas holds the same reasoning, content and arguments as the non-streamed response.
The tool-call format (tool_calls.ToolFormat) is what knows, for a partial text, which content is safe to
send and how far each call's arguments go (`ToolFormat.draft`); `Thinking` knows where reasoning ends.
Content written after the calls goes out with the answer's end (only then is it known not to be part of
a call). A call the model opened and then wrote malformed (possible only without a grammar) stays with
what it sent; the final answer has it as content, as a non-streamed answer does.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from .tool_calls import END_OF_TURN, CallDraft, ToolCall, ToolFormat, partial_marker_length, without_end_of_turn


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class CallStarted:
    """Call `index` (0, 1, ... in the answer) begins: its id and name are known."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ArgumentsDelta:
    index: int
    text: str


Delta = ReasoningDelta | ContentDelta | CallStarted | ArgumentsDelta


@dataclass(frozen=True)
class IdentifiedCall:
    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class FinalAnswer:
    """The whole answer: its reasoning (None without), its content (None when the answer is only calls),
    and its calls with the ids they were announced with."""

    reasoning: str | None
    content: str | None
    calls: list[IdentifiedCall] = field(default_factory=list)


class Thinking:
    """Where a model's reasoning block begins and ends: `<think>` ... `</think>` (Qwen3, DeepSeek-R1, GLM-4.5
    and most others), or the markers of a family that has its own (`MARKERS`). The block is opened either by
    the prompt (templates that end the generation prompt with its opening: the answer starts inside it) or
    by the answer's first characters."""

    start = "<think>"
    end = "</think>"
    # Families with reasoning markers of their own: (a text that shows them in the template, start, end).
    MARKERS = (
        ("<|START_THINKING|>", "<|START_THINKING|>", "<|END_THINKING|>"),  # Cohere Command
        ("open_tag('think')", "<|open|>think<|sep|>", "<|close|>think<|sep|>"),  # Kimi-K3's tagged sections
        ("<mm:think>", "<mm:think>", "</mm:think>"),  # MiniMax-M3
    )

    def __init__(self, opened_by_prompt: bool, closed_by_prompt: bool = False, markers: tuple[str, str] | None = None):
        self.opened_by_prompt = opened_by_prompt
        # the prompt holds an empty block already (a template's thinking switched off): no reasoning comes
        self.closed_by_prompt = closed_by_prompt
        if markers is not None:
            self.start, self.end = markers

    @classmethod
    def of(cls, chat_template: str | None, prompt: str) -> Thinking | None:
        """The reasoning block of a chat template that has one, else None."""
        if not chat_template:
            return None
        markers = next(((start, end) for shown, start, end in cls.MARKERS if shown in chat_template), None)
        if markers is None and (cls.start not in chat_template or cls.end not in chat_template):
            return None
        start, end = markers or (cls.start, cls.end)
        ending = prompt.rstrip()
        return cls(opened_by_prompt=ending.endswith(start), closed_by_prompt=ending.endswith(end), markers=markers)

    @property
    def grammar_mode(self) -> str | None:
        """How a grammar that forces the answer (a tool call) lets the reasoning come first: "open" (the
        prompt opened the block: reasoning, its end, then the answer), "optional" (the model may open one),
        None (no reasoning: the block is closed already)."""
        if self.closed_by_prompt:
            return None
        return "open" if self.opened_by_prompt else "optional"

    def split(self, text: str, partial: bool) -> tuple[str, str]:
        """(reasoning, the rest) of an answer so far, neither with text that may still turn out to be a
        marker's beginning (while `partial`)."""
        body = text
        if not self.opened_by_prompt:
            stripped = text.lstrip()
            # (a bare closing marker first: the empty block of a model that chose not to reason, MiniMax-M3's)
            if stripped.startswith(self.end):
                return "", stripped[len(self.end) :].lstrip()
            if partial and stripped and self.end.startswith(stripped):
                return "", ""
            if not stripped.startswith(self.start):
                if partial and self.start.startswith(stripped):  # may yet be the block's opening
                    return "", ""
                return "", text
            body = stripped[len(self.start) :]
        close = body.find(self.end)
        if close < 0:  # still reasoning (or cut off while it reasoned: all of it is reasoning)
            if partial:
                body = body[: len(body) - partial_marker_length(body, (self.end,))]
            return body.strip(), ""
        return body[:close].strip(), body[close + len(self.end) :].lstrip()


class AnswerStream:
    """One answer's deltas as its text grows piece by piece (`update`), and its final form (`finish`).

    `tool_format`: the calls are parsed out (None: no tools offered, all that is not reasoning is
    content); `thinking`: the template's reasoning block (None: no reasoning apart); `max_calls`: the
    calls after that many are dropped (1: parallel calls off), None: no limit."""

    def __init__(self, tool_format: ToolFormat | None = None, thinking: Thinking | None = None, max_calls: int | None = None):
        self.tool_format = tool_format
        self.thinking = thinking
        self.max_calls = max_calls
        self.text = ""  # the answer so far
        self.reasoning_sent = ""
        self.content_sent = ""
        self.calls_sent: list[list[str]] = []  # [id, name, arguments sent] per announced call

    @property
    def plain(self) -> bool:
        """Whether the answer is content only, as it is written (no parsing, no special tokens)."""
        return self.tool_format is None and self.thinking is None

    def update(self, piece: str) -> list[Delta]:
        """The new deltas now that the answer has grown by `piece`."""
        self.text += piece
        reasoning, content, calls = self._parts(self.text)
        return self._deltas(reasoning, content, [(c.name, c.arguments) for c in calls if c.name is not None])

    def finish(self, text: str, cut: bool = False) -> tuple[list[Delta], FinalAnswer]:
        """The last deltas and the final answer, once `text` is the whole answer (`cut`: it ended at its
        length limit, and a call it ends in is dropped, not shown as content)."""
        reasoning, rest = self.thinking.split(text, partial=False) if self.thinking is not None else ("", text)
        if self.tool_format is None:
            content: str | None = rest if self.thinking is None else without_end_of_turn(rest).strip()
            calls: list[ToolCall] = []
        else:
            parsed = self.tool_format.parse(rest, cut)
            content, calls = parsed.content, parsed.calls
            reasoning = "\n".join(r for r in (reasoning, parsed.reasoning or "") if r)
            calls = calls[: self.max_calls]
        deltas = self._deltas(reasoning, content or "", [(c.name, c.arguments) for c in calls])
        ids = [sent[0] for sent in self.calls_sent]
        final_calls = [IdentifiedCall(ids[i], c.name, c.arguments) for i, c in enumerate(calls)]
        return deltas, FinalAnswer(reasoning or None, content, final_calls)

    def _parts(self, text: str) -> tuple[str, str, list[ToolCall | CallDraft]]:
        """(reasoning, content, calls) that a partial answer already says for sure."""
        reasoning, rest = self.thinking.split(text, partial=True) if self.thinking is not None else ("", text)
        if self.tool_format is None:
            if self.thinking is None:
                return "", text, []
            rest = without_end_of_turn(rest)
            return reasoning, rest[: len(rest) - partial_marker_length(rest, END_OF_TURN)].rstrip(), []
        draft = self.tool_format.draft(rest)
        calls = draft.calls[: self.max_calls]
        return "\n".join(r for r in (reasoning, draft.reasoning) if r), draft.content, calls

    def _deltas(self, reasoning: str, content: str, calls: list[tuple[str, str]]) -> list[Delta]:
        deltas: list[Delta] = []
        if reasoning.startswith(self.reasoning_sent) and len(reasoning) > len(self.reasoning_sent):
            deltas.append(ReasoningDelta(reasoning[len(self.reasoning_sent) :]))
            self.reasoning_sent = reasoning
        if content.startswith(self.content_sent) and len(content) > len(self.content_sent):
            deltas.append(ContentDelta(content[len(self.content_sent) :]))
            self.content_sent = content
        for index, (name, arguments) in enumerate(calls):
            if index == len(self.calls_sent):
                self.calls_sent.append([f"call_{uuid.uuid4().hex[:24]}", name, ""])
                deltas.append(CallStarted(index, self.calls_sent[index][0], name))
            call_id, sent_name, sent = self.calls_sent[index]
            # (a call that turned out malformed after its start cannot be taken back: it keeps what it sent)
            if sent_name == name and arguments.startswith(sent) and len(arguments) > len(sent):
                deltas.append(ArgumentsDelta(index, arguments[len(sent) :]))
                self.calls_sent[index][2] = arguments
        return deltas
