"""Synthetic Hugging Face checkpoints with random weights, for the demo, tests and benchmarks.

A checkpoint made here is a real one: transformers builds the model from a config, initializes it
randomly and `save_pretrained` writes it, with a byte-level tokenizer beside it. Random weights route
almost uniformly and without temporal locality; `zipf` skews expert popularity on purpose.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<|endoftext|>", "<|pad|>"]


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer: 256 byte tokens plus two specials, no merges (any text round-trips)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    for tok in SPECIAL_TOKENS:
        vocab[tok] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=SPECIAL_TOKENS[0], pad_token=SPECIAL_TOKENS[1])


VOCAB_SIZE = 258


def make_model(model_type: str, seed: int = 0, **config_kwargs):
    """A randomly initialized transformers causal LM of `model_type` (fp32 unless `dtype` says otherwise)."""
    torch.manual_seed(seed)
    dtype = config_kwargs.pop("dtype", torch.float32)
    config = AutoConfig.for_model(model_type, **config_kwargs)
    return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


@torch.no_grad()
def skew_router(model, zipf: float, noise: float = 1.0, seed: int = 0) -> None:
    """Make expert popularity roughly Zipf(`zipf`) in every MoE layer of a random model.

    Routers without a bias (Qwen3-MoE's) get one through a constant feature: every token embedding gets
    a large value in hidden dimension 0, which RMSNorm keeps near-constant, and router column 0 holds
    the per-expert bias -zipf * log(rank). The rest of the router is noise of std `noise`, so which
    experts a token picks still varies, popular ones more often.
    """
    g = torch.Generator().manual_seed(seed)
    embed = model.get_input_embeddings().weight
    hidden = embed.shape[1]
    embed[:, 0] = 1.0
    # After RMSNorm the constant feature is about this large (the other features are ~N(0, init std)).
    std = model.config.initializer_range
    feature = 1.0 / ((1.0 + (hidden - 1) * std**2) / hidden) ** 0.5
    for module in model.modules():
        if type(module).__name__.endswith("Router"):  # Qwen3MoeTopKRouter and its kin
            weight = module.weight
            experts = weight.shape[0]
            ranks = torch.randperm(experts, generator=g).float() + 1
            bias = -zipf * torch.log(ranks)
            weight.normal_(0, noise / ((hidden - 1) ** 0.5 * std * feature), generator=g)
            weight[:, 0] = bias / feature


def save_checkpoint(model, directory: str | Path, tokenizer=None, max_shard_size: str = "2GB") -> Path:
    directory = Path(directory)
    model.save_pretrained(directory, max_shard_size=max_shard_size)
    (tokenizer or byte_tokenizer()).save_pretrained(directory)
    return directory
