"""Continuous batching: several sequences decoded together, so that each layer's experts are read and
computed once per step for all of them.

A streamed model pays for expert bytes, not for tokens. One decode step of B sequences feeds the model
B tokens, one per row of a left-padded batch (`kv_cache.BatchKV`); every MoE layer then routes the B
tokens together, and the engine reads and computes each distinct expert once for all the rows that
chose it (`ExpertEngine.run` groups tokens by expert). Sequences join between steps, after a prefill
of their own (from the longest prefix the prefix cache holds), and leave when they end; their KV then
goes into the prefix cache. With `prefill_chunk`, a newcomer's prompt is fed that many tokens per step
while others are decoding, so a long prompt slows the running sequences instead of stopping them, at
the cost of its own time to first token: each part of a long prompt visits most experts again
(docs/DECISIONS.md, "A joining prompt: one pass by default"). Without it, or with nobody running, the prompt goes in one pass, as a lone
generation's does.

Each sequence is a `generate.Decoding`: its own sampler and seeded generator, stop rules, callbacks,
cancel flag and deadline, exactly as when it runs alone. What a batch changes is only the arithmetic's
rounding: a matmul over B rows may round differently from one over a single row. In float32 that has
not changed a token in any test (transformers' own greedy `generate` of each prompt alone is the
reference); in bf16 it can flip a near-tie (docs/BENCHMARKS.md, "Batched decoding: exactness": 2-3 of 16 greedy answers of the
trained fixture part from their solo ones after 7-22 tokens).

`BatchGenerator` is driven step by step by the serving scheduler (serving.py), which the server's worker
and `generate_batch` (the Python API) both step: a newcomer is `start`ed, `feed` gives its prompt's parts
and then its first tokens, `join` accepts them; `choose_next` gives the running rows' next tokens,
`accept_next` accepts them. Choosing and accepting are apart so that the scheduler can run a step before
applying it; `admit`, `prefill_step` and `decode` do both at once (the tests and the benchmarks drive it so).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Sequence

import torch

from ..errors import ExpertReadError
from .generate import Decoding, Forward, prompt_logprobs
from .kv_cache import BatchKV, PrefixCache, batchable, kv_bytes
from .kv_disk import TierFileError


class KVBudgetExceeded(Exception):
    """A sequence whose KV could never fit the running sequences' budget, even alone."""

    def __init__(self, needed: int, budget: int, positions: int):
        super().__init__(
            f"this request needs {needed / 2**20:.1f} MiB of KV cache for {positions} positions (prompt + max tokens), "
            f"more than the running sequences' KV budget of {budget / 2**20:.1f} MiB: send a shorter prompt or a smaller "
            "max_tokens, or raise --batch-kv-memory"
        )
        self.needed, self.budget = needed, budget


@dataclass
class _Prefill:
    """A newcomer whose prompt is being fed: its own cache until it joins the batch."""

    decoding: Decoding
    forward: Forward
    fed: int  # prompt tokens whose KV the forward's cache holds
    siblings: list[Decoding] = field(default_factory=list)  # more answers to the same prompt (n > 1)
    chunks: list[int] = field(default_factory=list)  # tokens fed per step (the tests check the interleaving)


@dataclass
class Part:
    """What feeding a newcomer's part gave (`BatchGenerator.feed`)."""

    interrupted: list[Decoding] = field(default_factory=list)  # it and its siblings, cancelled or timed out: dropped unfed
    first_tokens: list[int] | None = None  # its prompt is in: the first token each of them chose, to `join` with


@dataclass
class BatchStats:
    steps: int = 0  # decode steps of the batch
    rows: int = 0  # sequences summed over those steps (rows / steps: the mean batch size)


class BatchGenerator:
    """The running sequences and their batched KV; see the module's doc.

    `max_batch`: the most sequences decoded together. `kv_budget_bytes`: the most KV the running
    sequences may ever hold together, padding included; a sequence joins only if the batch, with it,
    stays within the budget until every row has ended (its prompt plus max_new_tokens, at the widest
    row's length). With more than one row or a budget it needs one forward pass of one token at
    construction, to size a position's KV and to learn whether the model's cache batches at all (if
    not, sequences run one at a time). One row without a budget (generate, bench, chat) needs neither,
    and is spared that pass: on a streamed model it would read experts that nothing asked for."""

    def __init__(
        self,
        model,
        *,
        max_batch: int = 8,
        prefix_cache: PrefixCache | None = None,
        kv_budget_bytes: int | None = None,
        prefill_chunk: int | None = None,
    ):
        if max_batch < 1 or (prefill_chunk is not None and prefill_chunk < 1):
            raise ValueError(f"max_batch and prefill_chunk must be at least 1, not {max_batch} and {prefill_chunk}")
        self.model = model
        self.prefill_chunk = prefill_chunk
        self.prefilling: _Prefill | None = None  # one newcomer at a time
        self.prefix_cache = prefix_cache
        self.kv_budget_bytes = kv_budget_bytes
        self.not_batchable = self._probed[1] if max_batch > 1 or kv_budget_bytes is not None else None
        self.max_batch = 1 if self.not_batchable else max_batch
        self.running: list[Decoding] = []
        self.kv = BatchKV()
        self.step_forward = Forward(model)  # every decode step's: its cache is the batch's
        self.stats = BatchStats()

    @cached_property
    def _probed(self) -> tuple[int, str | None]:
        return _probe(self.model)

    @property
    def position_bytes(self) -> int:
        """Bytes of KV one position takes in one row."""
        return self._probed[0]

    def kv_needed(self, positions: int) -> int:
        """Bytes of KV a sequence of `positions` positions (prompt + max new tokens) holds at its longest, alone."""
        return positions * self.position_bytes

    def check(self, positions: int) -> None:
        """Raise KVBudgetExceeded if a sequence of `positions` positions could never run within the KV budget."""
        if self.kv_budget_bytes is not None and self.kv_needed(positions) > self.kv_budget_bytes:
            raise KVBudgetExceeded(self.kv_needed(positions), self.kv_budget_bytes, positions)

    def has_room(self, positions: int, rows: int = 1) -> bool:
        """Whether `rows` sequences of `positions` positions may join now: no other newcomer being
        prefilled, free rows, and the KV budget holds with them until every row has ended (all rows padded
        to the widest)."""
        if self.prefilling is not None or len(self.running) + rows > self.max_batch:
            return False
        if self.kv_budget_bytes is None or (not self.running and rows == 1):
            return True
        widest = max([positions] + [len(d.prompt_ids) + d.params.max_tokens for d in self.running])
        return (len(self.running) + rows) * widest * self.position_bytes <= self.kv_budget_bytes

    def admit(self, decoding: Decoding, siblings: Sequence[Decoding] = ()) -> list[Decoding]:
        """`start` the decoding's prefill, and feed all of it now when no sequence is running (`prefill_step`);
        returns those that ended already (a one-token answer)."""
        self.start(decoding, siblings)
        return self.prefill_step() if not self.running else []

    def start(self, decoding: Decoding, siblings: Sequence[Decoding] = ()) -> None:
        """Make `decoding` the newcomer, its prefill to start from the longest prefix the prefix cache holds.
        Once its prompt is in (`feed`), it chooses its first token and joins the batch (`join`); so do
        `siblings`, more answers to the same prompt (OpenAI's n), from the same prefill: each chooses its own
        first token from the prompt's logits and gets a copy of its KV. A decoding that asks for its prompt's
        log-probabilities has all of its prompt but the last token fed now, every position's logits kept
        (generate.prompt_logprobs), and no prefix reused."""
        start = None
        if decoding.params.prompt_logprobs is not None:
            entries, start = prompt_logprobs(self.model, decoding.prompt_ids, decoding.params.prompt_logprobs)
            for d in (decoding, *siblings):
                d.prompt_token_logprobs = entries
        if self.not_batchable and siblings:
            raise ValueError("this model's KV cache does not batch: one answer per prompt")
        if start is not None:
            cache, reused = start
        else:
            cache, reused = self.prefix_cache.match(decoding.prompt_ids) if self.prefix_cache is not None else (None, 0)
            for d in (decoding, *siblings):
                d.cached_tokens = reused
        self.prefilling = _Prefill(decoding, Forward(self.model, cache), reused, list(siblings))

    def prefill_step(self) -> list[Decoding]:
        """`feed` the newcomer's next part (`prefill_chunk` tokens while others run, else the rest), and
        `join` it once its prompt is in; returns those of it that ended."""
        if self.prefilling is None:
            return []
        part = self.feed(None if not self.running else self.prefill_chunk)
        return part.interrupted if part.first_tokens is None else self.join(part.first_tokens)

    def feed(self, tokens: int | None) -> Part:
        """Feed the next `tokens` of the newcomer's prompt (None: the rest) and, once it is all in, choose
        the newcomer's and its siblings' first tokens (not yet accepted: `join` does). A newcomer cancelled or
        past its deadline is dropped unfed. Raises what the forward pass raised, having dropped the
        newcomer; the batch is unchanged."""
        p = self.prefilling
        decoding, prompt = p.decoding, p.decoding.prompt_ids
        if decoding.interrupted():  # (siblings share the cancel flag and the deadline)
            self.prefilling = None
            for sibling in p.siblings:
                sibling.interrupted()
            return Part(interrupted=[decoding, *p.siblings])
        end = len(prompt) if tokens is None else min(len(prompt), p.fed + tokens)
        try:
            with torch.inference_mode():
                logits = p.forward(torch.tensor([prompt[p.fed : end]], dtype=torch.long))
        except TierFileError:
            # Its prefix came from the disk tier, whose file proved damaged as it arrived (the tier has
            # dropped it): the whole prompt is computed instead.
            p.forward, p.fed = Forward(self.model), 0
            for d in (decoding, *p.siblings):
                d.cached_tokens = 0
            return self.feed(tokens)
        except BaseException:
            self.prefilling = None
            raise
        p.chunks.append(end - p.fed)
        p.fed = end
        if end < len(prompt):
            return Part()
        last = logits[:, -1, :].to("cpu", torch.float32)
        with torch.inference_mode():  # (as every choice: tensors a decoding keeps stay usable in place)
            # a copy each: every sampler changes its logits in place
            return Part(first_tokens=[int(d.choose(last.clone())[0]) for d in (decoding, *p.siblings)])

    def join(self, first_tokens: list[int]) -> list[Decoding]:
        """The newcomer, its prompt fed, accepts its first tokens (`feed`'s) and joins the batch, with its
        siblings; returns those that ended there (their KV goes to the prefix cache)."""
        p, self.prefilling = self.prefilling, None
        ended = []
        for d, token in zip((p.decoding, *p.siblings), first_tokens):
            if d.accept(token):
                self._keep_prefix(d, p.forward.cache)
                ended.append(d)
            else:
                self.kv.add(p.forward.cache, len(p.decoding.prompt_ids))
                self.running.append(d)
        return ended

    def decode(self) -> list[Decoding]:
        """One step of every running sequence (`choose_next` then `accept_next`); returns those that ended."""
        return self.accept_next(self.choose_next()) if self.running else []

    def choose_next(self) -> list[int]:
        """Every running sequence's next token, chosen (not yet accepted: `accept_next` does). On an error
        every running sequence fails (the batch's KV is then incomplete): they are dropped, and the error
        is raised."""
        forward = self.step_forward
        forward.cache = self.kv.cache
        ids = torch.tensor([[d.new[-1]] for d in self.running], dtype=torch.long)
        try:
            with torch.inference_mode():
                logits = forward(ids, **self.kv.step_inputs())[:, -1, :].to("cpu", torch.float32)
                # Each row's logits are its own decoding's to change in place: no copy.
                tokens = [int(decoding.choose(logits[i : i + 1])[0]) for i, decoding in enumerate(self.running)]
        except BaseException:
            self.running, self.kv = [], BatchKV()
            raise
        self.kv.cache, forward.cache = forward.cache, None  # (held by the batch only: it goes when the rows do)
        self.kv.advance()
        return tokens

    def accept_next(self, tokens: list[int]) -> list[Decoding]:
        """Each running sequence accepts its token (`choose_next`'s); those that ended leave the batch (their
        KV goes to the prefix cache) and are returned."""
        self.stats.steps += 1
        self.stats.rows += len(self.running)
        ended, keep = [], []
        for i, (decoding, token) in enumerate(zip(self.running, tokens)):
            if decoding.accept(token):
                ended.append(decoding)
                self._keep_prefix(decoding, self.kv.row(i) if self.prefix_cache is not None else None)
            else:
                keep.append(i)
        if ended:
            self.running = [self.running[i] for i in keep]
            self.kv.keep(keep)
        return ended

    def drop(self, decoding: Decoding) -> None:
        """Stop a running (or prefilling) sequence now (its KV is not kept)."""
        if self.prefilling is not None and self.prefilling.decoding is decoding:
            self.prefilling = None
            return
        i = self.running.index(decoding)
        del self.running[i]
        self.kv.keep([j for j in range(len(self.kv)) if j != i])

    def kv_bytes(self) -> int:
        """Bytes of KV the running sequences (and a newcomer's prefill) hold now."""
        cache = self.prefilling.forward.cache if self.prefilling is not None else None
        return self.kv.nbytes() + (kv_bytes(cache) if cache is not None else 0)

    def _keep_prefix(self, decoding: Decoding, cache) -> None:
        # The cache holds the prompt and every new token but the last (chosen, never fed).
        if self.prefix_cache is not None and cache is not None:
            self.prefix_cache.put(decoding.prompt_ids + decoding.new[:-1], cache)


# A failed expert read in the probe is tried again this many times: the probe is no request's, and a disk
# that fails now and then must not keep a server from starting.
PROBE_ATTEMPTS = 5


def _probe(model) -> tuple[int, str | None]:
    """(bytes of KV one position takes in one row, None or why the cache does not batch), from a forward
    pass of one token."""
    for attempt in range(PROBE_ATTEMPTS):
        forward = Forward(model)
        try:
            with torch.inference_mode():
                forward(torch.zeros((1, 1), dtype=torch.long))
            break
        except ExpertReadError:
            if attempt == PROBE_ATTEMPTS - 1:
                raise
    return kv_bytes(forward.cache), batchable(forward.cache)
