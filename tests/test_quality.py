"""moestream eval: a store's next-token distributions against a reference, checked against a hand computation."""

import json
import math
import random
import string

import numpy as np
import pytest
import torch
from tiny import TINY, tiny_checkpoint, tiny_model
from transformers import AutoModelForCausalLM

import moestream
from moestream.cli import main
from moestream.conversion.synthetic import make_model, save_checkpoint
from moestream.errors import UsageError
from moestream.tools.quality import compare, compare_models, token_windows

FAMILY = "qwen3_moe"


def _random_text(n: int, seed: int) -> str:
    # The byte-level tokenizer makes one token per ASCII character, so n characters are n tokens.
    rng = random.Random(seed)
    return "".join(rng.choice(string.ascii_letters + string.digits + " \n(){}=:.,") for _ in range(n))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("quality")
    _, ckpt = tiny_checkpoint(FAMILY, root / "hf", seed=5)
    store = moestream.convert(ckpt, root / "store", experts_dtype="fp32", progress=False)

    # An independent reference: the same model with every weight perturbed, as a low-bit format would.
    other = tiny_model(FAMILY, seed=5)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.5 * p.std().clamp(min=1e-3))
    other_ckpt = save_checkpoint(other, root / "hf-other")
    other_store = moestream.convert(other_ckpt, root / "store-other", experts_dtype="fp32", progress=False)
    return {"root": root, "ckpt": ckpt, "store": store, "other_ckpt": other_ckpt, "other_store": other_store}


def _hand_metrics(store_model, reference_model, ids: torch.Tensor, context: int) -> dict:
    """The definitions, written out plainly in float64 over all positions at once."""
    nll_s, nll_r, kls, agree = [], [], [], []
    with torch.no_grad():
        for start in range(0, len(ids), context):
            window = ids[start : start + context]
            if len(window) < 2:
                continue
            r = reference_model(window[None]).logits[0, :-1].double().log_softmax(-1)
            s = store_model(window[None]).logits[0, :-1].double().log_softmax(-1)
            t = window[1:]
            nll_r.append(-r[torch.arange(len(t)), t])
            nll_s.append(-s[torch.arange(len(t)), t])
            kls.append((r.exp() * (r - s)).sum(-1))
            agree.append(r.argmax(-1) == s.argmax(-1))
    kl = torch.cat(kls).numpy()
    ppl_s, ppl_r = math.exp(torch.cat(nll_s).mean().item()), math.exp(torch.cat(nll_r).mean().item())
    return {
        "tokens": kl.size,
        "store_perplexity": ppl_s,
        "reference_perplexity": ppl_r,
        "perplexity_change_percent": (ppl_s / ppl_r - 1) * 100,
        "kl_mean": kl.mean(),
        "kl_p99": np.percentile(kl, 99),
        "top1_agreement": torch.cat(agree).double().mean().item(),
    }


def test_store_against_its_own_checkpoint_is_identical(models):
    report = compare(models["store"], models["ckpt"], _random_text(200, seed=1), max_tokens=150, context=64)
    assert report.reference_kind == "checkpoint" and report.experts_dtype == "float32"
    assert report.tokens == 63 + 63 + 21 and report.windows == 3
    assert report.kl_mean < 1e-6 and report.kl_p99 < 1e-6
    assert report.top1_agreement == 1.0
    assert abs(report.store_perplexity / report.reference_perplexity - 1) < 1e-4
    assert abs(report.perplexity_change_percent) < 1e-2


@pytest.mark.parametrize("reference", ["other_ckpt", "other_store"])
def test_metrics_match_a_hand_computation(models, reference):
    text = _random_text(300, seed=2)
    # 129 tokens in windows of 32: four full windows and a one-token tail that predicts nothing.
    report = compare(models["store"], models[reference], text, max_tokens=129, context=32, memory="64KiB")
    assert report.reference_kind == ("store" if reference == "other_store" else "checkpoint")
    assert report.windows == 4 and report.tokens == 4 * 31

    store_model, tokenizer = moestream.load(models["store"], "64KiB")
    reference_model = AutoModelForCausalLM.from_pretrained(models["other_ckpt"]).eval()
    ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"][:129])
    want = _hand_metrics(store_model, reference_model, ids, 32)

    got = report.to_json()
    assert got["tokens"] == want["tokens"]
    for name in ("store_perplexity", "reference_perplexity", "kl_mean", "kl_p99", "top1_agreement"):
        assert got[name] == pytest.approx(want[name], rel=1e-6), name
    assert got["perplexity_change_percent"] == pytest.approx(want["perplexity_change_percent"], rel=1e-5, abs=1e-8)
    # The models really differ, so the check above is not 0 == 0.
    assert report.kl_mean > 1e-4 and report.kl_p99 > report.kl_mean and report.top1_agreement < 1.0
    assert report.store_cache["bytes_read"] > 0


def test_compare_models_sees_only_the_windows():
    model = tiny_model(FAMILY, seed=0)
    ids = torch.arange(10) % 200
    assert [len(w) for w in token_windows(ids, 4)] == [4, 4, 2]
    assert [len(w) for w in token_windows(ids[:9], 4)] == [4, 4]  # the 1-token tail is dropped
    metrics = compare_models(model, model, ids, context=4)
    assert metrics["tokens"] == 3 + 3 + 1 and metrics["kl_mean"] == 0.0 and metrics["top1_agreement"] == 1.0


def test_cli_json_has_every_field(models, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text(_random_text(100, seed=3))
    args = ["eval", str(models["store"]), "--reference", str(models["other_ckpt"]), "--text", str(text)]
    assert main(args + ["--max-tokens", "80", "--context", "40", "--memory", "64KiB", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    fields = {
        "store",
        "reference",
        "reference_kind",
        "experts_dtype",
        "reference_dtype",
        "tokens",
        "windows",
        "context",
        "store_perplexity",
        "reference_perplexity",
        "perplexity_change_percent",
        "kl_mean",
        "kl_p99",
        "top1_agreement",
        "store_seconds",
        "reference_seconds",
        "store_load_seconds",
        "reference_load_seconds",
        "store_cache",
    }
    assert fields <= set(out) and out["tokens"] == 78 and out["windows"] == 2
    assert out["store_seconds"] > 0 and out["reference_seconds"] > 0

    assert main(args + ["--max-tokens", "80", "--context", "40"]) == 0  # the table
    table = capsys.readouterr().out
    rows = ("perplexity change", "KL(ref || store) mean", "KL(ref || store) p99", "top-1 agreement", "tokens evaluated")
    for row in rows:
        assert row in table


def _error(args, capsys) -> str:
    assert main(args) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]  # after the progress bars, if any
    assert last.startswith("moestream: error:")
    return last


def test_clear_errors(models, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text(_random_text(50, seed=4))
    store = str(models["store"])

    neither = tmp_path / "neither"
    neither.mkdir()
    (neither / "config.json").write_text("{}")  # a config without weights is not a checkpoint
    err = _error(["eval", store, "--reference", str(neither), "--text", str(text)], capsys)
    assert "neither a moestream store" in err

    short = tmp_path / "short.txt"
    short.write_text("x")
    err = _error(["eval", store, "--reference", str(models["ckpt"]), "--text", str(short)], capsys)
    assert "1 token(s) long" in err

    err = _error(["eval", store, "--reference", str(models["ckpt"]), "--text", str(tmp_path / "missing.txt")], capsys)
    assert "missing.txt" in err

    wider = make_model(FAMILY, seed=0, **dict(TINY[FAMILY], vocab_size=300))
    wider_ckpt = save_checkpoint(wider, tmp_path / "wider")
    err = _error(["eval", store, "--reference", str(wider_ckpt), "--text", str(text)], capsys)
    assert "258 tokens" in err and "300" in err

    bare = make_model(FAMILY, seed=0, **TINY[FAMILY])
    bare.save_pretrained(tmp_path / "bare")  # no tokenizer beside it
    bare_store = moestream.convert(tmp_path / "bare", tmp_path / "bare-store", progress=False)
    err = _error(["eval", str(bare_store), "--reference", str(tmp_path / "bare"), "--text", str(text)], capsys)
    assert "no tokenizer" in err

    with pytest.raises(UsageError, match="at least 2"):
        compare(store, models["ckpt"], "abc", context=1)


def test_reference_dtype_loads_the_checkpoint_in_that_dtype(models):
    text = _random_text(200, seed=3)
    exact = compare(models["store"], models["ckpt"], text, max_tokens=100, context=50)
    rounded = compare(models["store"], models["ckpt"], text, max_tokens=100, context=50, reference_dtype="bfloat16")
    assert exact.reference_dtype == "float32" and rounded.reference_dtype == "bfloat16"
    assert exact.kl_mean < 1e-9 < rounded.kl_mean  # the fp32 store against a bf16-rounded reference
    with pytest.raises(UsageError, match="--reference-dtype float64 needs a checkpoint reference"):
        compare(models["store"], models["ckpt"], text, reference_dtype="float64")
    with pytest.raises(UsageError, match="needs a checkpoint reference"):
        compare(models["store"], models["store"], text, reference_dtype="float32")


def test_decode_mode_gives_the_windows_numbers_one_token_at_a_time(models):
    """--decode: the store predicts each window token by token with its KV cache; the same model, so the
    same metrics as one forward pass per window up to float32 summation order."""
    store_model, _ = moestream.load(models["store"], "1MiB")
    reference = AutoModelForCausalLM.from_pretrained(models["other_ckpt"], dtype=torch.float32).eval()
    ids = torch.randint(0, 250, (90,), generator=torch.Generator().manual_seed(61))
    windows = compare_models(store_model, reference, ids, context=40)
    decoded = compare_models(store_model, reference, ids, context=40, decode=True)
    assert decoded["tokens"] == windows["tokens"] == 87
    for key in ("store_perplexity", "kl_mean", "top1_agreement"):
        assert decoded[key] == pytest.approx(windows[key], rel=1e-4), key
    assert decoded["reference_perplexity"] == windows["reference_perplexity"]
