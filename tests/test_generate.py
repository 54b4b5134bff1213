"""The generation core (generate.py) on a plain transformers model: the tokens transformers' generate
would give, exactly N tokens on request, the first-token callback, one timing definition, teacher forcing."""

import pytest
import torch
from tiny import tiny_model

from moestream.generation.generate import SamplingParams, Timing, decode_rate
from moestream.generation.serving import stream, teacher_forced, timed

PROMPT = [5, 17, 99, 3, 42, 7]


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3_moe", seed=4).eval()  # a transformers model, not loaded through moestream


def _transformers(model, new_tokens, **sampling):
    ids = torch.tensor([PROMPT])
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=0,
            **sampling,
        )
    return out[0, len(PROMPT) :].tolist()


def test_stream_gives_the_tokens_of_transformers_generate(model):
    assert timed(model, PROMPT, 12).token_ids == _transformers(model, 12, do_sample=False)
    sampled = stream(model, None, PROMPT, SamplingParams(12, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True)).token_ids
    torch.manual_seed(3)
    assert sampled == _transformers(model, 12, do_sample=True, temperature=0.8, top_p=0.9, top_k=0)


def test_ignore_eos_gives_exactly_n_tokens(model):
    first = timed(model, PROMPT, 1).token_ids[0]
    model.generation_config.eos_token_id = first  # the greedy first token is now end of sequence
    try:
        ended = stream(model, None, PROMPT, SamplingParams.greedy(8))
        assert ended.token_ids == [first] and ended.finish_reason == "stop"
        exact = stream(model, None, PROMPT, SamplingParams.timed(8))
        assert len(exact.token_ids) == 8 and first not in exact.token_ids and exact.finish_reason == "length"
    finally:
        model.generation_config.eos_token_id = None


def test_first_token_callback_runs_once_before_decoding(model):
    passes, seen = [], []
    hook = model.get_input_embeddings().register_forward_pre_hook(lambda module, args: passes.append(args[0].shape[1]))
    try:
        result = stream(model, None, PROMPT, SamplingParams.timed(5), on_first_token=lambda: seen.append(len(passes)))
    finally:
        hook.remove()
    assert seen == [1]  # called once, after the prefill pass and before the first decode pass
    assert passes == [len(PROMPT), 1, 1, 1, 1] and len(result.token_ids) == 5
    timing = result.timing
    assert timing.start <= timing.first <= timing.last and timing.new_tokens == 5
    assert result.time_to_first_token == timing.first - timing.start
    assert result.decode_tokens_per_second == pytest.approx(4 / (timing.last - timing.first))


def test_one_definition_of_ttft_and_decode_rate():
    t = Timing(start=10.0, first=12.0, last=14.0, new_tokens=5)
    assert t.time_to_first_token == 2.0  # prefill + one sampling
    assert t.decode_tokens_per_second == 2.0  # 4 tokens after the first, in 2 s: the prefill does not count
    assert t.seconds == 4.0
    assert Timing(0.0, 1.0, 1.0, 1).decode_tokens_per_second == 0.0  # one token: no decode rate
    assert decode_rate(0, 0.0) == 0.0


def test_teacher_forced_feeds_prefill_then_one_token_per_pass(model):
    calls = []
    hook = model.get_input_embeddings().register_forward_pre_hook(lambda module, args: calls.append(args[0].shape[1]))
    try:
        assert teacher_forced(model, PROMPT, prefill=3) == 4
    finally:
        hook.remove()
    assert calls == [3, 1, 1, 1]


@pytest.mark.parametrize("length", [16, 17, 45])
def test_a_long_prompt_goes_in_pieces_with_the_logits_of_one_pass(model, monkeypatch, length):
    """Past PREFILL_PIECE tokens a prompt is fed in pieces (each attending to the cache of the ones before):
    the last position's logits of one pass within float32 rounding, the same greedy tokens after it, and no
    forward pass longer than a piece."""
    from moestream.generation import generate

    prompt = torch.randint(3, 250, (1, length), generator=torch.Generator().manual_seed(length))
    with torch.inference_mode():
        whole = model(prompt).logits[:, -1]
        expected = model.generate(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)[0, length:]
    monkeypatch.setattr(generate, "PREFILL_PIECE", 8)
    fed = []
    hook = model.register_forward_pre_hook(
        lambda module, args, kwargs: fed.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    try:
        with torch.inference_mode():
            pieces = generate.Forward(model)(prompt)[:, -1]
    finally:
        hook.remove()
    assert fed == [8] * ((length - 1) // 8) + [length - (length - 1) // 8 * 8] and max(fed) <= 8
    assert torch.allclose(pieces, whole, atol=1e-5, rtol=0)
    assert timed(model, prompt[0].tolist(), 8).token_ids == expected.tolist()


def test_forced_tokens_are_fed_as_given_whatever_the_model_says(model):
    torch.manual_seed(11)
    forced = torch.randint(0, model.config.vocab_size, (7,)).tolist()  # not what the model would choose
    result = stream(model, None, PROMPT, SamplingParams(6, forced=forced, ignore_eos=True, logprobs=0))
    assert result.token_ids == forced[:6]
    # Each chosen token's log-probability is the model's after exactly the tokens before it: the ones fed
    # were the forced ones (the full sequence in one forward pass as the reference).
    with torch.inference_mode():
        logits = model(torch.tensor([PROMPT + forced[:5]])).logits[0].float()
    expected = torch.log_softmax(logits[len(PROMPT) - 1 :], dim=-1)
    got = [entry.logprob for entry in result.logprobs]
    assert got == pytest.approx([float(expected[i, t]) for i, t in enumerate(forced[:6])], abs=1e-4)
    with pytest.raises(ValueError, match="forced tokens"):
        stream(model, None, PROMPT, SamplingParams(6, forced=forced[:3]))
