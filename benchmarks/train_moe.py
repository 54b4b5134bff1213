"""Train a small Mixture-of-Experts language model on English prose, for validating cache policies.

    python benchmarks/train_moe.py --arch olmoe --text pydoc-topics --minutes 20 -o validation-olmoe
    python benchmarks/train_moe.py --arch mixtral --text docstrings --minutes 20 -o heldout-mixtral

A policy tuned on one model's routing (the trained fixture: Qwen3-MoE on CPython source code) may not
hold on another. This script makes others, of another family and on other text, so a policy can be
checked on routing it was not tuned on. Random-weight models route almost uniformly and say nothing about
caching; a model trained for minutes already routes like a trained one (skewed popularity, tokens of one
topic sharing experts), which is what a cache sees.

Texts (both ship with Python or with a package this project installs, so anyone can rebuild them):
    pydoc-topics   the Python language reference topics that `help()` prints (pydoc_data.topics), about
                   465,000 characters of English prose; topics are split, not characters, so the held-out
                   text is whole sections the model never saw
    docstrings     the docstrings of numpy and torch's public functions and classes (API prose, with
                   examples), split by module

The output directory is a Hugging Face checkpoint (config.json, model.safetensors, tokenizer files) plus
heldout.txt (text not trained on, for `moestream trace --text`) and training.json (the arguments, the
steps taken and the loss curve). A byte-level BPE tokenizer of --vocab tokens is trained on the training
text first (tokenizers' own trainer).

Training: AdamW, cosine decay after a warm-up, sequences of --seq tokens in batches of --batch, the
load-balancing auxiliary loss of the architecture (router_aux_loss_coef 0.01, as the fixture), bf16
weights saved. It stops at --minutes of wall time (or --steps), whichever comes first, and reports the
held-out loss.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import math
import random
import time
from pathlib import Path

import torch

ARCHS = {
    # family: config overrides on top of the shared small shape below
    "olmoe": dict(num_experts=48, num_experts_per_tok=6),
    "mixtral": dict(num_local_experts=32, num_experts_per_tok=2),
    "qwen3_moe": dict(num_experts=64, num_experts_per_tok=4, decoder_sparse_step=1, mlp_only_layers=[]),
    "deepseek_v3": dict(
        n_routed_experts=48,
        num_experts_per_tok=6,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        kv_lora_rank=64,
        q_lora_rank=None,
        qk_rope_head_dim=16,
        qk_nope_head_dim=32,
        v_head_dim=32,
    ),
}
EXPERT_WIDTH = {"olmoe": 128, "mixtral": 256, "qwen3_moe": 128, "deepseek_v3": 128}


def pydoc_topics() -> list[str]:
    import pydoc_data.topics

    return [pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics)]


def docstrings() -> list[str]:
    """One document per module: the docstrings of its public functions and classes, in name order."""
    docs = []
    for package in ("numpy", "torch"):
        root = importlib.import_module(package)
        names = sorted({package, *(f"{package}.{m}" for m in getattr(root, "__all__", []) if isinstance(m, str))})
        for name in sorted(set(names) | {f"{package}.{n}" for n in ("linalg", "fft", "random", "nn", "nn.functional", "optim")}):
            try:
                module = importlib.import_module(name)
            except Exception:
                continue
            parts = []
            for attr in sorted(dir(module)):
                if attr.startswith("_"):
                    continue
                obj = getattr(module, attr, None)
                if inspect.isfunction(obj) or inspect.isclass(obj) or inspect.isbuiltin(obj):
                    doc = inspect.getdoc(obj)
                    if doc and len(doc) > 200:
                        parts.append(f"{attr}\n{doc}")
            if parts:
                docs.append("\n\n".join(parts))
    # A module reached under two names is one document, not two.
    seen, unique = set(), []
    for d in docs:
        if d not in seen:
            seen.add(d)
            unique.append(d)
    return unique


TEXTS = {"pydoc-topics": pydoc_topics, "docstrings": docstrings}


def split_documents(docs: list[str], heldout_share: float, seed: int) -> tuple[str, str]:
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    n_held = max(1, round(len(docs) * heldout_share))
    held = "\n\n".join(docs[i] for i in sorted(order[:n_held]))
    train = "\n\n".join(docs[i] for i in sorted(order[n_held:]))
    return train, held


def train_tokenizer(text: str, vocab: int, out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([text[i : i + 10000] for i in range(0, len(text), 10000)], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>")
    fast.save_pretrained(out)
    return fast


def make_config(arch: str, vocab: int, layers: int, hidden: int):
    from transformers import AutoConfig

    shape = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        moe_intermediate_size=EXPERT_WIDTH[arch],
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        max_position_embeddings=1024,
        router_aux_loss_coef=0.01,
        output_router_logits=True,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    if arch in ("mixtral", "olmoe"):
        shape["intermediate_size"] = EXPERT_WIDTH[arch]  # these families size their experts by intermediate_size
    if arch == "deepseek_v3":
        shape["num_key_value_heads"] = 4  # multi-head latent attention: no grouped KV heads
        shape["head_dim"] = ARCHS[arch]["qk_rope_head_dim"]  # the rotary part of each head
    return AutoConfig.for_model(arch, **shape, **ARCHS[arch])


def heldout_loss(model, ids: torch.Tensor, seq: int, windows: int = 16) -> float:
    model.eval()
    losses = []
    with torch.no_grad():
        for w in range(min(windows, (len(ids) - 1) // seq)):
            chunk = ids[w * seq : (w + 1) * seq + 1][None]
            out = model(input_ids=chunk[:, :-1], labels=chunk[:, :-1], output_router_logits=False)
            losses.append(float(out.loss))
    model.train()
    return sum(losses) / max(1, len(losses))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", choices=sorted(ARCHS), default="olmoe")
    parser.add_argument("--text", choices=sorted(TEXTS), default="pydoc-topics")
    parser.add_argument("-o", "--output", type=Path, required=True, help="checkpoint directory to write")
    parser.add_argument("--minutes", type=float, default=20.0, help="wall-time limit of the training loop")
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--heldout-share", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    from transformers import AutoModelForCausalLM

    args.output.mkdir(parents=True, exist_ok=True)
    train_text, held_text = split_documents(TEXTS[args.text](), args.heldout_share, args.seed)
    (args.output / "heldout.txt").write_text(held_text)
    print(f"text {args.text}: {len(train_text):,} characters to train on, {len(held_text):,} held out")
    tokenizer = train_tokenizer(train_text, args.vocab, args.output)
    train_ids = torch.tensor(tokenizer(train_text)["input_ids"])
    held_ids = torch.tensor(tokenizer(held_text)["input_ids"])
    print(f"{len(train_ids):,} training tokens, {len(held_ids):,} held-out tokens")

    config = make_config(args.arch, len(tokenizer), args.layers, args.hidden)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    params = sum(p.numel() for p in model.parameters())
    print(f"{args.arch}: {params / 1e6:.1f}M parameters")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    warmup, limit = 50, args.minutes * 60
    start, step, curve = time.perf_counter(), 0, []
    gen = torch.Generator().manual_seed(args.seed)
    model.train()
    while step < args.steps and time.perf_counter() - start < limit:
        # Cosine over the wall-time budget: the schedule ends when the time does.
        progress = min(1.0, (time.perf_counter() - start) / limit)
        lr = args.lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.randint(0, len(train_ids) - args.seq - 1, (args.batch,), generator=gen)
        batch = torch.stack([train_ids[s : s + args.seq] for s in starts.tolist()])
        out = model(input_ids=batch, labels=batch)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 50 == 0:
            curve.append((step, round(time.perf_counter() - start, 1), round(float(out.loss), 4)))
            print(f"step {step} {time.perf_counter() - start:.0f}s loss {float(out.loss):.3f} lr {lr:.2e}", flush=True)
    held = heldout_loss(model, held_ids, args.seq)
    print(f"done: {step} steps in {time.perf_counter() - start:.0f}s, held-out loss {held:.3f} nats/token")
    model.config.output_router_logits = False
    model.to(torch.bfloat16).save_pretrained(args.output)
    (args.output / "training.json").write_text(
        json.dumps(
            dict(vars(args), output=str(args.output), steps_taken=step, heldout_loss=held, curve=curve, parameters=params),
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
