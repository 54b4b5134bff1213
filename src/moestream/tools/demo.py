"""`moestream demo`: build a synthetic MoE checkpoint, convert it, stream it under a sweep of budgets.

The weights are random, so the text is noise. Random routers are not uniform either: deeper layers of a
randomly initialized model see similar hidden states for every token and keep picking a few dozen
experts, so hit rates saturate early. The skewed model adds Zipf popularity on purpose. Neither is
real routing: tune nothing on them (use a trained checkpoint for that).
"""

from __future__ import annotations

import gc
import tempfile
import time
from pathlib import Path

import torch

from ..conversion.convert import convert
from ..conversion.sizes import ModelSizes
from ..conversion.store import Store
from ..conversion.synthetic import VOCAB_SIZE, make_model, save_checkpoint, skew_router
from ..core.loading import close, load, stats
from ..core.memory import current_rss_bytes, peak_rss_bytes, reset_peak_rss
from ..generation.generate import SamplingParams, encode
from ..generation.serving import stream
from ..native import fused_build
from ..units import format_bytes

PROMPT = "def fibonacci(n):"
ZIPF = 1.2


def demo_config(quick: bool) -> dict:
    # The paper-sized routing shape (256 experts, top-6) at a size that builds in seconds:
    # 8 layers x 256 experts x 192 KiB (bf16, 256 -> 128 -> 256) = 402 MB of experts.
    return dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_hidden_layers=4 if quick else 8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        num_experts=64 if quick else 256,
        num_experts_per_tok=6,
        norm_topk_prob=True,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        dtype=torch.bfloat16,
    )


def _build_stores(workdir: Path, quick: bool) -> tuple[Path, Path]:
    """The same random model twice: as initialized, and with its routers skewed to Zipf popularity."""
    model = make_model("qwen3_moe", seed=0, **demo_config(quick))
    uniform = save_checkpoint(model, workdir / "uniform-hf")
    skew_router(model, ZIPF)
    skewed = save_checkpoint(model, workdir / "skewed-hf")
    del model
    gc.collect()
    return convert(uniform, workdir / "uniform.moe", progress=False), convert(skewed, workdir / "skewed.moe", progress=False)


def _run(store: Path, budget: int, tokens: int) -> dict:
    gc.collect()
    reset_peak_rss()
    baseline = current_rss_bytes()  # the Python/torch/transformers runtime, before the model exists
    model, tokenizer = load(store, budget)
    # Sampling, not greedy: a random model's greedy output repeats one token, which would route every
    # step to the same experts and make any budget look good.
    result = stream(model, tokenizer, encode(tokenizer, PROMPT), SamplingParams(tokens, seed=0, ignore_eos=True))
    s = stats(model)
    close(model)
    del model
    gc.collect()
    return {
        "budget": budget,
        "hit_rate": s["hit_rate"],
        "mb_read": s["bytes_read"] / 1e6,
        "peak_rss": peak_rss_bytes(),
        "rss_growth": peak_rss_bytes() - baseline,
        "ttft_s": result.time_to_first_token,
        "decode_tokens_per_s": result.decode_tokens_per_second,
    }


def _table(rows: list[dict], label) -> None:
    print(
        f"  {'budget':>10} {'of experts':>10} {'hit rate':>9} {'MB read':>9} {'peak RSS':>10} {'of which model':>14} "
        f"{'TTFT s':>7} {'decode tok/s':>12}"
    )
    for r in rows:
        print(
            f"  {format_bytes(r['budget']):>10} {label(r):>10} {r['hit_rate']:>9.1%} {r['mb_read']:>9.1f} "
            f"{format_bytes(r['peak_rss']):>10} {format_bytes(r['rss_growth']):>14} {r['ttft_s']:>7.2f} {r['decode_tokens_per_s']:>12.1f}"
        )


def run_demo(workdir: str | None = None, tokens: int = 24, quick: bool = False) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="moestream-demo-") as tmp:
        root = Path(workdir) if workdir else Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        print("moestream demo: a synthetic Qwen3-MoE with RANDOM weights (the generated text is noise).")
        fused_build.start()  # a first run's kernel compile goes on while the checkpoint is built and converted
        uniform, skewed = _build_stores(root, quick)
        manifest = Store(uniform).manifest
        sizes = ModelSizes.of_store(manifest)
        experts_total = sizes.expert_stride_bytes  # the budgets below are shares of the experts as stored
        print(
            f"built and converted in {time.perf_counter() - t0:.1f}s: {manifest.model_config['num_hidden_layers']} layers x "
            f"{sizes.experts_per_layer} experts, top-{sizes.top_k}, experts {format_bytes(experts_total)}, "
            f"resident {format_bytes(sizes.resident_bytes)}"
        )
        print(f"\nrouting as randomly initialized, {tokens} sampled tokens after the prompt {PROMPT!r} per budget:")
        fractions = (0.05, 0.10, 0.25, 0.50, 1.0)
        rows = [_run(uniform, int(experts_total * f), tokens) for f in fractions]
        _table(rows, lambda r: f"{r['budget'] / experts_total:.0%}")
        budget = int(experts_total * 0.25)
        print(f"\nskewed routers (Zipf {ZIPF} expert popularity) against the random ones at {format_bytes(budget)}:")
        pair = [rows[fractions.index(0.25)], _run(skewed, budget, tokens)]
        _table(pair, lambda r: "random" if r is pair[0] else "skewed")
        disk = sum(p.stat().st_size for p in uniform.rglob("*") if p.is_file())
        largest = max(r["peak_rss"] for r in rows + pair)
        print(
            f"\nmodel on disk {format_bytes(disk)}; largest peak RSS {format_bytes(largest)}, of which the model "
            f"(resident weights + expert cache + activations) {format_bytes(max(r['rss_growth'] for r in rows + pair))}; "
            f"the rest is the Python/torch runtime. Done in {time.perf_counter() - t0:.0f}s."
        )
        return rows + pair
