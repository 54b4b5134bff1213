"""Batched decoding and prefix reuse: sequences decoded together give transformers' own tokens for each
alone; a prefix's KV reused gives the tokens of a fresh prefill; the KV budgets hold; the scheduler's
three parts (schedule, run, update) each do their part alone."""

import pytest
import torch
from tiny import tiny_checkpoint

import moestream
from moestream.cli import main
from moestream.generation.batching import BatchGenerator, KVBudgetExceeded
from moestream.generation.generate import Decoding, Forward, SamplingParams
from moestream.generation.kv_cache import BatchKV, PrefixCache, kv_bytes
from moestream.generation.serving import (
    Failed,
    Finished,
    Request,
    Scheduler,
    Started,
    StepOutput,
    StepPlan,
    generate_batch,
    run_until_idle,
    stream,
)

NEW = 10
BATCH_FAMILIES = ["qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3", "olmoe"]


def _store(tmp_path_factory, family: str):
    root = tmp_path_factory.mktemp(family)
    hf_model, ckpt = tiny_checkpoint(family, root / "hf", seed=2)
    assert main(["convert", str(ckpt), str(root / "store"), "--experts-dtype", "fp32"]) == 0
    return hf_model.eval(), root / "store"


def _prompts(seed: int, lengths=(5, 11, 3, 17, 8, 2)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 250, (n,), generator=g).tolist() for n in lengths]


def _transformers_greedy(hf_model, prompt: list[int], n: int) -> list[int]:
    """transformers' own greedy generate on the same weights, alone, end-of-sequence suppressed."""
    out = hf_model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n, min_new_tokens=n)
    return out[0, len(prompt) :].tolist()


def _run(model, prompts, max_batch: int, **options):
    """Drive a BatchGenerator as the server does (join when there is room, one decode step at a time);
    returns the results in prompt order, the generator, and the most KV the batch held after a step."""
    batch = BatchGenerator(model, max_batch=max_batch, kv_budget_bytes=options.pop("kv_budget_bytes", None))
    seeds = options.pop("seeds", [None] * len(prompts))
    if options.pop("greedy", False):
        options["temperature"] = 0.0
    waiting = [Decoding(model, None, p, SamplingParams(NEW, ignore_eos=True, seed=s, **options)) for p, s in zip(prompts, seeds)]
    order, peak = list(waiting), 0
    while waiting or batch.running or batch.prefilling:
        while waiting and batch.has_room(len(waiting[0].prompt_ids) + NEW):
            batch.admit(waiting.pop(0))
        batch.prefill_step()
        batch.decode()
        peak = max(peak, batch.kv_bytes())
    return [d.result().token_ids for d in order], batch, peak


@pytest.mark.parametrize("family", BATCH_FAMILIES)
def test_batched_sequences_give_transformers_tokens_for_each_alone(family, tmp_path_factory):
    hf_model, store = _store(tmp_path_factory, family)
    model, _ = moestream.load(store, memory=16 * 2**10)  # below half the experts: misses in every step
    try:
        prompts = _prompts(seed=len(family))
        expected = [_transformers_greedy(hf_model, p, NEW) for p in prompts]
        got, batch, _ = _run(model, prompts, max_batch=3, greedy=True)  # rows join and leave mid-way
        assert got == expected
        assert batch.stats.rows / batch.stats.steps > 2  # decoded together, not one by one
        # A seeded sampled sequence gets the tokens it gets alone, whatever runs beside it.
        alone = [
            stream(model, None, p, SamplingParams(NEW, temperature=0.9, seed=i, ignore_eos=True)).token_ids
            for i, p in enumerate(prompts)
        ]
        sampled = generate_batch(
            model, None, prompts, SamplingParams(NEW, temperature=0.9, ignore_eos=True), max_batch=4, seeds=range(6)
        )
        assert [r.token_ids for r in sampled] == alone
        assert len({tuple(t) for t in alone}) == len(alone)
    finally:
        moestream.close(model)


def _loaded(family: str):
    """A module fixture: (transformers' model, the same weights loaded through moestream below half the experts)."""

    @pytest.fixture(scope="module")
    def fixture(tmp_path_factory):
        hf_model, store = _store(tmp_path_factory, family)
        model, _ = moestream.load(store, memory=16 * 2**10)
        yield hf_model, model
        moestream.close(model)

    return fixture


qwen = _loaded("qwen3_moe")
gpt_oss = _loaded("gpt_oss")


@pytest.mark.parametrize("name", ["qwen", "gpt_oss"])
def test_a_reused_prefix_gives_the_tokens_of_a_fresh_prefill(name, request):
    hf_model, model = request.getfixturevalue(name)
    cache = PrefixCache(2**30)
    prompt = _prompts(seed=9, lengths=(14,))[0]
    first = stream(model, None, prompt, SamplingParams.timed(6), prefix_cache=cache)
    kept = prompt + first.token_ids[:-1]  # the last token was chosen, never fed
    assert cache.stats().entries == 1 and cache.stats().bytes > 0
    # A follow-up that starts with the whole kept sequence (a chat turn), and one that shares only part of
    # it (a repeated system prompt): reuse where the KV can be cut, the same tokens either way.
    for follow_up in (kept + [7, 8, 9], prompt[:9] + [5, 6]):
        fresh = _transformers_greedy(hf_model, follow_up, 8)
        before = cache.stats().tokens_reused
        reused = stream(model, None, follow_up, SamplingParams.timed(8), prefix_cache=cache).token_ids
        assert reused == fresh
        gained = cache.stats().tokens_reused - before
        if follow_up[: len(kept)] == kept:
            assert gained == len(kept)  # only the three new tokens were prefilled
        elif name == "qwen":
            assert gained == 9
        else:
            assert gained == 0  # gpt-oss's sliding layers (window 4) no longer hold what a cut back needs


def test_the_prefix_cache_keeps_its_budget_least_recently_used_out(qwen):
    _, model = qwen
    prompts = _prompts(seed=3, lengths=(20, 20, 20))
    sizes = []
    cache = PrefixCache(2**30)
    for p in prompts:
        stream(model, None, p, SamplingParams.timed(2), prefix_cache=cache)
        sizes.append(cache.stats().bytes - sum(sizes))
    small = PrefixCache(sizes[0] + sizes[1] + sizes[2] // 2)
    for p in prompts[:2]:
        stream(model, None, p, SamplingParams.timed(2), prefix_cache=small)
    assert small.match(prompts[0] + [1])[1] == 20  # used: now the most recent
    stream(model, None, prompts[2], SamplingParams.timed(2), prefix_cache=small)
    assert small.stats().bytes <= small.budget_bytes and small.stats().entries == 2
    assert small.match(prompts[1] + [1])[1] == 0  # the least recently used went
    assert small.match(prompts[0] + [1])[1] == small.match(prompts[2] + [1])[1] == 20


def test_the_running_kv_budget_holds_and_a_sequence_that_cannot_fit_is_refused(qwen):
    hf_model, model = qwen
    prompts = _prompts(seed=4, lengths=(12, 30, 6, 25, 9))
    position = BatchGenerator(model).position_bytes
    budget = 2 * (30 + NEW) * position  # two rows at the widest
    got, batch, peak = _run(model, prompts, max_batch=5, greedy=True, kv_budget_bytes=budget)
    assert got == [_transformers_greedy(hf_model, p, NEW) for p in prompts]
    assert 0 < peak <= budget
    assert 1 < batch.stats.rows / batch.stats.steps <= 2
    with pytest.raises(KVBudgetExceeded, match="--batch-kv-memory"):
        batch.check(budget // position + 1)
    batch.check(budget // position)


def test_one_row_runs_as_a_lone_sequence(qwen):
    """A batch of one passes no mask and no position ids, so --max-batch 1 computes what `stream` does."""
    _, model = qwen
    prompt = _prompts(seed=5, lengths=(7,))[0]
    solo = stream(model, None, prompt, SamplingParams.timed(NEW)).token_ids
    got, batch, _ = _run(model, [prompt], max_batch=1, greedy=True)
    assert got == [solo] and batch.stats.rows == batch.stats.steps == NEW - 1
    one = Decoding(model, None, prompt, SamplingParams(3))
    batch.admit(one)
    assert batch.kv.step_inputs() == {}
    assert kv_bytes(batch.kv.cache) == len(prompt) * batch.position_bytes


def test_a_cache_that_does_not_batch_runs_one_sequence_at_a_time(tmp_path_factory):
    hf_model, store = _store(tmp_path_factory, "deepseek_v4")  # compressed-attention cache layers
    model, _ = moestream.load(store, memory=16 * 2**10)
    try:
        prompts = _prompts(seed=6, lengths=(6, 4, 9))
        got, batch, _ = _run(model, prompts, max_batch=4, greedy=True)
        assert batch.not_batchable and batch.max_batch == 1 and batch.stats.rows == batch.stats.steps
        assert got == [stream(model, None, p, SamplingParams.timed(NEW)).token_ids for p in prompts]
    finally:
        moestream.close(model)


def test_a_long_prompt_is_fed_in_parts_while_the_others_keep_decoding(qwen):
    hf_model, model = qwen
    short, long = _prompts(seed=7, lengths=(3, 17))
    batch = BatchGenerator(model, max_batch=2, prefill_chunk=4)
    first = Decoding(model, None, short, SamplingParams.timed(NEW))
    second = Decoding(model, None, long, SamplingParams.timed(NEW))
    batch.admit(first)  # nobody running: the whole prompt in one pass
    batch.decode()
    assert batch.has_room(len(long) + NEW)
    batch.admit(second)
    newcomer = batch.prefilling
    assert newcomer is not None and not batch.has_room(5)  # one newcomer at a time
    tokens_before = len(first.new)
    while batch.prefilling is not None:
        batch.prefill_step()
        batch.decode()
    assert newcomer.chunks == [4, 4, 4, 4, 1]  # 17 prompt tokens, 4 per step
    assert len(first.new) - tokens_before == 5  # one token of the running sequence per part
    while batch.running:
        batch.decode()
    assert first.result().token_ids == _transformers_greedy(hf_model, short, NEW)
    assert second.result().token_ids == _transformers_greedy(hf_model, long, NEW)


def test_a_cancelled_newcomer_leaves_during_its_prefill(qwen):
    import threading

    _, model = qwen
    short, long = _prompts(seed=8, lengths=(3, 17))
    batch = BatchGenerator(model, max_batch=2, prefill_chunk=4)
    cancel = threading.Event()
    batch.admit(Decoding(model, None, short, SamplingParams.timed(NEW)))
    leaving = Decoding(model, None, long, SamplingParams.timed(NEW), cancel=cancel)
    batch.admit(leaving)
    assert batch.prefill_step() == []
    cancel.set()
    assert batch.prefill_step() == [leaving] and batch.prefilling is None
    assert leaving.result().finish_reason == "cancelled" and leaving.result().token_ids == []
    assert len(batch.running) == 1


# -- the scheduler's three parts, each alone -------------------------------------------------------------------


def _request(model, prompt, **callbacks) -> Request:
    return Request.of(Decoding(model, None, prompt, SamplingParams.timed(NEW), **callbacks))


def test_schedule_plans_a_step_from_the_queue_and_the_batch_without_the_model(qwen, monkeypatch):
    _, model = qwen
    short, long, third = _prompts(seed=11, lengths=(3, 17, 5))
    scheduler = Scheduler(model, max_batch=3, prefill_chunk=4)
    first, second, last = (_request(model, p) for p in (short, long, third))
    for request in (first, second, last):
        scheduler.add(request)

    def no_model(*args, **kwargs):
        raise AssertionError("schedule called the model")

    plan = _planned(scheduler, monkeypatch, no_model)
    # nobody running: the first request joins with its whole prompt, nothing decodes
    assert plan.join == (first, [0]) and plan.prefill and plan.prefill_tokens is None and plan.decode == []
    scheduler.update(plan, scheduler.run(plan))
    (row,) = scheduler.batch.running
    plan = _planned(scheduler, monkeypatch, no_model)
    # one running: the next joins, fed 4 tokens a step beside the running row's step
    assert plan.join == (second, [0]) and plan.prefill_tokens == 4 and plan.decode == [row]
    scheduler.update(plan, scheduler.run(plan))
    plan = _planned(scheduler, monkeypatch, no_model)
    # a newcomer being fed: no other joins until it is in
    assert plan.join is None and plan.prefill and plan.decode == [row]
    assert scheduler.queued() == 1
    last.cancel.set()  # a request cancelled before its turn leaves the queue unrun
    while scheduler.batch.prefilling is not None:
        scheduler.update(plan, scheduler.run(plan))
        plan = _planned(scheduler, monkeypatch, no_model)
    assert plan.join is None and scheduler.queued() == 0 and len(plan.decode) == 2


def _planned(scheduler: Scheduler, monkeypatch, forbidden) -> StepPlan:
    with monkeypatch.context() as m:
        m.setattr(Forward, "__call__", forbidden)
        return scheduler.schedule()


def test_run_chooses_tokens_and_update_accepts_them(qwen):
    """`run` computes a step's tokens and accepts none (no text, no KV row joined); `update` accepts them,
    sends the events, and gives transformers' own greedy tokens."""
    hf_model, model = qwen
    prompt = _prompts(seed=12, lengths=(9,))[0]
    accepted, heard = [], []
    scheduler = Scheduler(model, max_batch=2, listener=heard.append)
    request = _request(model, prompt, on_first_token=lambda: accepted.append(True))
    decoding = request.make(0)
    scheduler.add(request)
    expected = _transformers_greedy(hf_model, prompt, NEW)
    plan = scheduler.schedule()
    out = scheduler.run(plan)
    assert out.part.first_tokens == expected[:1]
    assert decoding.new == accepted == [] and scheduler.batch.running == []  # chosen, not accepted
    assert [type(e) for e in heard] == [Started]  # sent as its prefill began
    assert scheduler.update(plan, out) == heard and decoding.new == expected[:1] and accepted == [True]
    plan = scheduler.schedule()
    out = scheduler.run(plan)
    assert out.tokens == expected[1:2] and decoding.new == expected[:1]
    scheduler.update(plan, out)
    assert decoding.new == expected[:2]
    run_until_idle(scheduler)
    assert decoding.result().token_ids == expected and isinstance(heard[-1], Finished)


def test_update_applies_what_it_is_given(qwen):
    """`update` alone: tokens handed to it are accepted as they are (the runner's choice is not redone),
    and a decode error fails the running rows' requests and no other."""
    _, model = qwen
    a, b = _prompts(seed=13, lengths=(4, 6))
    scheduler = Scheduler(model, max_batch=2)
    first, second = _request(model, a), _request(model, b)
    scheduler.add(first)
    scheduler.add(second)
    plan = scheduler.schedule()
    scheduler.update(plan, scheduler.run(plan))  # the first joins
    plan = scheduler.schedule()  # the second joins; the first decodes
    out = scheduler.run(plan)
    out.tokens = [7]  # any token the runner might have given
    scheduler.update(plan, out)
    (row, newcomer) = scheduler.batch.running
    assert row.new[-1] == 7 and len(newcomer.new) == 1
    plan = scheduler.schedule()
    assert plan.decode == [row, newcomer]
    error = RuntimeError("a disk error")
    scheduler.batch.running, scheduler.batch.kv = [], BatchKV()  # as `choose_next` leaves them on an error
    events = scheduler.update(plan, StepOutput(decode_error=error))
    assert [(type(e), e.request) for e in events] == [(Failed, first), (Failed, second)]
    assert all(e.error is error for e in events) and scheduler.idle()
