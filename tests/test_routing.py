"""Cache-aware routing (core/routing.py): which experts it swaps, the weights it gives them, what it
refuses, and that it is off unless asked for."""

import pytest
import torch
from tiny import TINY
from transformers import AutoConfig, AutoModelForCausalLM

import moestream
from moestream.conversion.store import Store
from moestream.conversion.synthetic import make_model, save_checkpoint
from moestream.core.routing import reroute
from moestream.core.supply.prefetch import find_router
from moestream.errors import UsageError


def test_an_uncached_choice_gives_way_only_to_a_cached_expert_within_the_margin():
    p = [0.40, 0.30, 0.25, 0.05]
    cached = {0, 2}.__contains__
    assert reroute(p, [0, 1], cached, margin=0.2) == [0, 2]  # 0.25 >= 0.8 x 0.30
    assert reroute(p, [0, 1], cached, margin=0.1) == [0, 1]  # 0.25 < 0.9 x 0.30
    assert reroute(p, [0, 1], {0, 1}.__contains__, margin=0.5) == [0, 1]  # nothing to gain: all cached
    # two uncached choices and one cached candidate: the least probable choice gives way
    p = [0.30, 0.28, 0.26, 0.16]
    assert reroute(p, [0, 1, 2], {3}.__contains__, margin=0.5) == [0, 1, 3]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("routing")
    config = dict(TINY["qwen3_moe"], norm_topk_prob=True, num_experts=16, num_experts_per_tok=4)
    model = make_model("qwen3_moe", seed=62, **config)
    return moestream.convert(save_checkpoint(model, root / "hf"), root / "store", experts_dtype="fp32", progress=False)


def _decode(path, margin, tokens=24):
    manifest = Store(path).manifest
    budget = 6 * manifest.max_record_stride  # 6 of 32 experts: misses in every step, and cached others
    model, _ = moestream.load(path, budget, prefetch="off", route_to_cached=margin)
    seen = []

    def check(router, args, output):  # registered after the routing hook, so it sees its output
        seen.append(output)

    for layer in model.model.layers:
        find_router(layer.mlp).register_forward_hook(check)
    prompt = torch.randint(0, 250, (1, 6), generator=torch.Generator().manual_seed(63))
    with torch.inference_mode():
        model.generate(prompt, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    return moestream.stats(model), seen


def test_rerouted_decode_steps_read_less_and_weigh_as_the_router_does(store):
    off, _ = _decode(store, 0.0)
    on, outputs = _decode(store, 0.5)
    assert off["rerouted"] == 0 and on["rerouted"] > 0
    assert on["misses"] < off["misses"]
    swapped = 0
    for logits, weights, indices in outputs:
        if indices.shape[0] != 1:
            continue  # the prompt is left alone
        p = torch.softmax(logits[0].float(), -1)
        top = set(torch.topk(p, indices.shape[1]).indices.tolist())
        chosen = indices[0].tolist()
        assert len(set(chosen)) == len(chosen)
        added, removed = set(chosen) - top, top - set(chosen)
        if added:
            swapped += 1
            assert min(p[e] for e in added) >= 0.5 * min(p[e] for e in removed) - 1e-7
        expected = p[indices[0]] / p[indices[0]].sum()  # Qwen3's router, normalize_topk_prob
        assert torch.allclose(weights[0].float(), expected, rtol=1e-6, atol=1e-7)
    assert swapped > 0


def test_routers_of_another_formula_and_bad_margins_are_refused(store, tmp_path):
    with pytest.raises(UsageError, match="between 0 and 1"):
        moestream.load(store, "1MiB", route_to_cached=1.5)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("deepseek_v3", **TINY["deepseek_v3"]))
    path = moestream.convert(save_checkpoint(model, tmp_path / "hf"), tmp_path / "store", experts_dtype="fp32", progress=False)
    with pytest.raises(UsageError, match="softmax top-k routers"):
        moestream.load(path, "1MiB", route_to_cached=0.2)


def test_the_cli_takes_the_margin_and_refuses_a_bad_one(store, capsys):
    from moestream.cli import main

    assert (
        main(["generate", str(store), "--memory", "1MiB", "--prompt", "ab", "--max-new-tokens", "4", "--route-to-cached", "2"])
        == 2
    )
    assert "between 0 and 1" in capsys.readouterr().err
