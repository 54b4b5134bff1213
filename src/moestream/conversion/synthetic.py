"""Synthetic Hugging Face checkpoints with random weights, for the demo, tests and benchmarks.

A checkpoint made here is a real one: transformers builds the model from a config, initializes it
randomly and `save_pretrained` writes it, with a byte-level tokenizer beside it. Random weights route
almost uniformly and without temporal locality; `zipf` skews expert popularity on purpose.

`calibrated_router` goes further: a router of three interpretable parameters (`RoutingParams`: popularity,
token-to-token spread, locality) whose values `CALIBRATED` were searched so that a synthetic model's trace
over real text resembles a trained model's (docs/DECISIONS.md, "Calibrated synthetic routers"; the search script is in git: git show b3336f6:benchmarks/calibrate_routing.py); `CALIBRATED_30B` are the
values for Qwen3-30B-A3B's shape (128 experts, top-8).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
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


@dataclass(frozen=True)
class RoutingParams:
    """The router of `calibrated_router`, in logit units: expert e's logit for a token is

        -zipf * log(rank_e)  +  noise * n_e(token)  +  topic * t_e(class of the token)

    with a random ranking of the experts, and n, t standard normal, drawn per layer.
    - zipf: popularity. 0 is no preferred expert; larger concentrates the routings on fewer experts.
    - noise: spread. Each token id's own random preference: larger routes different tokens to more
      different experts (flatter popularity), smaller lets the bias and the topic decide.
    - topic: locality. Tokens of one class (whitespace, newline, lowercase, uppercase, digit, bracket,
      other punctuation, other) share a preference, and real text comes in runs of a class (words,
      indentation, numbers), so consecutive tokens share experts, as they do in a trained model.
    """

    zipf: float = 0.0
    noise: float = 1.0
    topic: float = 0.0
    seed: int = 0


# Chosen (benchmarks/calibrate_routing.py as of b3336f6) by `python benchmarks/calibrate_routing.py ../shared/models/tiny-code-moe --rounds 1
# --grid zipf=0.4,0.5,0.6 --grid noise=0.75,1,1.5 --grid topic=0,0.25,0.5,1` (a first full-grid pass had
# narrowed zipf to about 0.5): the trained tiny-code-moe fixture's shape (6 layers x 64 experts, top-4)
# over its heldout.txt, the grid point whose expert popularity and lru/lfu/belady hit rates at 5-30% of
# the experts are closest to the fixture's (distance 0.0137). topic barely moves that distance (0.0137 at
# 0, 0.0149-0.0156 at 0.25-1): byte-level text repeats tokens enough to give the fixture's locality.
# The values are logits, so they depend on experts and top-k: for Qwen3-30B-A3B's shape see CALIBRATED_30B.
CALIBRATED = RoutingParams(zipf=0.5, noise=1.0, topic=0.0)

# Qwen3-30B-A3B's shape (hidden 2048, 128 experts, top-8), against the same fixture and text, compared as
# shares of the experts. Chosen (the same script, as of b3336f6) by `python benchmarks/calibrate_routing.py ../shared/models/tiny-code-moe
# --shape qwen3-30b-a3b --layers 6 --expert-width 16 --rounds 2 --start 0.35,1.0,0.5 --grid
# zipf=0.3,0.35,0.4,0.45 --grid noise=0.85,1,1.15 --grid topic=0.35,0.5,0.65` (distance 0.0092; a first
# pass over the default grid, --rounds 1 from the same start, had found 0.35, 1.0, 0.5 at 0.0155, with
# topic 0 at 0.0445). 6 layers, the fixture's count, so that a 5% budget holds fewer experts than a
# token's layers x top-k, as in the fixture (and in the 48-layer model); with 2 layers LRU keeps the last
# layer's experts and the 5% figure is not comparable. Here, unlike at the fixture's own shape, topic
# matters: 128 experts with top-8 need the class preference to give the fixture's locality.
CALIBRATED_30B = RoutingParams(zipf=0.4, noise=1.0, topic=0.5)

TOKEN_CLASSES = ("space", "newline", "lower", "upper", "digit", "bracket", "punct", "other")


def _class_of(text: str) -> int:
    stripped = text.strip(" \t")
    if not stripped:
        return 0 if text else len(TOKEN_CLASSES) - 1
    c = stripped[0]
    if c in "\r\n":
        return 1
    if c.isascii() and c.islower():
        return 2
    if c.isascii() and c.isupper():
        return 3
    if c.isascii() and c.isdigit():
        return 4
    if c in "()[]{}":
        return 5
    if c.isascii() and c.isprintable():
        return 6
    return 7


def token_classes(vocab_size: int, tokenizer=None) -> torch.Tensor:
    """Each token id's class (an index into TOKEN_CLASSES), from its text under `tokenizer` (default: the
    byte tokenizer); ids the tokenizer does not know are "other"."""
    tokenizer = tokenizer or byte_tokenizer()
    known = len(tokenizer)
    return torch.tensor([_class_of(tokenizer.decode([i])) if i < known else len(TOKEN_CLASSES) - 1 for i in range(vocab_size)])


def _routers(model) -> list:
    return [m for m in model.modules() if type(m).__name__.endswith("Router")]  # Qwen3MoeTopKRouter and its kin


@torch.no_grad()
def calibrated_router(model, params: RoutingParams = CALIBRATED, tokenizer=None) -> None:
    """Give every MoE router of a random qwen3_moe-like model the routing `params` describe (see
    RoutingParams), in place: the model stays an ordinary one, written by save_pretrained.

    How. The first 1 + F + C hidden dimensions are reserved for routing: dimension 0 holds a constant
    (the bias feature of skew_router), the next F a random vector per token id (the noise), the next C a
    one-hot of the token's class (the topic). No attention or MLP writes them (their output rows there
    are zeroed), so every layer's residual stream still holds the embedding's values in them, and each
    router reads only them. RMSNorm rescales a token's logits by one positive factor, which the top-k
    choice ignores: the experts chosen are exactly those of the formula above.
    """
    g = torch.Generator().manual_seed(params.seed)
    embed = model.get_input_embeddings().weight
    vocab, hidden = embed.shape
    classes = len(TOKEN_CLASSES)
    features = min(64, (hidden - 1 - classes) // 2)
    if features < 4:
        raise ValueError(f"hidden size {hidden} is too small for calibrated_router (needs at least {2 * 4 + 1 + classes})")
    reserved = 1 + features + classes
    feat = slice(1, 1 + features)
    topic = slice(1 + features, reserved)
    std = model.config.initializer_range
    embed[:, 0] = 1.0
    embed[:, feat] = torch.randn(vocab, features, generator=g).to(embed.dtype) * std
    embed[:, topic] = 0.0
    embed[torch.arange(vocab), 1 + features + token_classes(vocab, tokenizer)] = std
    # After RMSNorm the constant feature is about this large; it only sets the logits' overall scale.
    scale = 1.0 / ((1.0 + (hidden - 1) * std**2) / hidden) ** 0.5
    for name, module in model.named_modules():
        if name.endswith("o_proj") or name.endswith("down_proj"):
            module.weight[:reserved] = 0.0  # attention and dense/shared MLP outputs
        elif hasattr(module, "down_proj") and isinstance(module.down_proj, torch.nn.Parameter):
            down = module.down_proj  # fused experts: [experts, hidden, width], or transposed
            if getattr(module, "is_transposed", False):
                down[..., :reserved] = 0.0
            else:
                down[:, :reserved] = 0.0
    for router in _routers(model):
        weight = router.weight
        experts = weight.shape[0]
        ranks = torch.randperm(experts, generator=g).float() + 1
        weight.zero_()
        weight[:, 0] = -params.zipf * torch.log(ranks) / scale
        noise = torch.randn(experts, features, generator=g) * params.noise / (features**0.5 * std * scale)
        weight[:, feat] = noise.to(weight.dtype)
        weight[:, topic] = (torch.randn(experts, classes, generator=g) * params.topic / (std * scale)).to(weight.dtype)


@torch.no_grad()
def routed_experts(model, ids) -> np.ndarray:
    """The experts each router of `model` chooses for the token ids `ids` fed as one sequence, as
    [tokens, MoE layers, top_k] (a causal model routes each token the same whether the sequence comes at
    once or one token at a time, which is how a decode trace feeds it)."""
    out: list = []
    hooks = [
        r.register_forward_hook(lambda module, args, result: out.append(result[-1].detach().clone())) for r in _routers(model)
    ]
    try:
        model(torch.as_tensor(ids, dtype=torch.long).reshape(1, -1))
    finally:
        for h in hooks:
            h.remove()
    return torch.stack(out, 1).to(torch.int32).numpy()
