"""Structured outputs: a grammar that the sampled tokens must follow (a JSON schema, any JSON object, or a
Lark grammar such as a tool call's), applied in the one sampler (`generate.Decoding.choose`), so it holds
alone, batched and streamed.

The grammar engine is llguidance (the library behind Guidance and llama.cpp's llguidance option): it
computes, for each step, the set of tokens that keep the text a prefix of some string of the grammar,
from the tokenizer's own byte strings. Measured against xgrammar and outlines-core on a 150k-token
byte-level BPE vocabulary (docs/DECISIONS.md, "Structured outputs through llguidance"), it was the fastest per token among
those that compile a schema in milliseconds (outlines-core builds an index over the whole vocabulary per
schema: seconds), and its Lark dialect embeds JSON schemas, which tool calls need.

A `Grammar` is the compiled-once text; a `Constraint` is one sequence's state in it: `mask(logits)` sets
every token the grammar forbids to -inf, `advance(token)` moves past the sampled token, `stopped` says
the grammar is complete and nothing may follow (the sequence ends). The model's end-of-sequence tokens
are allowed exactly where the grammar may end.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import llguidance
import llguidance.hf
import numpy as np
import torch

# JSON as json.dumps (and chat templates' `tojson`) write it (", " and ": ", no other whitespace): a model
# cannot pad its answer with whitespace for ever, which flexible whitespace would let a weak or random model
# do. Structured outputs and forced tool calls' arguments both use it.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A grammar (or JSON schema) that cannot be compiled; the message says why."""


@dataclass(frozen=True)
class Grammar:
    """A grammar in llguidance's serialized form, and what it came from (for messages)."""

    text: str
    source: str

    @staticmethod
    def json_schema(schema: dict | bool) -> Grammar:
        """JSON text that validates against `schema` (a JSON Schema document)."""
        if not isinstance(schema, (dict, bool)):
            raise GrammarError(f"a JSON schema is an object or a boolean, not {type(schema).__name__}")
        try:
            text = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        except ValueError as e:
            raise GrammarError(f"the JSON schema cannot be used: {e}") from None
        return Grammar(text, "json_schema")

    @staticmethod
    def json_object() -> Grammar:
        """Any JSON object (OpenAI's response_format {"type": "json_object"})."""
        return Grammar.json_schema({"type": "object"})

    @staticmethod
    def lark(text: str) -> Grammar:
        """A grammar in llguidance's Lark dialect (which may embed JSON schemas with %json)."""
        return Grammar(llguidance.LLMatcher.grammar_from_lark(text), "lark")


class Vocabulary:
    """llguidance's view of a tokenizer: each token's bytes, the model's vocabulary width and its
    end-of-sequence ids. Building it reads the whole vocabulary (about 2.5 s for 150k tokens), so one is
    made per (tokenizer, width, eos ids) and kept (`of`)."""

    _made: dict[tuple, Vocabulary] = {}
    _lock = threading.Lock()

    def __init__(self, tokenizer, width: int, eos: tuple[int, ...]):
        self.width = width
        self.words = llguidance.hf.from_tokenizer(tokenizer, n_vocab=max(width, len(tokenizer)), eos_token=list(eos) or None)
        self.size = self.words.vocab_size  # bits in a mask: at least the model's width

    @classmethod
    def of(cls, tokenizer, width: int, eos: set[int] | tuple[int, ...]) -> Vocabulary:
        key = (id(tokenizer), width, tuple(sorted(eos)))
        with cls._lock:
            if key not in cls._made:
                cls._made[key] = cls(tokenizer, width, key[2])
            return cls._made[key]

    def check(self, grammar: Grammar) -> None:
        """Raise GrammarError if `grammar` does not compile against this vocabulary."""
        error = llguidance.LLMatcher.validate_grammar(grammar.text, self.words)
        if error:
            raise GrammarError(f"the {grammar.source} cannot be compiled: {error}")


class Constraint:
    """One sequence's position in a grammar; see the module's doc."""

    def __init__(self, grammar: Grammar, vocabulary: Vocabulary):
        self.vocabulary = vocabulary
        self.matcher = llguidance.LLMatcher(vocabulary.words, grammar.text, log_level=0)
        if self.matcher.is_error():
            raise GrammarError(f"the {grammar.source} cannot be compiled: {self.matcher.get_error()}")

    @property
    def stopped(self) -> bool:
        """The grammar is complete and allows nothing more (or it failed): the sequence must end."""
        return self.matcher.is_stopped() or self.matcher.is_error()

    def allowed(self) -> torch.Tensor:
        """bool [width]: the tokens the grammar allows next."""
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        return torch.from_numpy(np.unpackbits(bits, bitorder="little")[: self.vocabulary.width].astype(bool))

    def mask(self, logits: torch.Tensor) -> None:
        """Set the logits [rows, vocab] of every token the grammar forbids next to -inf, in place. A
        model whose logits are wider than its tokenizer never gets the extra ids."""
        allowed = self.allowed()
        width = min(logits.shape[-1], allowed.shape[0])
        logits[..., width:] = float("-inf")
        logits[..., :width].masked_fill_(~allowed[:width], float("-inf"))

    def advance(self, token: int) -> None:
        """Move past the sampled token (one the mask allowed)."""
        self.matcher.consume_token(token)
