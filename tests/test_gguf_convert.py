"""`moestream convert FILE.gguf STORE`: a llama.cpp GGUF converts to a store whose streamed model equals
transformers' forward on the GGUF's dequantized weights, and bad files are refused in one clear line.

The GGUF files are written here the way llama.cpp's convert_hf_to_gguf.py writes them: its tensor names
(gguf-py's own TensorNameMap), experts merged into one [E, rows, cols] tensor per projection, the q/k rows of
llama-family models permuted (LlamaModel.permute), its metadata keys, and a byte-level BPE vocabulary. The
reference weights are each tensor's own quantize -> dequantize round trip, computed without any of the
converter's name mapping or permutation logic.
"""

import sys
import zlib

import numpy as np
import pytest
import torch
from gguf import MODEL_ARCH, MODEL_ARCH_NAMES, GGUFReader, GGUFWriter, RopeScalingType, TokenType, get_tensor_name_map
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from tiny import TINY

import moestream
from moestream.cli import main
from moestream.conversion import quant
from moestream.conversion.gguf_blocks import four_bit_nibbles
from moestream.conversion.gguf_source import GGUFCheckpoint
from moestream.conversion.quant import QuantFormat, Quantized, reference_dequantize, stored_codes, unpack_nibbles
from moestream.conversion.skeleton import config_from_dict
from moestream.conversion.store import DTYPES, Store
from moestream.conversion.synthetic import make_model, save_checkpoint
from moestream.errors import SourceError, UsageError
from moestream.generation.kv_disk import tier_for
from moestream.native import fused_build

MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he")]
VOCAB = 256 + len(MERGES) + 2  # bytes, merged tokens, two specials

ARCHS = {
    "qwen3_moe": MODEL_ARCH.QWEN3MOE,
    "qwen2_moe": MODEL_ARCH.QWEN2MOE,
    "mixtral": MODEL_ARCH.LLAMA,
    "deepseek_v3": MODEL_ARCH.DEEPSEEK2,
    "deepseek_v2": MODEL_ARCH.DEEPSEEK2,
    "gpt_oss": MODEL_ARCH.GPT_OSS,
}
# DeepSeek's yarn rope, as llama.cpp's deepseek2 keys state it.
DEEPSEEK_YARN = dict(
    rope_type="yarn",
    rope_theta=10000.0,
    factor=4.0,
    original_max_position_embeddings=64,
    beta_fast=32.0,
    beta_slow=1.0,
    mscale=1.0,
    mscale_all_dim=1.0,
)
# Widths that fill the 32-value blocks of Q4_0/Q8_0; Qwen3-MoE's top-k weights normalized, as llama.cpp does.
CONFIGS = {
    "qwen3_moe": dict(TINY["qwen3_moe"], vocab_size=VOCAB, moe_intermediate_size=32, norm_topk_prob=True),
    "qwen2_moe": dict(TINY["qwen2_moe"], vocab_size=VOCAB, moe_intermediate_size=32, shared_expert_intermediate_size=32),
    "mixtral": dict(TINY["mixtral"], vocab_size=VOCAB, intermediate_size=32),
    # A dense first layer, a shared expert, grouped sigmoid routing, MLA with LoRA ranks that fill Q8_0
    # blocks, DeepSeek-V3's yarn rope; no multi-token-prediction layer (llama.cpp leaves it out).
    "deepseek_v3": dict(
        TINY["deepseek_v3"],
        vocab_size=VOCAB,
        moe_intermediate_size=32,
        q_lora_rank=32,
        kv_lora_rank=32,
        num_mtp_layers=0,
        rope_parameters=DEEPSEEK_YARN,
    ),
    # DeepSeek-V2-Lite's layout: softmax routing without groups (llama.cpp's softmax gating), MLA without a
    # query LoRA, a dense first layer, a shared expert, the top-k weights scaled and not normalized.
    "deepseek_v2": dict(
        TINY["deepseek_v3"],
        vocab_size=VOCAB,
        moe_intermediate_size=32,
        q_lora_rank=None,
        kv_lora_rank=32,
        n_group=1,
        topk_group=1,
        norm_topk_prob=False,
        topk_method="greedy",
        rope_parameters=DEEPSEEK_YARN,
    ),
    # Biases, attention sinks, sliding and full layers, gpt-oss's own yarn (no truncation of its bounds).
    "gpt_oss": dict(
        TINY["gpt_oss"],
        vocab_size=VOCAB,
        intermediate_size=32,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=150000.0,
            factor=32.0,
            original_max_position_embeddings=4096,
            beta_fast=32.0,
            beta_slow=1.0,
            truncate=False,
        ),
    ),
}
# A mix of what real files hold: F32 norms and routers, F16/BF16 and block-quantized matrices.
TYPES = {
    "attn_q": Q.Q8_0,
    "attn_k": Q.Q4_0,
    "attn_v": Q.F16,
    "attn_output": Q.BF16,
    "ffn_gate_exps": Q.Q8_0,
    "ffn_up_exps": Q.Q4_0,
    "ffn_down_exps": Q.F16,
    "ffn_gate_shexp": Q.Q8_0,
    "ffn_up_shexp": Q.Q4_1,
    "ffn_down_shexp": Q.Q5_0,
    "attn_q_a": Q.Q8_0,
    "attn_q_b": Q.Q4_0,
    "attn_kv_a_mqa": Q.Q8_0,
    "attn_kv_b": Q.Q8_0,
    "attn_k_b": Q.F16,  # rows of qk_nope_head_dim (8): no whole blocks
    "attn_v_b": Q.Q8_0,
    "ffn_gate": Q.Q8_0,
    "ffn_up": Q.BF16,
    "ffn_down": Q.Q4_0,
    "token_embd": Q.Q8_0,
    "output": Q.Q4_0,
}
# gpt-oss files keep the experts in MXFP4, as the model was trained and released.
FAMILY_TYPES = {"gpt_oss": {**TYPES, "ffn_gate_exps": Q.MXFP4, "ffn_up_exps": Q.MXFP4, "ffn_down_exps": Q.MXFP4}}


def four_bit_codes(raw: np.ndarray, ggml_type: int, cols: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """gguf_blocks.four_bit_nibbles with one code (0..15) per weight: codes [rows, cols] uint8, s, z."""
    nibbles, s, z = four_bit_nibbles(raw, ggml_type, cols)
    return unpack_nibbles(nibbles), s, z


def bpe_tokenizer():
    """A small byte-level BPE: the 256 byte tokens, three merges, two special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for a, b in MERGES:
        vocab[a + b] = len(vocab)
    for special in ("<|endoftext|>", "<|pad|>"):
        vocab[special] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=MERGES))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>")


def _ggml_type(gguf_name: str, ndim: int, types=TYPES) -> Q:
    leaf = gguf_name.split(".")[-2]
    return Q.F32 if ndim == 1 else types.get(leaf, Q.F32)


# Block types gguf-py cannot quantize: (weights per block, bytes per block, offset of their fp16 scale (and
# min), how many).
RANDOM_BLOCKS = {
    Q.Q4_K: (256, 144, 0, 2),
    Q.Q2_K: (256, 84, 80, 2),
    Q.Q6_K: (256, 210, 208, 1),
    Q.IQ4_NL: (32, 18, 0, 1),
    Q.IQ4_XS: (256, 136, 0, 1),
}


def random_blocks(values: np.ndarray, qtype: Q = Q.Q4_K) -> np.ndarray:
    """Blocks of `qtype` (one of RANDOM_BLOCKS) for a tensor of `values`' shape: random codes and sub-block
    scales (and mins), finite fp16 block scales; the same blocks for the same values."""
    weights, size, at, halves = RANDOM_BLOCKS[qtype]
    rng = np.random.default_rng(zlib.crc32(values.tobytes()))
    rows, cols = values.reshape(-1, values.shape[-1]).shape
    blocks = rng.integers(0, 256, (rows, cols // weights, size), dtype=np.uint8)
    scales = (np.abs(rng.standard_normal((rows, cols // weights, halves))) * 2e-4).astype(np.float16)
    blocks[..., at : at + 2 * halves] = scales.view(np.uint8).reshape(rows, cols // weights, 2 * halves)
    return blocks.reshape(*values.shape[:-1], cols // weights * size)


def _round_trip(values: np.ndarray, qtype: Q) -> tuple[np.ndarray, np.ndarray]:
    """(what the file stores, the values it decodes to) for float32 `values` stored as `qtype` (RANDOM_BLOCKS'
    types: random blocks instead of `values`)."""
    if qtype == Q.F32:
        return values, values
    if qtype == Q.F16:
        stored = values.astype(np.float16)
        return stored, stored.astype(np.float32)
    stored = random_blocks(values, qtype) if qtype in RANDOM_BLOCKS else quantize(values, qtype)
    return stored, dequantize(stored, qtype).reshape(values.shape)


def _add_tensor(writer, gguf_name: str, values: np.ndarray, types=TYPES) -> np.ndarray:
    """Write `values` under `gguf_name` in the type `types` gives that tensor; the values the file decodes to."""
    qtype = _ggml_type(gguf_name, values.ndim, types)
    stored, back = _round_trip(np.ascontiguousarray(values), qtype)
    writer.add_tensor(gguf_name, stored, raw_dtype=qtype)
    return back


def _llama_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute (convert_hf_to_gguf.py): the rotary halves of each head interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_deepseek2_metadata(writer, config):
    """DeepseekV2Model.set_gguf_parameters: MLA written as one latent key/value head, sizes of the absorbed
    graph as key/value_length and the per-head ones as *_mla, the router and yarn keys."""
    from gguf import ExpertGatingFuncType

    writer.add_head_count_kv(1)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_expert_count(config.n_routed_experts)
    writer.add_expert_group_count(config.n_group)
    writer.add_expert_group_used_count(config.topk_group)
    # V2/V2.5 files have no gating key (llama.cpp then uses softmax); V3's say sigmoid
    if config.model_type == "deepseek_v3":
        writer.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
    writer.add_leading_dense_block_count(config.first_k_dense_replace)
    writer.add_vocab_size(config.vocab_size)
    if config.q_lora_rank is not None:
        writer.add_q_lora_rank(config.q_lora_rank)
    writer.add_kv_lora_rank(config.kv_lora_rank)
    writer.add_key_length(config.kv_lora_rank + config.qk_rope_head_dim)
    writer.add_value_length(config.kv_lora_rank)
    writer.add_key_length_mla(config.qk_nope_head_dim + config.qk_rope_head_dim)
    writer.add_value_length_mla(config.v_head_dim)
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_expert_shared_count(config.n_shared_experts)
    writer.add_expert_weights_scale(config.routed_scaling_factor)
    writer.add_expert_weights_norm(config.norm_topk_prob)
    writer.add_rope_dimension_count(config.qk_rope_head_dim)
    rope = config.rope_parameters
    writer.add_rope_scaling_type(RopeScalingType.YARN)
    writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
    writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    writer.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])


def _write_kv_b(writer, names, name, value, config, split: bool) -> np.ndarray:
    """kv_b_proj as llama.cpp writes it: split into attn_k_b (transposed) and attn_v_b, or (older files) whole.
    Returns the values the file decodes to, in kv_b_proj's own layout."""
    base = name.removesuffix(".weight")
    if not split:
        return _add_tensor(writer, names.get_name(base) + ".weight", value)
    heads, nope, v_dim = config.num_key_value_heads, config.qk_nope_head_dim, config.v_head_dim
    kv_b = value.reshape(heads, nope + v_dim, value.shape[-1])
    k_b, v_b = kv_b[:, :nope].transpose(0, 2, 1), kv_b[:, nope:]
    decoded = []
    for hf_name, part in (("k_b_proj", k_b), ("v_b_proj", v_b)):
        gguf_name = names.get_name(base.replace("kv_b_proj", hf_name)) + ".weight"
        decoded.append(_add_tensor(writer, gguf_name, part).reshape(part.shape))
    return np.concatenate([decoded[0].transpose(0, 2, 1), decoded[1]], axis=1).reshape(value.shape)


def _write_gpt_oss_metadata(writer, config):
    """GptOssModel.set_gguf_parameters: the experts' width, the sliding window, head sizes and yarn's keys."""
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_expert_count(config.num_local_experts)
    writer.add_expert_feed_forward_length(config.intermediate_size)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_sliding_window(config.sliding_window)
    rope = config.rope_parameters
    writer.add_rope_scaling_type(RopeScalingType.YARN)
    writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
    writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])


def _write_gpt_oss_experts(writer, names, name, value, types) -> np.ndarray:
    """gpt-oss's experts as llama.cpp writes them: gate_up_proj [E, H, 2I] (gate and up interleaved) split
    into ffn_gate_exps and ffn_up_exps, down_proj [E, I, H], each transposed to [E, out, in]; biases split
    the same way. Returns the values the file decodes to, in the model's own layout."""
    layer = int(name.split(".")[2])
    bias = name.endswith("_bias")

    def add(projection, part):  # part in the model's layout -> its decoded values, in that layout
        stored = part if bias else part.transpose(0, 2, 1)
        gguf_name = names.get_name(f"model.layers.{layer}.mlp.experts.{projection}") + (".bias" if bias else ".weight")
        back = _add_tensor(writer, gguf_name, np.ascontiguousarray(stored), types).reshape(stored.shape)
        return back if bias else back.transpose(0, 2, 1)

    if "down_proj" in name:
        return add("down_proj", value)
    gate, up = add("gate_proj", value[..., ::2]), add("up_proj", value[..., 1::2])
    return np.stack([gate, up], axis=-1).reshape(value.shape)


def write_gguf(model, path, split_max_tensors: int = 0, architecture: str | None = None, split_kv_b: bool = True, types=None):
    """`model` as llama.cpp would write it, each tensor in the type `types` gives it (default: its family's
    FAMILY_TYPES, else TYPES); returns {model parameter: the float32 values the file decodes to}."""
    config = model.config
    types = types or FAMILY_TYPES.get(config.model_type, TYPES)
    arch = ARCHS[config.model_type]
    names = get_tensor_name_map(arch, config.num_hidden_layers)
    writer = GGUFWriter(path, architecture or MODEL_ARCH_NAMES[arch], split_max_tensors=split_max_tensors)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_head_count(config.num_attention_heads)
    if config.model_type not in ("deepseek_v3", "deepseek_v2"):  # MLA: one latent head, below
        writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_file_type(1)
    if config.model_type in ("deepseek_v3", "deepseek_v2"):
        _write_deepseek2_metadata(writer, config)
    elif config.model_type == "gpt_oss":
        _write_gpt_oss_metadata(writer, config)
    elif config.model_type == "mixtral":
        writer.add_feed_forward_length(config.intermediate_size)
        writer.add_expert_count(config.num_local_experts)
        writer.add_vocab_size(config.vocab_size)
        writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    else:
        writer.add_feed_forward_length(config.intermediate_size)
        writer.add_expert_count(config.num_experts)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        if config.model_type == "qwen2_moe":
            writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
        else:
            writer.add_key_length(config.head_dim)
            writer.add_value_length(config.head_dim)
    # llama.cpp's gpt2 vocabulary: tokens by id, their types, the merges, the special ids.
    vocab = bpe_tokenizer().get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([TokenType.CONTROL if t.startswith("<|") else TokenType.NORMAL for t in tokens])
    writer.add_token_merges([f"{a} {b}" for a, b in MERGES])
    writer.add_eos_token_id(vocab["<|endoftext|>"])
    writer.add_pad_token_id(vocab["<|pad|>"])

    decoded = {}
    llama = config.model_type == "mixtral"
    for name, value in model.state_dict().items():
        value = value.float().numpy()
        base = name.removesuffix(".weight").removesuffix(".bias")
        suffix = name[len(base) :] or ".weight"
        if config.model_type == "gpt_oss" and ".experts." in name:
            decoded[name] = _write_gpt_oss_experts(writer, names, name, value, types)
            continue
        if base.endswith(".experts.gate_up_proj") or base.endswith(".experts.down_proj"):
            layer = int(name.split(".")[2])
            parts = (
                [("gate_proj", "w1", value[:, : value.shape[1] // 2]), ("up_proj", "w3", value[:, value.shape[1] // 2 :])]
                if base.endswith("gate_up_proj")
                else [("down_proj", "w2", value)]
            )
            out = []
            for qwen_name, mixtral_name, part in parts:
                # the merged names llama.cpp gives the stacked experts before mapping them
                merged = (
                    f"layers.{layer}.feed_forward.experts.{mixtral_name}"
                    if llama
                    else f"model.layers.{layer}.mlp.experts.{qwen_name}"
                )
                out.append(_add_tensor(writer, names.get_name(merged) + ".weight", part, types))
            decoded[name] = np.concatenate(out, axis=1)
            continue
        if base.endswith("kv_b_proj"):
            decoded[name] = _write_kv_b(writer, names, name, value, config, split_kv_b)
            continue
        if name.endswith("e_score_correction_bias"):  # llama.cpp renames it e_score_correction.bias
            base, suffix = base.removesuffix("_bias"), ".bias"
        gguf_name = names.get_name(base) + suffix
        stored_value = value
        if llama and base.endswith("q_proj"):
            stored_value = _llama_permute(value, config.num_attention_heads)
        elif llama and base.endswith("k_proj"):
            stored_value = _llama_permute(value, config.num_key_value_heads)
        _add_tensor(writer, gguf_name, stored_value, types)
        # Rows are quantized independently, so the round trip commutes with the row permutation.
        decoded[name] = _round_trip(value, _ggml_type(gguf_name, value.ndim, types))[1]
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return decoded


def _reference(family, decoded, resident_dtype, config=None):
    """transformers' float32 model on the decoded weights: resident ones rounded as the store keeps them."""
    model = make_model(family, **(config or CONFIGS[family]))
    with torch.no_grad():
        for name, value in decoded.items():
            t = torch.from_numpy(np.ascontiguousarray(value))
            # DeepSeek-V3's router is float32 whatever the model's dtype (transformers' DeepseekV3TopkRouter)
            fp32_router = family in ("deepseek_v3", "deepseek_v2") and ".mlp.gate." in name
            if ".experts." not in name and not fp32_router:
                t = t.to(resident_dtype).float()
            model.state_dict()[name].copy_(t)  # a parameter, or a buffer (DeepSeek's score correction)
    return model


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moestream: error:") and "Traceback" not in err, err
    return lines[0]


@pytest.fixture(scope="module")
def qwen3_gguf(tmp_path_factory):
    model = make_model("qwen3_moe", seed=11, **CONFIGS["qwen3_moe"])
    path = tmp_path_factory.mktemp("gguf") / "tiny-qwen3moe-Q8_0.gguf"
    return model, path, write_gguf(model, path)


@pytest.mark.parametrize(
    "family, split_kv_b",
    [
        ("qwen3_moe", True),
        ("qwen2_moe", True),
        ("mixtral", True),
        ("deepseek_v3", True),
        ("deepseek_v3", False),
        ("deepseek_v2", True),
        ("gpt_oss", True),
    ],
    ids=["qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3", "deepseek_v3-whole-kv_b", "deepseek_v2", "gpt_oss"],
)
def test_gguf_converts_to_the_model_of_its_dequantized_weights(family, split_kv_b, tmp_path):
    model = make_model(family, seed=11, **CONFIGS[family])
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # a bias that changes which experts are chosen
                buffer.copy_(torch.randn(buffer.shape, generator=torch.Generator().manual_seed(5)) * 0.1)
    decoded = write_gguf(model, tmp_path / "model.gguf", split_kv_b=split_kv_b)
    store = tmp_path / "store"
    assert main(["convert", str(tmp_path / "model.gguf"), str(store), "--experts-dtype", "fp32", "--dense-dtype", "float"]) == 0

    manifest = Store(store).manifest
    config = config_from_dict(manifest.model_config)
    assert config.model_type == family and config.dtype == torch.bfloat16
    for field, value in CONFIGS[family].items():  # every size the metadata states, and the file's shapes
        assert getattr(config, field) == value, (field, getattr(config, field), value)

    # Every parameter the store holds is the GGUF's own decoding (bf16-rounded where resident).
    reference = _reference(family, decoded, torch.bfloat16)
    streamed, _ = moestream.load(store, manifest.expert_bytes // 2, compute_dtype="fp32")
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        expected, got = reference(ids).logits, streamed(ids).logits
    assert ((got - expected).norm() / expected.norm()).item() <= 1e-5

    # The tokenizer rebuilt from the GGUF metadata encodes as the original one does.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(store)
    text = "the theme: def f(x):\n    return x * 2  # ünïcode"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids == bpe_tokenizer().encode(text, add_special_tokens=False)
    assert 256 + len(MERGES) - 1 in ids and tokenizer.decode(ids) == text  # " the" merged, and it round-trips
    assert tokenizer.eos_token == "<|endoftext|>"


def test_gguf_agrees_with_transformers_gguf_loader(qwen3_gguf):
    """transformers' own GGUF reader (names, dequantization) decodes the test file to the same weights."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    model, path, decoded = qwen3_gguf
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    assert set(tensors) == set(decoded)
    for name, value in decoded.items():
        assert torch.equal(tensors[name].float(), torch.from_numpy(np.ascontiguousarray(value))), name


def test_default_and_quantized_formats_of_a_gguf(qwen3_gguf, tmp_path):
    """Without options, each layer is stored at the bits of its blocks: experts of Q8_0 gate, Q4_0 up and F16
    down (9.3 bits on average) int8; the Q8_0 query int8, the Q4_0 key int4 in groups of 32, the F16 value
    and BF16 output projections float, the Q4_0 LM head int8 (never below). Options still choose."""
    _, path, _ = qwen3_gguf
    default = Store(moestream.convert(path, tmp_path / "default", progress=False)).manifest
    assert default.experts_dtype == "int8"
    formats = {name.rpartition(".")[2]: (f.name, f.group_size) for name, f in default.dense.items() if ".layers.0." in name}
    assert formats == {"q_proj": ("int8", None), "k_proj": ("int4", 32)} and default.dense["lm_head"].name == "int8"
    floats = moestream.convert(path, tmp_path / "bf16", "bf16", dense_dtype="float", progress=False)
    assert Store(floats).manifest.experts_dtype == "bfloat16" and not Store(floats).manifest.dense
    small = moestream.convert(path, tmp_path / "int4", "int4", dense_dtype="int8", progress=False)
    assert Store(small).manifest.experts_dtype.startswith("int4")
    streamed, _ = moestream.load(small, "1MiB")
    with torch.no_grad():
        assert torch.isfinite(streamed(torch.tensor([[1, 2, 3]])).logits).all()


def test_split_gguf_converts_as_one_file(tmp_path, capsys):
    model = make_model("qwen3_moe", seed=12, **CONFIGS["qwen3_moe"])
    decoded = write_gguf(model, tmp_path / "model.gguf", split_max_tensors=10)
    parts = sorted(tmp_path.glob("model-*-of-*.gguf"))
    assert len(parts) >= 3, parts
    store = moestream.convert(parts[1], tmp_path / "store", "fp32", dense_dtype="float", progress=False)  # any part names the set
    reference = _reference("qwen3_moe", decoded, torch.bfloat16)
    streamed, _ = moestream.load(store, "1MiB", compute_dtype="fp32")
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected, got = reference(ids).logits, streamed(ids).logits
    assert ((got - expected).norm() / expected.norm()).item() <= 1e-5

    parts[-1].unlink()
    capsys.readouterr()
    assert main(["convert", str(parts[0]), str(tmp_path / "again")]) == 2
    line = _one_line_error(capsys)
    assert f"split into {len(parts)} files" in line and f"{parts[-1].name} is missing" in line, line


def test_bad_gguf_files_are_one_line_errors(qwen3_gguf, tmp_path, capsys):
    _, path, _ = qwen3_gguf
    data = path.read_bytes()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(data[: len(data) * 2 // 3])  # the tensor data cut short
    header_cut = tmp_path / "header-cut.gguf"
    header_cut.write_bytes(data[:300])  # inside the metadata
    foreign = tmp_path / "foreign.gguf"
    foreign.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    mixtral = make_model("mixtral", seed=1, **CONFIGS["mixtral"])
    write_gguf(mixtral, tmp_path / "gemma.gguf", architecture="gemma3")
    dense = make_model("mixtral", seed=1, **CONFIGS["mixtral"])
    dense.config.num_local_experts = 0  # a llama file without experts: a dense model
    write_gguf(dense, tmp_path / "dense.gguf")

    for src, expected in (
        (truncated, "is truncated: tensor"),  # names the first tensor cut short
        (header_cut, "is a truncated or damaged GGUF file"),
        (foreign, "is not a GGUF file"),
        (empty, "is not a GGUF file"),
        (tmp_path / "gemma.gguf", "architecture 'gemma3' is not supported"),
        (tmp_path / "dense.gguf", "dense llama model"),
    ):
        assert main(["convert", str(src), str(tmp_path / "out")]) == 2, src
        line = _one_line_error(capsys)
        assert expected in line, line
        assert not (tmp_path / "out").exists()
    main(["convert", str(tmp_path / "gemma.gguf"), str(tmp_path / "out")])
    line = _one_line_error(capsys)
    assert "qwen3moe" in line and "qwen2moe" in line and "Mixtral" in line, line


def test_a_tokenizer_that_cannot_be_built_stops_the_import_at_once(qwen3_gguf, tmp_path, capsys, monkeypatch):
    """The tokenizer is built on a thread of its own while the tensors are written; where transformers cannot
    build it from the file's metadata, the import stops at its next read with that one-line error (not after
    all the file's tensors) and leaves nothing behind."""
    from moestream.conversion import gguf_source

    _, path, _ = qwen3_gguf

    def cannot(path, arch):
        raise SourceError(f"{path}: transformers cannot build a tokenizer from this GGUF's metadata (KeyError: 'merges')")

    reads = []
    real_read = gguf_source.GGUFCheckpoint._read_bytes
    monkeypatch.setattr(gguf_source, "_build_tokenizer", cannot)
    monkeypatch.setattr(gguf_source.GGUFCheckpoint, "_read_bytes", lambda self, t, e: reads.append(t) or real_read(self, t, e))
    assert main(["convert", str(path), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err  # the progress bar had started: the error is on a line of its own after it
    last = err.strip().splitlines()[-1]
    assert last.startswith("moestream: error:") and "cannot build a tokenizer" in last and "Traceback" not in err, err
    assert len(reads) < len(gguf_source.GGUFCheckpoint(path).tensors)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_convert_takes_the_tokenizer_of_a_directory(qwen3_gguf, tmp_path, capsys, monkeypatch):
    """`--tokenizer DIR`: the store gets DIR's tokenizer files and the GGUF's is not rebuilt (a file whose
    tokenizer transformers cannot build converts); a DIR without tokenizer files is refused at once."""
    from moestream.conversion import gguf_source

    model, path, _ = qwen3_gguf
    checkpoint = save_checkpoint(model, tmp_path / "hf")  # (with the synthetic models' tokenizer files)
    capsys.readouterr()  # (its progress bar)

    def cannot(path, arch):
        raise SourceError("not to be called")

    monkeypatch.setattr(gguf_source, "_build_tokenizer", cannot)
    assert main(["convert", str(path), str(tmp_path / "empty"), "--tokenizer", str(tmp_path)]) == 2
    assert "holds no tokenizer files" in _one_line_error(capsys)
    assert main(["convert", str(path), str(tmp_path / "store"), "--tokenizer", str(checkpoint)]) == 0
    assert (tmp_path / "store" / "tokenizer.json").read_bytes() == (checkpoint / "tokenizer.json").read_bytes()
    streamed, tokenizer = moestream.load(tmp_path / "store", "1GiB")
    assert tokenizer is not None and tokenizer("hi")["input_ids"]
    moestream.close(streamed)


def test_eval_takes_a_gguf_as_its_reference(qwen3_gguf, tmp_path):
    """`eval --reference FILE.gguf` compares a store with the float model the file stands for: its blocks
    dequantized. A store converted from the file in float32 is that model exactly; an int4 one is not."""
    from moestream.tools.quality import compare

    _, path, _ = qwen3_gguf
    text = " ".join(f"the theme {i}: def f(x): return x * {i}" for i in range(40))
    exact = moestream.convert(path, tmp_path / "fp32", "fp32", dense_dtype="float", progress=False)
    report = compare(exact, path, text, max_tokens=96, context=32, memory="1MiB")
    assert report.reference_kind == "gguf" and report.reference_dtype == "float32, dequantized"
    assert report.kl_mean == 0.0 and report.top1_agreement == 1.0
    assert not list(tmp_path.glob(".moestream-eval-reference-*"))  # the temporary store is gone
    small = moestream.convert(path, tmp_path / "int4", "int4", progress=False)
    report = compare(small, path, text, max_tokens=96, context=32, memory="1MiB")
    assert report.kl_mean > 0.0 and report.top1_agreement > 0.5


def test_inspect_shows_each_layers_gguf_types_and_store_format(qwen3_gguf, tmp_path, capsys):
    """The types are read from the file itself (gguf's reader), not from what the converter wrote."""
    from gguf import GGUFReader

    _, path, _ = qwen3_gguf
    store = moestream.convert(path, tmp_path / "int4", "int4", progress=False)
    capsys.readouterr()
    assert main(["inspect", str(store)]) == 0
    out = capsys.readouterr().out
    types = {t.name: t.tensor_type.name for t in GGUFReader(path).tensors}
    layers = CONFIGS["qwen3_moe"]["num_hidden_layers"]
    gate, up, down = (types[f"blk.0.ffn_{p}_exps.weight"] for p in ("gate", "up", "down"))
    line = next(line for line in out.splitlines() if line.strip().startswith(f"layers 0-{layers - 1}"))
    assert f"down_proj {down}, gate_proj {gate}, up_proj {up} -> stored int4-g32" in line, out
    others = [kind for name, kind in types.items() if "_exps." not in name]
    line = next(line for line in out.splitlines() if "other tensors (GGUF)" in line)
    for kind in set(others):
        assert f"{kind} x{others.count(kind)}" in line, (kind, line)


# llama.cpp's 4-bit blocks of 32 (Q4_0, Q4_1, and Q4_K's sub-blocks) in experts and attention; a model
# with rows of 256, which K-quants need.
FOUR_BIT_TYPES = {
    "ffn_gate_exps": Q.Q4_K,
    "ffn_up_exps": Q.Q4_0,
    "ffn_down_exps": Q.Q4_1,
    "attn_q": Q.Q4_K,
    "attn_k": Q.Q4_1,
    "attn_v": Q.Q4_0,
    "attn_output": Q.Q4_K,
    "token_embd": Q.Q8_0,
    "output": Q.Q4_0,
}
WIDE = dict(CONFIGS["qwen3_moe"], hidden_size=256, moe_intermediate_size=256, head_dim=64)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q4_K])
def test_four_bit_blocks_are_codes_with_a_scale_and_zero_per_32_weights(qtype):
    """What gguf_blocks reads from the bytes is the blocks' own decoding (gguf-py's), exactly."""
    g = np.random.default_rng(int(qtype))
    w = (g.standard_normal((24, 512)) * g.random((24, 1)) + g.standard_normal((24, 1)) * 0.1).astype(np.float32)
    raw = random_blocks(w) if qtype == Q.Q4_K else quantize(w, qtype)
    codes, s, z = four_bit_codes(raw, int(qtype), 512)
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 15 and s.shape == z.shape == (24, 16)
    mine = (codes.double().view(24, 16, 32) - 8) * s.double()[..., None] + z.double()[..., None]
    theirs = torch.from_numpy(dequantize(raw, qtype)).double().view(24, 16, 32)
    assert torch.equal(mine, theirs)


def test_q6_k_blocks_decode_as_gguf_py_decodes_them():
    """gguf_blocks.q6_k_decoded (the LM head of K-quant files) gives gguf-py's values bit for bit: random
    codes and scales, fp16 block scales from tiny to large and negative."""
    from moestream.conversion.gguf_blocks import q6_k_decoded

    g = np.random.default_rng(6)
    raw = g.integers(0, 256, (40, 3 * 210), dtype=np.uint8)  # 40 rows of 768 weights
    d = (g.standard_normal((40, 3)) * 10.0 ** g.integers(-6, 3, (40, 3))).astype(np.float16)
    raw.reshape(40, 3, 210)[..., 208:] = d.view(np.uint8).reshape(40, 3, 2)
    theirs = torch.from_numpy(dequantize(raw, Q.Q6_K))
    mine = q6_k_decoded(raw).view(40, 768)
    assert theirs.abs().max() > 0 and torch.equal(mine, theirs)


def test_compiled_q6_k_rows_become_the_int8_torch_makes_of_them(monkeypatch):
    """Q6_K rows made int8 by the compiled kernels in one pass (gguf_blocks.q6_k_int8: the LM head of K-quant
    files) are the codes and scales of quant.quantize on q6_k_decoded's weights, exactly, an all-zero row
    included; without the kernels, or before they are built, there is no answer (torch's path is taken)."""
    from moestream.conversion import gguf_blocks

    ext = fused_build.extension()
    if ext is None:
        pytest.skip("no compiled kernels")
    g = np.random.default_rng(8)
    raw = g.integers(0, 256, (40, 3 * 210), dtype=np.uint8)  # 40 rows of 768 weights
    d = (g.standard_normal((40, 3)) * 10.0 ** g.integers(-6, 3, (40, 3))).astype(np.float16)
    raw.reshape(40, 3, 210)[..., 208:] = d.view(np.uint8).reshape(40, 3, 2)
    raw[7] = 0
    expected = quant.quantize(gguf_blocks.q6_k_decoded(raw).view(40, 768), quant.QuantFormat.make("int8"))
    monkeypatch.setattr(gguf_blocks, "_compiled", ext)
    for portable in (False, True):  # the CPU's SIMD loop where it has one, and the portable loop
        previous = ext.lowbit_isa("portable" if portable else "avx512-vnni")
        try:
            codes, scales = gguf_blocks.q6_k_int8(raw, 768)
        finally:
            ext.lowbit_isa(previous)
        assert codes.dtype == torch.int8 and codes.abs().max() == 127 and codes[7].abs().max() == 0
        assert torch.equal(codes, expected.codes) and torch.equal(scales, expected.scales), portable
    monkeypatch.setattr(gguf_blocks, "_compiled", _NotBuilt())
    assert gguf_blocks.q6_k_int8(raw, 768) is None
    monkeypatch.setattr(gguf_blocks, "_compiled", None)
    assert gguf_blocks.q6_k_int8(raw, 768) is None


def test_compiled_q6_k_rows_become_the_int4_torch_makes_of_them(monkeypatch):
    """Q6_K rows made int4 in groups of 32 by the compiled kernels (gguf_blocks.q6_k_int4: Q4_K_M's Q6_K down
    projections in an int4 layer) are the codes, scales and zeros of quant.quantize on q6_k_decoded's weights,
    exactly, on the SIMD and the portable loop, an all-zero row included."""
    from moestream.conversion import gguf_blocks

    ext = fused_build.extension()
    if ext is None:
        pytest.skip("no compiled kernels")
    g = np.random.default_rng(9)
    raw = g.integers(0, 256, (40, 3 * 210), dtype=np.uint8)
    d = (g.standard_normal((40, 3)) * 10.0 ** g.integers(-6, 3, (40, 3))).astype(np.float16)
    raw.reshape(40, 3, 210)[..., 208:] = d.view(np.uint8).reshape(40, 3, 2)
    raw[5] = 0
    fmt = quant.QuantFormat.make("int4", 32)
    expected = quant.pack(quant.quantize(gguf_blocks.q6_k_decoded(raw).view(40, 768), fmt), fmt, "w")
    monkeypatch.setattr(gguf_blocks, "_compiled", ext)
    for portable in (False, True):
        previous = ext.lowbit_isa("portable" if portable else "avx512-vnni")
        try:
            nibbles, s, z = gguf_blocks.q6_k_int4(raw, 768)
        finally:
            ext.lowbit_isa(previous)
        got = quant.int4_parts("w", nibbles, s.to(torch.bfloat16), z.to(torch.bfloat16))
        assert torch.equal(got["w.qweight"], expected["w.qweight"]), portable
        assert torch.equal(got["w.scales_zeros"], expected["w.scales_zeros"]), portable
    monkeypatch.setattr(gguf_blocks, "_compiled", None)
    assert gguf_blocks.q6_k_int4(raw, 768) is None


def test_a_q4_k_m_file_is_the_same_store_with_compiled_kernels(tmp_path, monkeypatch):
    """A file of Q4_K_M's types (a Q6_K LM head, Q4_K gate and up, Q6_K down: an int4 layer) converts to the
    same bytes with the compiled kernels handed over (the downs made int4 in one pass, the 4-bit codes
    re-paired in C++; the head at its blocks' 6 bits: int6, or int8 where its rows are not a multiple of
    16, as here) as with torch and numpy alone: identical manifests, checksums of every file and record
    included."""
    from moestream.conversion import gguf_blocks

    ext = fused_build.extension()
    if ext is None:
        pytest.skip("no compiled kernels")
    model = make_model("qwen3_moe", seed=19, **WIDE)
    types = {**TYPES, "output": Q.Q6_K, "ffn_gate_exps": Q.Q4_K, "ffn_up_exps": Q.Q4_K, "ffn_down_exps": Q.Q6_K}
    write_gguf(model, tmp_path / "m.gguf", types=types)  # Q4_K_M's experts: an int4 layer, its down requantized
    calls = []

    class Counting:
        def repair_nibbles(self, *args):
            calls.append("repair")
            return ext.repair_nibbles(*args)

        def q6_k_int8(self, *args):
            calls.append("q6_k")
            return ext.q6_k_int8(*args)

        def q6_k_int4(self, *args):
            calls.append("q6_k int4")
            return ext.q6_k_int4(*args)

    manifests = []
    for kernels in (None, Counting()):
        monkeypatch.setattr(gguf_blocks, "_compiled", kernels)
        store = moestream.convert(tmp_path / "m.gguf", tmp_path / f"store-{len(manifests)}", progress=False)
        assert Store(store).manifest.dense["lm_head"] == quant.QuantFormat.make("int6" if VOCAB % 16 == 0 else "int8", 64)
        assert all(layer.quantization.name == "int4" for layer in Store(store).manifest.layers)
        manifests.append((store / "manifest.json").read_text().replace("store-1", "store-0"))
    assert manifests[0] == manifests[1] and {"repair", "q6_k int4"} <= set(calls)


def test_six_bit_blocks_become_int6_in_groups_of_64(tmp_path):
    """Q6_K experts and Q5_0 attention (5 and 6 bits: nearer int6 than int4 or int8) are stored int6 in
    groups of 64 (6.5 bits a weight), re-quantized from the file's values: the model computes what
    transformers computes on those int6 values, with float activations (each matrix dequantized) and with
    int8 ones (the kernels)."""
    model = make_model("qwen3_moe", seed=23, **WIDE)
    six_bits = {"ffn_gate_exps": Q.Q6_K, "ffn_up_exps": Q.Q6_K, "ffn_down_exps": Q.Q6_K, "attn_q": Q.Q5_0}
    floats = {"attn_k": Q.F16, "token_embd": Q.F16, "output": Q.F16}  # the rest float: a random model amplifies any rounding
    types = {**TYPES, **six_bits, **floats}
    decoded = write_gguf(model, tmp_path / "m.gguf", types=types)
    store = moestream.convert(tmp_path / "m.gguf", tmp_path / "store", progress=False)
    manifest = Store(store).manifest
    six = quant.QuantFormat.make("int6", 64)
    assert all(layer.quantization == six for layer in manifest.layers)
    assert manifest.dense["model.layers.0.self_attn.q_proj"] == six

    def as_int6(value):  # groups run along each row's inputs, so an experts tensor can be taken as rows
        w = torch.from_numpy(np.ascontiguousarray(value))
        return quant.reference_dequantize(quant.quantize(w.reshape(-1, w.shape[-1]), six), six).float().view(w.shape).numpy()

    six_values = {name: as_int6(v) for name, v in decoded.items() if ".experts." in name or name.endswith("q_proj.weight")}
    reference = _reference("qwen3_moe", decoded, torch.bfloat16, WIDE)
    with torch.no_grad():  # the int6 values as they are (_reference rounds resident float weights to bf16)
        for name, value in six_values.items():
            reference.state_dict()[name].copy_(torch.from_numpy(value))
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = reference(ids).logits
        for activations, tolerance in (("float", 1e-4), ("int8", 5e-2)):
            streamed, _ = moestream.load(store, "64MiB", compute_dtype="fp32", activations=activations)
            got = streamed(ids).logits
            assert ((got - expected).norm() / expected.norm()).item() <= tolerance, activations


@pytest.mark.parametrize("qtype", [Q.MXFP4, Q.IQ4_NL, Q.IQ4_XS])
def test_table_blocks_are_codes_with_a_scale_per_32_weights(qtype):
    """What gguf_blocks reads from MXFP4/IQ4 blocks (codes into the table format's values, a float32 scale per
    32) is gguf-py's decoding, exactly."""
    from moestream.conversion.gguf_blocks import table_nibbles, table_of

    g = np.random.default_rng(int(qtype))
    w = (g.standard_normal((24, 512)) * g.random((24, 1))).astype(np.float32)
    raw = quantize(w, qtype) if qtype == Q.MXFP4 else random_blocks(w, qtype)
    nibbles, s = table_nibbles(raw, int(qtype), 512)
    values = torch.tensor(quant.TABLES[table_of(int(qtype))], dtype=torch.float64)
    mine = values[unpack_nibbles(nibbles).long()].view(24, 16, 32) * s.double()[..., None]
    theirs = torch.from_numpy(dequantize(raw, qtype)).double().view(24, 16, 32)
    assert theirs.abs().max() > 0 and torch.equal(mine, theirs)


class _NotBuilt:
    """Compiled kernels handed over but not built yet: each reader answers None."""

    def repair_nibbles(self, *args):
        return None

    def q6_k_int8(self, *args):
        return None

    def q6_k_int4(self, *args):
        return None


def test_compiled_nibble_repairing_gives_numpys_bytes(tmp_path, monkeypatch):
    """The convert command hands gguf_blocks the compiled re-pairing where the kernels are built already:
    the same portable bytes as numpy's for every 4-bit block type; where they are not built, nothing is
    built for it (`load_if_built`)."""
    from moestream.conversion import gguf_blocks
    from moestream.conversion.gguf_blocks import four_bit_nibbles, table_nibbles

    ext = fused_build.extension()
    if ext is None:
        pytest.skip("no compiled kernels")
    g = np.random.default_rng(5)
    for qtype, per, weights in [
        (Q.Q4_0, 18, 32),
        (Q.Q4_1, 20, 32),
        (Q.Q4_K, 144, 256),
        (Q.MXFP4, 17, 32),
        (Q.IQ4_NL, 18, 32),
        (Q.IQ4_XS, 136, 256),
    ]:
        raw = g.integers(0, 256, (24, 512 // weights * per), dtype=np.uint8)  # random bytes: some scales NaN
        read = four_bit_nibbles if qtype in (Q.Q4_0, Q.Q4_1, Q.Q4_K) else table_nibbles
        with np.errstate(invalid="ignore", over="ignore"):  # the codes' bytes do not depend on the scales
            monkeypatch.setattr(gguf_blocks, "_compiled", None)
            numpy_bytes = read(raw, int(qtype), 512)[0]
            monkeypatch.setattr(gguf_blocks, "_compiled", ext)
            assert torch.equal(read(raw, int(qtype), 512)[0], numpy_bytes), qtype.name
            monkeypatch.setattr(gguf_blocks, "_compiled", _NotBuilt())  # not built yet: numpy's
            assert torch.equal(read(raw, int(qtype), 512)[0], numpy_bytes), qtype.name
    assert fused_build.load_if_built() is ext
    monkeypatch.setattr(fused_build, "_loaded", {})
    monkeypatch.setattr(fused_build, "cache_directory", lambda: tmp_path / "empty")
    assert fused_build.load_if_built() is None and not (tmp_path / "empty").exists()


def test_the_convert_command_uses_the_compiled_kernels_where_they_pay(tmp_path, monkeypatch):
    """Built kernels: the re-pairing is theirs from the first record. Not built: a small file keeps numpy's
    and builds nothing; a large one starts the build in the background and takes the kernels once built."""
    from moestream.commands import convert as command
    from moestream.conversion import gguf_blocks

    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF" + bytes(60))
    monkeypatch.setattr(gguf_blocks, "_compiled", None)  # restored after the test
    started = []
    monkeypatch.setattr(fused_build, "start", lambda: started.append(True))
    ext = fused_build.extension()
    if ext is not None:
        command._use_compiled_kernels(path)
        blocks = torch.randint(0, 256, (4, 18), dtype=torch.uint8)
        assert (
            torch.equal(gguf_blocks._compiled.repair_nibbles(blocks, 2, 1, 16), ext.repair_nibbles(blocks, 2, 1, 16))
            and not started
        )
    built = []
    monkeypatch.setattr(fused_build, "load_if_built", lambda: built[0] if built else None)
    monkeypatch.setattr(gguf_blocks, "_compiled", None)
    command._use_compiled_kernels(path)  # small, not built
    assert gguf_blocks._compiled is None and not started
    monkeypatch.setattr(command, "BACKGROUND_BUILD_BYTES", 0)
    command._use_compiled_kernels(path)  # large, not built: a build in the background, numpy's until it ends
    assert started and gguf_blocks._compiled.repair_nibbles(torch.zeros(1, 18, dtype=torch.uint8), 2, 1, 16) is None
    if ext is not None:
        built.append(ext)
        monkeypatch.setattr(gguf_blocks._compiled, "looked", float("-inf"))  # a second later
        assert gguf_blocks._compiled.repair_nibbles(torch.zeros(1, 18, dtype=torch.uint8), 2, 1, 16) is not None


def test_iq4_experts_keep_their_codes(tmp_path):
    """Experts of IQ4_XS gate and up and IQ4_NL down blocks (as llama.cpp's IQ4_XS preset writes them where
    rows are shorter than 256) are stored with no options as iq4nl: the file's codes, each block's scale
    rounded to bf16 (the one loss), and the model streams transformers' forward on those weights."""
    model = make_model("qwen3_moe", seed=21, **WIDE)
    types = {**TYPES, "ffn_gate_exps": Q.IQ4_XS, "ffn_up_exps": Q.IQ4_XS, "ffn_down_exps": Q.IQ4_NL}
    decoded = write_gguf(model, tmp_path / "m.gguf", types=types)
    store = moestream.convert(tmp_path / "m.gguf", tmp_path / "store", dense_dtype="float", progress=False)
    assert Store(store).manifest.experts_dtype == "iq4nl-g32"
    fmt = QuantFormat.make("iq4nl")
    held = dict(decoded)
    records = _records_of(store)
    for layer in range(WIDE["num_hidden_layers"]):
        experts = f"model.layers.{layer}.mlp.experts"
        for proj in ("gate_up_proj", "down_proj"):
            held[f"{experts}.{proj}"] = held[f"{experts}.{proj}"].copy()
            for e in range(WIDE["num_experts"]):
                sz = records[(experts, e, f"{proj}.scales_zeros")]
                q = Quantized(stored_codes(records[(experts, e, f"{proj}.qweight")], fmt), sz[..., 0].t(), sz[..., 1].t())
                mine = reference_dequantize(q, fmt)
                file_values = torch.from_numpy(decoded[f"{experts}.{proj}"][e]).double()
                # the same codes: equal up to each block's scale rounded to bf16 (2^-9 of it)
                assert ((mine - file_values).abs() <= file_values.abs() * 2**-8 + 1e-12).all()
                held[f"{experts}.{proj}"][e] = mine.float().numpy()
    assert _logits_error(store, held, seed=3) <= 1e-5


def _logits_error(store, weights: dict, seed: int) -> float:
    """The relative error of the store's streamed logits (float32, float activations) against transformers'
    WIDE qwen3_moe on `weights` (resident ones rounded to bf16), on fresh random tokens."""
    reference = _reference("qwen3_moe", weights, torch.bfloat16, WIDE)
    streamed, _ = moestream.load(store, "1MiB", compute_dtype="fp32", activations="float")
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        expected, got = reference(ids).logits, streamed(ids).logits
    return ((got - expected).norm() / expected.norm()).item()


def _records_of(store) -> dict[tuple[str, int, str], torch.Tensor]:
    """Every tensor of every expert record, read back from the store files."""
    out = {}
    for layer in Store(store).manifest.layers:
        data = (store / layer.file).read_bytes()
        for e, off in enumerate(layer.offsets):
            for t in layer.layout.tensors:
                raw = bytearray(data[off + t.offset : off + t.offset + t.nbytes])
                out[(layer.module, e, t.name)] = torch.frombuffer(raw, dtype=DTYPES[t.dtype]).view(t.shape)
    return out


def _resident(store) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in Store(store).manifest.resident_files:
        out.update(load_file(store / f.path))
    return out


def test_a_gguf_of_4_bit_blocks_keeps_their_codes(tmp_path):
    """Converted to int4 in groups of 32, experts and attention layers of Q4_0/Q4_1/Q4_K hold the file's
    codes, and the blocks' scales and zeros rounded to bf16: nothing is quantized again."""
    model = make_model("qwen3_moe", seed=13, **WIDE)
    path = tmp_path / "q4.gguf"
    decoded = write_gguf(model, path, types=FOUR_BIT_TYPES)
    store = moestream.convert(path, tmp_path / "store", "int4", group_size=32, dense_dtype="int4", progress=False)
    fmt = QuantFormat.make("int4", 32)
    # What the options ask for here is the default for these blocks; the experts within 25% of the file's.
    default = Store(moestream.convert(path, tmp_path / "default", progress=False)).manifest
    chosen = Store(store).manifest
    assert [layer.checksums for layer in default.layers] == [layer.checksums for layer in chosen.layers]
    assert default.resident_files == chosen.resident_files
    gguf_expert_bytes = sum(t.n_bytes for t in GGUFReader(path).tensors if "_exps" in t.name)
    assert sum(layer.layout.nbytes * len(layer.offsets) for layer in chosen.layers) <= 1.25 * gguf_expert_bytes
    reader = GGUFReader(path)
    blocks = {t.name: (int(t.tensor_type), np.array(t.data)) for t in reader.tensors}

    def check(stored_codes_, scales_zeros, gguf_names, rows_of, weights, requantized_worse: bool):
        """Codes equal the file's blocks'; each weight within the bf16 rounding of its scale and zero."""
        file_codes = torch.cat([four_bit_codes(rows_of(blocks[n][1]), blocks[n][0], weights.shape[1])[0] for n in gguf_names])
        assert torch.equal(stored_codes_, file_codes)
        q = Quantized(stored_codes_, scales_zeros[..., 0].t(), scales_zeros[..., 1].t())
        w = torch.from_numpy(np.ascontiguousarray(weights)).double()
        error = (reference_dequantize(q, fmt) - w).abs().view(w.shape[0], -1, 32)
        s, z = q.scales.double()[..., None], q.offsets.double()[..., None]
        assert (error <= ((file_codes.double().view_as(error) - 8).abs() * s.abs() + z.abs()) * 2**-8 + 1e-12).all()
        if requantized_worse:  # Q4_0's symmetric grid is not the spread one a re-rounding makes
            again = (reference_dequantize(quant.quantize(w.float(), fmt), fmt) - w).abs()
            assert error.mean() * 10 < again.mean()

    records = {(layer, e, name): t for (layer, e, name), t in _records_of(store).items()}
    for layer in range(WIDE["num_hidden_layers"]):
        experts = f"model.layers.{layer}.mlp.experts"
        for e in range(WIDE["num_experts"]):
            for proj, names in (("gate_up_proj", ("ffn_gate_exps", "ffn_up_exps")), ("down_proj", ("ffn_down_exps",))):
                check(
                    stored_codes(records[(experts, e, f"{proj}.qweight")], fmt),
                    records[(experts, e, f"{proj}.scales_zeros")],
                    [f"blk.{layer}.{n}.weight" for n in names],
                    lambda raw, e=e: raw[e],
                    decoded[f"{experts}.{proj}"][e],
                    requantized_worse=False,
                )
    resident = _resident(store)
    for proj, gguf in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"), ("o_proj", "attn_output")):
        module = f"model.layers.1.self_attn.{proj}"
        check(
            stored_codes(resident[f"{module}.qweight"], fmt),
            resident[f"{module}.scales_zeros"],
            [f"blk.1.{gguf}.weight"],
            lambda raw: raw,
            decoded[f"{module}.weight"],
            requantized_worse=gguf == "attn_v",
        )

    # The streamed model is the file's float model up to those roundings, the LM head's re-quantization to
    # int8 and the int4 kernels' arithmetic (about 1e-2 here); a projection or a row out of place would be
    # off by the size of the logits themselves.
    assert _logits_error(store, decoded, seed=8) <= 5e-2


@pytest.mark.parametrize("dense_dtype", ["float", "int8", "int4"])
def test_resident_matrices_read_a_slice_of_rows_at_a_time_are_stored_as_read_whole(
    qwen3_gguf, tmp_path, monkeypatch, dense_dtype
):
    """A GGUF's resident matrices are decoded, quantized and written a few rows at a time (the converter's
    memory stays bounded): the store's tensors equal those of a conversion that reads each matrix whole."""
    _, path, _ = qwen3_gguf
    whole = moestream.convert(path, tmp_path / "whole", "int4", group_size=32, dense_dtype=dense_dtype, progress=False)
    monkeypatch.setattr(sys.modules["moestream.conversion.convert"], "RESIDENT_SLICE_BYTES", 3 * 4 * 32)  # 3 rows
    read_rows = GGUFCheckpoint.read_rows
    slices = []
    monkeypatch.setattr(GGUFCheckpoint, "read_rows", lambda self, *a: slices.append(a) or read_rows(self, *a))
    sliced = moestream.convert(path, tmp_path / "sliced", "int4", group_size=32, dense_dtype=dense_dtype, progress=False)
    assert len(slices) > 20 and any(a[-1] - a[-2] < 3 for a in slices)  # many slices, ragged last ones
    expected, got = _resident(whole), _resident(sliced)
    assert set(expected) == set(got) and all(torch.equal(expected[k], got[k]) for k in expected)
    assert Store(sliced).manifest.resident_files == Store(whole).manifest.resident_files  # same bytes, same checksums


def test_the_header_reader_agrees_with_gguf_py(qwen3_gguf, tmp_path):
    """conversion/gguf_header.py reads what gguf-py's GGUFReader reads: every metadata value (a long array
    as its length) and every tensor's type, shape and offset; a header cut anywhere is a ValueError."""
    from gguf import GGUFValueType

    from moestream.conversion.gguf_header import LONG_ARRAY, read_header

    _, path, _ = qwen3_gguf
    writer = GGUFWriter(tmp_path / "long.gguf", "qwen3moe")
    writer.add_array("test.long_strings", [f"token {i}" for i in range(LONG_ARRAY + 7)])
    writer.add_array("test.long_numbers", list(range(LONG_ARRAY + 3)))
    writer.add_float64("test.double", 0.1)
    writer.add_bool("test.flag", True)
    writer.add_tensor("t", np.arange(64, dtype=np.float32).reshape(2, 32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for file in (path, tmp_path / "long.gguf"):
        reader = GGUFReader(file)
        expected = {
            k: len(f.data) if f.types[0] == GGUFValueType.ARRAY and len(f.data) > LONG_ARRAY else f.contents()
            for k, f in reader.fields.items()
            if not k.startswith("GGUF.")  # (the reader's own entries for the header's counts)
        }
        table = [(t.name, int(t.tensor_type), tuple(reversed(t.shape.tolist())), int(t.data_offset)) for t in reader.tensors]
        metadata, got = read_header(file)
        assert metadata == expected and got == table
    assert metadata["test.long_strings"] == LONG_ARRAY + 7 and metadata["test.long_numbers"] == LONG_ARRAY + 3
    data = (tmp_path / "long.gguf").read_bytes()
    for cut in (10, 30, len(data) // 3, len(data) - 300):
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        with pytest.raises(ValueError):
            read_header(tmp_path / "cut.gguf")


def test_a_gpt_oss_gguf_of_mxfp4_experts_keeps_them_exactly(tmp_path, capsys):
    """gpt-oss's MXFP4 experts (e2m1 values, a power-of-two scale per 32) are stored with no options in the
    mxfp4 table format: each record holds the file's codes and scales, so its weights are the file's exactly
    (float64), gate and up rows interleaved as the model has them, within 25% of the file's size; `inspect`
    names both. The streamed model is transformers' on the file's decoded weights, with float activations
    to float32 rounding, with int8 ones as closely as int8 activations allow, and every budget decodes the
    same. `--experts-dtype int4` still re-quantizes them."""
    model = make_model("gpt_oss", seed=14, **CONFIGS["gpt_oss"])
    path = tmp_path / "gpt-oss-mxfp4.gguf"
    decoded = write_gguf(model, path)
    store = moestream.convert(path, tmp_path / "store", dense_dtype="float", progress=False)
    manifest = Store(store).manifest
    fmt = QuantFormat.make("mxfp4")
    assert manifest.experts_dtype == "mxfp4-g32"
    records = _records_of(store)
    gguf_weight_bytes = sum(t.n_bytes for t in GGUFReader(path).tensors if "_exps.weight" in t.name)
    assert (
        sum(t.numel() * t.element_size() for key, t in records.items() if not key[2].endswith("_bias"))
        <= 1.25 * gguf_weight_bytes
    )
    for layer in range(CONFIGS["gpt_oss"]["num_hidden_layers"]):
        experts = f"model.layers.{layer}.mlp.experts"
        for e in range(CONFIGS["gpt_oss"]["num_local_experts"]):
            for proj in ("gate_up_proj", "down_proj"):
                sz = records[(experts, e, f"{proj}.scales_zeros")]
                held = Quantized(stored_codes(records[(experts, e, f"{proj}.qweight")], fmt), sz[..., 0].t(), sz[..., 1].t())
                file_values = torch.from_numpy(np.ascontiguousarray(decoded[f"{experts}.{proj}"][e].T)).double()
                assert torch.equal(reference_dequantize(held, fmt), file_values), (layer, e, proj)

    capsys.readouterr()
    assert main(["inspect", str(store)]) == 0
    out = capsys.readouterr().out
    assert "GGUF down_proj MXFP4, gate_proj MXFP4, up_proj MXFP4 -> stored mxfp4-g32" in out, out

    reference = _reference("gpt_oss", decoded, torch.bfloat16)
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        expected = reference(ids).logits
    greedy = []
    for budget in ("8KiB", "1MiB"):
        streamed, _ = moestream.load(store, budget, compute_dtype="fp32", activations="float")
        with torch.no_grad():
            got = streamed(ids).logits
            greedy.append(streamed.generate(ids, max_new_tokens=6, do_sample=False)[0].tolist())
        assert ((got - expected).norm() / expected.norm()).item() <= 1e-5
    assert greedy[0] == greedy[1]
    if fused_build.extension() is not None:
        streamed, _ = moestream.load(store, "1MiB", compute_dtype="fp32", activations="int8")
        with torch.no_grad():
            got = streamed(ids).logits
        assert ((got - expected).norm() / expected.norm()).item() <= 2e-2
    requantized = Store(moestream.convert(path, tmp_path / "int4", "int4", progress=False)).manifest
    assert requantized.experts_dtype == "int4-g32"


def test_deepseek2_files_map_to_v2_or_v3_by_their_gating(tmp_path):
    """llama.cpp's deepseek2 files hold DeepSeek-V2/V2.5 (softmax gating, or no gating key at all) and V3/R1
    (sigmoid): each becomes its own transformers model, V2's grouped routing its group-limited top-k; a
    softmax file that normalizes its top-k weights, or another gating function, is refused by name."""
    from moestream.conversion.gguf_source import _deepseek2_config

    base = {
        "expert_feed_forward_length": 32, "feed_forward_length": 64, "rope.dimension_count": 8,
        "attention.key_length_mla": 24, "attention.value_length_mla": 16, "attention.kv_lora_rank": 32,
    }  # fmt: skip

    def config(**metadata):
        md = {**base, **metadata}

        def key(name, default=KeyError):
            if name not in md and default is KeyError:
                raise KeyError(name)
            return md.get(name, default)

        return _deepseek2_config(key, {}, tmp_path / "f.gguf", experts=8, layers=2)

    v2 = config()  # a V2 file: no gating key
    assert v2["model_type"] == "deepseek_v2" and v2["topk_method"] == "greedy" and "rope_interleave" not in v2
    grouped = config(expert_gating_func=1, expert_group_count=4, expert_group_used_count=2)
    assert grouped["model_type"] == "deepseek_v2" and grouped["topk_method"] == "group_limited_greedy"
    assert (grouped["n_group"], grouped["topk_group"]) == (4, 2)
    v3 = config(expert_gating_func=2, expert_weights_norm=True)
    assert v3["model_type"] == "deepseek_v3" and v3["norm_topk_prob"] and v3["rope_interleave"]
    with pytest.raises(SourceError, match="normalizes the top-k weights"):
        config(expert_gating_func=1, expert_weights_norm=True)
    with pytest.raises(SourceError, match="gating function 3"):
        config(expert_gating_func=3)


@pytest.mark.parametrize(
    "qtype, stored",
    [
        (Q.Q4_0, ("int4", 32)),
        (Q.Q4_K, ("int4", 32)),
        (Q.Q2_K, ("int4", 32)),
        (Q.Q5_0, ("int8", None)),
        (Q.Q6_K, ("int8", None)),
        (Q.Q8_0, ("int8", None)),
        (Q.IQ4_NL, ("iq4nl", 32)),
    ],
)
def test_a_quantized_token_embedding_stays_quantized(tmp_path, qtype, stored, capsys):
    """A GGUF's token embedding in blocks is stored in the narrowest dense format holding their code bits
    (not a bf16 copy two to six times their size): Q4_0/Q4_K as their int4 codes with bf16 scales and
    zeros, IQ4_NL as its codes in the iq4nl table format, Q2_K quantized to int4 in groups of 32, Q5_0, Q6_K
    and Q8_0 to int8 by rows, each within its rounding of the file's values; rows are looked up as the
    format defines them (float64 definition, exactly in float32), and the model streams what it streams
    with a float table of those values.
    `--dense-dtype float` keeps it float."""
    model = make_model("qwen3_moe", seed=17, **WIDE)
    decoded = write_gguf(model, tmp_path / "m.gguf", types={**TYPES, "token_embd": qtype})
    store = moestream.convert(tmp_path / "m.gguf", tmp_path / "store", "fp32", progress=False)
    fmt = Store(store).manifest.dense["model.embed_tokens"]
    assert (fmt.name, fmt.group_size) == stored
    parts = _resident(store)
    file_values = torch.from_numpy(decoded["model.embed_tokens.weight"])
    if fmt.name == "int8":
        scales = parts["model.embed_tokens.scales"]
        embedding = reference_dequantize(Quantized(parts["model.embed_tokens.qweight"], scales, None), fmt).float()
        assert ((embedding - file_values).abs() <= scales[:, None] * 0.5001).all()  # half a step of its row
    else:
        codes = stored_codes(parts["model.embed_tokens.qweight"], fmt)
        sz = parts["model.embed_tokens.scales_zeros"]
        embedding = reference_dequantize(Quantized(codes, sz[..., 0].t(), sz[..., 1].t()), fmt).float()
        if qtype in (Q.Q4_0, Q.Q4_K):  # the file's codes, their scales and zeros rounded to bf16
            raw = np.array(next(t.data for t in GGUFReader(tmp_path / "m.gguf").tensors if t.name == "token_embd.weight"))
            assert torch.equal(codes, four_bit_codes(raw.reshape(codes.shape[0], -1), int(qtype), codes.shape[1])[0])
            assert (embedding - file_values).abs().max() < 0.05
        elif fmt.table is not None:  # the file's codes: its values up to each block's scale rounded to bf16
            assert ((embedding - file_values).abs() <= file_values.abs() * 2**-8 + 1e-12).all()
        else:  # half a step of its group, give or take the bf16 rounding of the step and the zero
            s, z = (p.t().float().repeat_interleave(fmt.group_size, dim=1) for p in sz.unbind(-1))
            assert ((embedding - file_values).abs() <= s * 0.51 + z.abs() * 2**-8).all()
            assert (embedding - file_values).abs().max() > 0  # not the file's grid: re-rounded

    # The same store, its embedding's lookup replaced by a float table of exactly those values: the same logits.
    streamed, _ = moestream.load(store, "4MiB", compute_dtype="fp32")
    looked_up, _ = moestream.load(store, "4MiB", compute_dtype="fp32")
    assert type(streamed.get_input_embeddings()).__name__ == "QuantizedEmbedding"
    looked_up.get_input_embeddings().forward = lambda ids: torch.nn.functional.embedding(ids, embedding)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(streamed.get_input_embeddings()(ids), embedding[ids])
        expected, got = looked_up(ids).logits, streamed(ids).logits
    assert torch.equal(got, expected)
    # a server's KV tier is for the compute dtype's KV (`serve` once stopped here: the embedding has no weight)
    tier = tier_for(streamed, tmp_path / "kv", 2**20)
    assert tier.ident["kv"] == "float32"
    tier.flush()
    capsys.readouterr()
    assert main(["inspect", str(store)]) == 0
    assert f"the token embedding {fmt.name}" in capsys.readouterr().out
    floats = Store(moestream.convert(tmp_path / "m.gguf", tmp_path / "float", "fp32", dense_dtype="float", progress=False))
    assert "model.embed_tokens" not in floats.manifest.dense


# Experts 96 wide: their down projections' rows are a multiple of 32 but not of 64 or 256, so llama.cpp stores
# them in blocks of 32 (a Q4_K_M file's Q6_K downs fall back to Q8_0), beside gate and up projections whose
# 256-wide rows take K-quants (a multiple of 256, not of 512).
NARROW = dict(CONFIGS["qwen3_moe"], hidden_size=256, moe_intermediate_size=96, head_dim=64)


@pytest.mark.parametrize(
    "gate_up,down",
    [(k, Q.Q8_0) for k in (Q.Q4_K, Q.Q2_K, Q.Q6_K, Q.IQ4_XS)]
    + [(Q.Q4_K, d) for d in (Q.Q5_0, Q.Q5_1, Q.Q4_0, Q.Q4_1, Q.IQ4_NL, Q.F16)],
)
def test_a_gguf_whose_widths_take_only_small_blocks_converts_with_no_options(gate_up, down, tmp_path):
    """No option given: where the format or group the converter picks for a layer cannot take its matrices
    (int6's 64s against 96 inputs), it takes one that can (a smaller group, else int8), and the model computes
    what transformers computes on the file's values, within that format's rounding."""
    model = make_model("qwen3_moe", seed=31, **NARROW)
    types = {**TYPES, "ffn_gate_exps": gate_up, "ffn_up_exps": gate_up, "ffn_down_exps": down}
    types.update(attn_k=Q.F16, token_embd=Q.F16, output=Q.F16)
    decoded = write_gguf(model, tmp_path / "m.gguf", types=types)
    store = moestream.convert(tmp_path / "m.gguf", tmp_path / "store", progress=False)
    formats = {layer.quantization for layer in Store(store).manifest.layers}
    assert all(f is None or (f.group_size or 32) == 32 for f in formats), formats  # groups that divide 96
    if (gate_up, down) == (Q.Q4_K, Q.Q8_0):  # 5.8 bits a weight: int6, which stores 64s, gives way to int8
        assert formats == {QuantFormat.make("int8")}
        with pytest.raises(UsageError, match="96 inputs"):  # where the user asked for int6, the error stands
            moestream.convert(tmp_path / "m.gguf", tmp_path / "asked", experts_dtype="int6", progress=False)
    reference = _reference("qwen3_moe", decoded, torch.bfloat16, NARROW)
    streamed, _ = moestream.load(store, "1MiB", compute_dtype="fp32", activations="float")
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected, got = reference(ids).logits, streamed(ids).logits
    assert ((got - expected).norm() / expected.norm()).item() <= 0.1  # (int4 of 5-bit blocks: ~6%)
