"""A llama.cpp GGUF file as a checkpoint the converter reads: Hugging Face tensor names, one tensor (or one
expert) at a time, dequantized to float.

`GGUFCheckpoint` has the interface of `source.DecodedCheckpoint` (keys / dtype / read / close), plus:
- `config`: the transformers config rebuilt from the GGUF metadata (llama.cpp's key names);
- `write_extra_files(dir)`: the tokenizer transformers builds from the GGUF metadata, saved there.

Names. llama.cpp merges each layer's experts into one 3D tensor (`blk.N.ffn_gate_exps`, [E, rows, cols]);
here every expert appears under its Hugging Face checkpoint name (`model.layers.N.mlp.experts.E.gate_proj
.weight`, Mixtral's `block_sparse_moe.experts.E.w1.weight`), so the converter fuses them with transformers'
own conversion mapping exactly as it does for a safetensors checkpoint. An expert's rows are contiguous in
the file whatever the block type (a block never spans two rows), so reading one expert reads only its bytes.

Values. Block-quantized tensors (Q4_0, Q8_0, Q4_K, ...) are decoded with `gguf.quants.dequantize` into
float32, a bounded number of rows at a time; F32/F16/BF16 tensors keep their dtype. 4-bit blocks of 32
(Q4_0, Q4_1, Q4_K) can instead be read as int4 codes with their scales and zeros (`read_int4`,
gguf_blocks.py), for a store that keeps them; a big matrix can be read a slice of rows at a time
(`read_rows`). llama.cpp permutes the
rows of the query and key projections of llama-family models (its rotary layout); that is undone here the
way transformers' GGUF loader does (`LlamaTensorProcessor`). Qwen models are stored unpermuted.

Bytes are read with `pread` and dropped from the page cache afterwards, like the safetensors reader; the
header is read by gguf_header.py (gguf-py's reader builds every string of a vocabulary, which takes
seconds), and the block types' sizes and decoders are gguf-py's.

Split files (`name-00001-of-00003.gguf`, gguf-split / GGUFWriter's sharding) are read as one checkpoint.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import SourceError
from . import gguf_blocks
from .gguf_header import read_header
from .source import OpenFiles, _pread_exact

# llama.cpp architecture -> (transformers model_type, what it is)
SUPPORTED_ARCHITECTURES = {
    "qwen3moe": ("qwen3_moe", "Qwen3-MoE"),
    "qwen2moe": ("qwen2_moe", "Qwen1.5/Qwen2-MoE"),
    "llama": ("mixtral", "Mixtral: llama with experts"),
    "deepseek2": ("deepseek_v3", "DeepSeek-V2/V3/R1 and models built on them"),  # softmax-routed files: deepseek_v2
    "gpt-oss": ("gpt_oss", "gpt-oss"),
}
_DEQUANT_ELEMENTS = 1 << 24  # rows decoded per step: bounds gguf's numpy temporaries to a few times 64 MiB
_SPLIT = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")

# Top-level tensors, then per-layer ones (`blk.N.<leaf>.weight|bias`), llama.cpp name -> HF checkpoint name.
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_ATTENTION = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
}
_QWEN_LAYER = {
    **_ATTENTION,
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate": "mlp.gate_proj",  # a dense layer (Qwen3-MoE's mlp_only_layers)
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_QWEN_EXPERTS = {
    "ffn_gate_exps": "mlp.experts.{e}.gate_proj",
    "ffn_up_exps": "mlp.experts.{e}.up_proj",
    "ffn_down_exps": "mlp.experts.{e}.down_proj",
}
_MIXTRAL_LAYER = {**_ATTENTION, "ffn_gate_inp": "block_sparse_moe.gate"}
_MIXTRAL_EXPERTS = {
    "ffn_gate_exps": "block_sparse_moe.experts.{e}.w1",
    "ffn_down_exps": "block_sparse_moe.experts.{e}.w2",
    "ffn_up_exps": "block_sparse_moe.experts.{e}.w3",
}
# Files written before llama.cpp merged experts (early 2024 Mixtral GGUFs) hold one tensor per expert.
_MIXTRAL_EXPERT = {
    "ffn_gate": "block_sparse_moe.experts.{e}.w1",
    "ffn_down": "block_sparse_moe.experts.{e}.w2",
    "ffn_up": "block_sparse_moe.experts.{e}.w3",
}
# DeepSeek-V2/V3 (MLA attention). llama.cpp splits kv_b_proj into attn_k_b (transposed) and attn_v_b for its
# absorbed-MLA graph; older files hold attn_kv_b whole. Both are read back as kv_b_proj (see `_Source.v_b`).
_DEEPSEEK_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",  # without a query LoRA (V2-Lite)
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate": "mlp.gate_proj",  # the leading dense layers
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
# gpt-oss: biases on attention and experts, attention sinks, a router with a bias. Its experts module keeps
# one tensor per layer in the input-major layout [E, in, out], gate and up interleaved along the output
# (gate_up_proj[..., ::2] is the gate); llama.cpp splits them and stores each transposed (GptOssModel).
_GPT_OSS_LAYER = {
    **{leaf: _ATTENTION[leaf] for leaf in ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output")},
    "post_attention_norm": "post_attention_layernorm",
    "attn_sinks": "self_attn.sinks",
    "ffn_gate_inp": "mlp.router",
}
_NAMES = {
    "qwen3moe": (_QWEN_LAYER, _QWEN_EXPERTS),
    "qwen2moe": (_QWEN_LAYER, _QWEN_EXPERTS),
    "llama": (_MIXTRAL_LAYER, _MIXTRAL_EXPERTS),
    "deepseek2": (_DEEPSEEK_LAYER, _QWEN_EXPERTS),
    "gpt-oss": (_GPT_OSS_LAYER, {}),
}
_LAYER_TENSOR = re.compile(r"^blk\.(?P<layer>\d+)\.(?P<leaf>[a-z0-9_]+?)(?:\.(?P<expert>\d+))?\.(?P<kind>weight|bias)$")


@dataclass(frozen=True)
class _Tensor:
    """One tensor of the file: where its bytes are and how they are stored."""

    file: Path
    name: str
    ggml_type: int
    shape: tuple[int, ...]  # torch order (ggml lists dimensions fastest first)
    start: int  # absolute byte offset
    nbytes: int


@dataclass(frozen=True)
class _Source:
    """What one Hugging Face tensor is made of: a GGUF tensor, or one expert's slice of it."""

    tensor: _Tensor
    expert: int | None = None
    unpermute_heads: int | None = None  # undo llama.cpp's q/k row permutation with this many heads
    shape: tuple[int, ...] | None = None  # a reshape the model expects (a [1, H] gate stored as [H])
    v_b: _Tensor | None = None  # MLA: `tensor` is attn_k_b [H, kv_lora, nope], this attn_v_b [H, v, kv_lora]
    # gpt-oss: `tensor`'s rows (ffn_gate_exps) alternate with these (ffn_up_exps) along the output dimension,
    # and `transposed`: the model keeps the matrix [in, out]
    interleave: _Tensor | None = None
    transposed: bool = False

    @property
    def whole(self) -> bool:
        """Whether the model's tensor is the file's tensor as stored (or one expert's slice of it)."""
        return self.v_b is None and self.shape is None and self.interleave is None and not self.transposed


def _describe_supported() -> str:
    return ", ".join(f"{arch} ({what})" for arch, (_, what) in SUPPORTED_ARCHITECTURES.items())


# A Hugging Face name of one expert's projection: its layer and projection (the experts module differs by family).
# gpt-oss names one tensor per layer and projection instead (`experts.down_proj`, `experts.down_proj_bias`).
_EXPERT_KEY = re.compile(r"^model\.layers\.(?P<layer>\d+)\..*\.experts\.(?:\d+\.(?P<projection>\w+)\.weight|(?P<fused>\w+))$")


class GGUFCheckpoint:
    """A GGUF file (or a split set of them) as a `DecodedCheckpoint`: HF names, float tensors, one at a time."""

    def __init__(self, path: str | os.PathLike, build_tokenizer: bool = True):
        """build_tokenizer: rebuild transformers' tokenizer from the metadata (False: the store takes
        another directory's, `convert --tokenizer`)."""
        self.path = Path(path)
        files = _split_files(self.path)
        self.metadata, tables = {}, []
        for i, f in enumerate(files):
            metadata, tensors = _read_header(f)
            if i == 0:
                self.metadata = metadata
            tables.append(tensors)
        tensors: dict[str, _Tensor] = {}
        for table in tables:
            for t in table:
                if t.name in tensors:
                    raise SourceError(f"{self.path}: tensor {t.name} appears in two of the split files; the set is damaged")
                tensors[t.name] = t
        self.files = files
        self.architecture = str(self.metadata.get("general.architecture", ""))
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise SourceError(
                f"{self.path}: GGUF architecture {self.architecture!r} is not supported; moestream converts GGUF files "
                f"of {_describe_supported()}. Convert the model's Hugging Face checkpoint (safetensors) instead."
            )
        self.tensors = tensors
        self.config = _build_config(self.architecture, self.metadata, tensors, self.path)
        self.sources = self._map_names()
        # The tokenizer (1.4 s of Python for a 150k-token vocabulary) is built on a thread of its own while the
        # model's skeleton is built and the store written, which waits on the disk. A failure stops the import
        # at its next read (`_read_bytes`), not after hours of tensors.
        self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="moestream-tokenizer")
        build = _build_tokenizer if build_tokenizer else _no_tokenizer
        self._tokenizer = self._tokenizer_thread.submit(build, files[0], self.architecture)
        self._files = OpenFiles()

    # ---- the DecodedCheckpoint interface

    def keys(self) -> list[str]:
        return list(self.sources)

    def dtype(self, key: str) -> torch.dtype:
        """The dtype to store this tensor in by default: a float tensor's own, bfloat16 for decoded blocks
        (as for FP8/MXFP4 sources; `--experts-dtype fp32` keeps the decoded values exactly)."""
        src = self.sources[key]
        dtype = _FLOAT_TYPES.get(src.tensor.ggml_type, torch.bfloat16)
        other = src.v_b or src.interleave
        if other is not None and _FLOAT_TYPES.get(other.ggml_type) != dtype:
            return torch.bfloat16
        return dtype

    def read(self, key: str, index: int | None = None) -> torch.Tensor:
        """Tensor `key` (float; blocks decoded to float32), or only its slice `[index]` along dim 0."""
        src = self.sources[key]
        expert = self._expert(key, index)
        if src.v_b is not None:
            t = _join_kv_b(self._read_tensor(src.tensor, None), self._read_tensor(src.v_b, None))
            return t if index is None else t[index]
        t = self._read_tensor(src.tensor, expert)
        if src.interleave is not None:  # the output dimension: dim 0 of one expert's slice, 1 of the whole
            out = 0 if expert is not None else 1
            t = torch.stack([t, self._read_tensor(src.interleave, expert)], dim=out + 1).flatten(out, out + 1)
        if src.transposed:
            t = t.transpose(-1, -2)
        if src.unpermute_heads is not None:
            t = _unpermute(t, src.unpermute_heads)
        if src.shape is not None and index is None:
            t = t.reshape(src.shape)
        return t

    def read_int4(self, key: str, index: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Tensor `key` (or its slice `[index]`) as int4 codes in the store's portable bytes [N, K/2], with a
        float32 scale and zero per 32 weights along its last dimension [N, K/32] (gguf_blocks.py: each
        weight is (code - 8) * s + z), read from its blocks without decoding them; Q6_K blocks, where the
        compiled kernels are at hand, quantized to int4 by them as quant.quantize would (the same bytes); None
        if its blocks are of another type, or the tensor is not a matrix of whole rows (MLA's split kv_b, a
        reshaped tensor)."""
        src = self.sources[key]
        t = src.tensor
        # (Q6_K blocks, too, where the compiled kernels quantize them to int4 in one pass as torch would)
        requantized = t.ggml_type == gguf_blocks.Q6_K and gguf_blocks.has_compiled_kernels()
        if not (gguf_blocks.has_codes(t.ggml_type) or requantized) or not src.whole:
            return None
        expert = self._expert(key, index)
        if len(t.shape) - (expert is not None) != 2:
            return None
        parts = self._read_int4(t, expert)
        if parts is None:
            return None
        if src.unpermute_heads is not None:  # a permutation of rows: of each row's codes, scales and zeros alike
            parts = tuple(_unpermute(x, src.unpermute_heads) for x in parts)
        return parts

    def read_table(
        self, key: str, table: str, index: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Tensor `key` (or its slice `[index]`) as codes of the table format `table` (quant.TABLES) in the
        store's portable bytes [N, K/2], a float32 scale per 32 weights [N, K/32] and zeros (w = T[q] * s, so
        0), read from its MXFP4/IQ4 blocks; None if they hold another table's codes or none. [N, K] are the
        file's rows and columns, the orientation of a quantized record: gpt-oss's gate and up rows are
        interleaved here as `read` does, and its transposition (a float matrix's) does not apply."""
        if self.table_of(key) != table:
            return None
        src = self.sources[key]
        tensors = [src.tensor] + ([src.interleave] if src.interleave is not None else [])
        expert = self._expert(key, index)
        if len(src.tensor.shape) - (expert is not None) != 2:
            return None
        read = [self._read_table(t, expert) for t in tensors]
        nibbles, scales = read[0] if len(read) == 1 else (torch.stack(parts, dim=1).flatten(0, 1) for parts in zip(*read))
        if src.unpermute_heads is not None:
            nibbles, scales = _unpermute(nibbles, src.unpermute_heads), _unpermute(scales, src.unpermute_heads)
        return nibbles, scales, torch.zeros_like(scales)

    def table_of(self, key: str) -> str | None:
        """The table format that all of tensor `key`'s blocks are codes of, or None."""
        src = self.sources[key]
        tables = {gguf_blocks.table_of(t.ggml_type) for t in (src.tensor, src.interleave) if t is not None}
        return tables.pop() if len(tables) == 1 and src.v_b is None and src.shape is None else None

    def has_int4_codes(self, key: str) -> bool:
        """Whether `read_int4` gives tensor `key`'s codes (whole rows of 4-bit blocks of 32)."""
        src = self.sources[key]
        return gguf_blocks.has_codes(src.tensor.ggml_type) and src.whole and src.expert is None and len(src.tensor.shape) == 2

    def code_bits(self, key: str) -> int | None:
        """Bits per weight of tensor `key`'s codes in the file (Q4_K: 4, Q6_K: 6, Q8_0: 8; the block's
        scales not counted), or None for a float tensor."""
        from gguf import GGMLQuantizationType as Q

        src = self.sources[key]
        bits = []
        for t in (src.tensor, src.interleave, src.v_b):
            if t is None or t.ggml_type in _FLOAT_TYPES or t.ggml_type in _INT_TYPES:
                continue
            name = Q(t.ggml_type).name
            bits.append(next((b for prefix, b in _CODE_BITS if name.startswith(prefix)), 8))
        # tensors joined from two of the file's (gpt-oss's gate and up, MLA's k_b and v_b): their mean
        return round(sum(bits) / len(bits)) if bits else None

    def rows(self, key: str) -> int | None:
        """How many rows `read_rows` can read of tensor `key` (a whole matrix as the file stores it), or
        None if it must be read whole (an expert's slice, a permuted, joined or reshaped tensor)."""
        src = self.sources[key]
        plain = src.expert is None and src.whole and src.unpermute_heads is None
        return src.tensor.shape[0] if plain and len(src.tensor.shape) == 2 else None

    def read_rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of matrix `key` (as `read` decodes them); only where `rows(key)` is a number."""
        return self._read_tensor(_rows_of(self.sources[key].tensor, start, stop), None)

    def read_int4_rows(self, key: str, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`read_int4` of rows [start, stop) of matrix `key`; only where `rows(key)` is a number and
        `has_int4_codes(key)`."""
        return self._read_int4(_rows_of(self.sources[key].tensor, start, stop), None)

    def read_int8_rows(self, key: str, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Rows [start, stop) of matrix `key` as quant.py's int8 by rows (codes, scales) of the weights `read_rows`
        gives, made from Q6_K blocks by the compiled kernels in one pass (`gguf_blocks.q6_k_int8`); None for
        other blocks or without the kernels. Only where `rows(key)` is a number."""
        t = _rows_of(self.sources[key].tensor, start, stop)
        if t.ggml_type != gguf_blocks.Q6_K or not gguf_blocks.has_compiled_kernels():
            return None
        raw, shape = self._read_bytes(t, None)
        return gguf_blocks.q6_k_int8(raw.reshape(shape[0], -1), shape[-1])

    def read_table_rows(self, key: str, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`read_table` of rows [start, stop) of matrix `key`; only where `rows(key)` is a number and
        `table_of(key)` names a table."""
        nibbles, scales = self._read_table(_rows_of(self.sources[key].tensor, start, stop), None)
        return nibbles, scales, torch.zeros_like(scales)

    def source_types(self) -> dict:
        """What the store records of the file for `inspect`: the block type (ggml's name: Q4_K, Q6_K, F32, ...)
        of each expert projection, by MoE layer (one GGUF tensor holds that projection of every expert of a
        layer), and the other tensors counted by type."""
        from gguf import GGMLQuantizationType as Q

        experts: dict[str, dict[str, str]] = {}
        resident: dict[str, int] = {}
        for key, src in self.sources.items():
            name = Q(src.tensor.ggml_type).name
            m = _EXPERT_KEY.match(key)
            if m is None:
                resident[name] = resident.get(name, 0) + 1
            elif m["projection"] is not None:
                experts.setdefault(m["layer"], {})[m["projection"]] = name
            elif src.interleave is not None:  # gpt-oss's gate_up_proj: the file's gate and up tensors
                experts.setdefault(m["layer"], {}).update(gate_proj=name, up_proj=Q(src.interleave.ggml_type).name)
            elif not key.endswith("_bias"):  # (the experts' biases are float; they travel in the records)
                experts.setdefault(m["layer"], {})[m["fused"]] = name
        return {"experts": experts, "resident": dict(sorted(resident.items()))}

    def close(self) -> None:
        self._files.close()
        self._tokenizer_thread.shutdown(wait=False)

    def write_extra_files(self, directory: Path) -> list[str]:
        """Save the tokenizer rebuilt from the GGUF metadata into `directory`; return the file names."""
        with tempfile.TemporaryDirectory() as tmp:
            self._tokenizer.result().save_pretrained(tmp)
            names = sorted(p.name for p in Path(tmp).iterdir() if p.is_file())
            for name in names:
                shutil.copyfile(Path(tmp) / name, Path(directory) / name)
        return names

    # ---- reading

    def _expert(self, key: str, index: int | None) -> int | None:
        """The expert whose slice of the file's tensor `key` stands for, with `[index]` asked for, or None."""
        expert = self.sources[key].expert
        if index is not None:
            if expert is not None:
                raise SourceError(f"{key} is one expert's tensor already; it has no slice [{index}]")
            expert = index
        return expert

    def _read_bytes(self, t: _Tensor, expert: int | None) -> tuple[np.ndarray, tuple[int, ...]]:
        """The bytes of tensor `t` (or of its expert `expert`'s slice) as uint8, and that slice's shape."""
        shape, start, nbytes = t.shape, t.start, t.nbytes
        if expert is not None:
            if not 0 <= expert < shape[0]:
                raise SourceError(f"{t.name} has {shape[0]} experts, not {expert + 1}")
            per = nbytes // shape[0]
            shape, start, nbytes = shape[1:], start + expert * per, per
        if self._tokenizer.done() and self._tokenizer.exception() is not None:
            raise self._tokenizer.exception()
        fd = self._files.fd(t.file)
        buf = _pread_exact(fd, nbytes, start) if nbytes else bytearray()
        # Read once: keep the page cache for what the converter writes (the source can be 100s of GB).
        os.posix_fadvise(fd, start, nbytes, os.POSIX_FADV_DONTNEED)
        return np.frombuffer(buf, dtype=np.uint8), shape

    def _read_table(self, t: _Tensor, expert: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """A matrix of MXFP4/IQ4 blocks (or its expert's slice) as portable bytes of table codes and scales."""
        raw, shape = self._read_bytes(t, expert)
        return gguf_blocks.table_nibbles(raw.reshape(shape[0], -1), t.ggml_type, shape[-1])

    def _read_int4(self, t: _Tensor, expert: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """A matrix of 4-bit blocks of 32 (or its expert's slice) as portable int4 bytes, scales and zeros; of
        Q6_K blocks, those of its int4 quantization by the compiled kernels (None before they are built)."""
        raw, shape = self._read_bytes(t, expert)
        if t.ggml_type == gguf_blocks.Q6_K:
            return gguf_blocks.q6_k_int4(raw.reshape(shape[0], -1), shape[-1])
        return gguf_blocks.four_bit_nibbles(raw.reshape(shape[0], -1), t.ggml_type, shape[-1])

    def _read_tensor(self, t: _Tensor, expert: int | None) -> torch.Tensor:
        raw, shape = self._read_bytes(t, expert)
        if t.ggml_type in _FLOAT_TYPES or t.ggml_type in _INT_TYPES:
            dtype = _FLOAT_TYPES.get(t.ggml_type) or _INT_TYPES[t.ggml_type]
            if not raw.size:
                return torch.empty(shape, dtype=dtype)
            return torch.from_numpy(raw).view(dtype).reshape(shape)
        return _dequantize(raw, t.ggml_type, shape)

    # ---- names

    def _map_names(self) -> dict[str, _Source]:
        layer_names, expert_names = _NAMES[self.architecture]
        heads = self.config.num_attention_heads
        kv_heads = self.config.num_key_value_heads
        permuted = self.architecture == "llama"  # llama.cpp's LlamaModel.permute; Qwen is written as is
        sources: dict[str, _Source] = {}
        for name, t in self.tensors.items():
            base, _, kind = name.rpartition(".")
            if base in _TOP and kind in ("weight", "bias"):
                sources[f"{_TOP[base]}.{kind}"] = _Source(t)
                continue
            m = _LAYER_TENSOR.match(name)
            if m is None:
                sources[name] = _Source(t)  # unknown: kept under its GGUF name, the converter reports it unused
                continue
            layer, leaf, kind = int(m["layer"]), m["leaf"], m["kind"]
            prefix = f"model.layers.{layer}."
            if m["expert"] is not None:
                if self.architecture != "llama" or leaf not in _MIXTRAL_EXPERT:
                    sources[name] = _Source(t)
                    continue
                sources[prefix + _MIXTRAL_EXPERT[leaf].format(e=int(m["expert"])) + f".{kind}"] = _Source(t)
            elif self.architecture == "gpt-oss" and leaf in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
                sources.update(self._gpt_oss_experts(name, t, layer, leaf, kind))
            elif leaf in expert_names:
                if len(t.shape) != 3:
                    raise SourceError(f"{self.path}: {name} has shape {t.shape}; expected [experts, rows, columns]")
                for e in range(t.shape[0]):
                    sources[prefix + expert_names[leaf].format(e=e) + f".{kind}"] = _Source(t, expert=e)
            elif self.architecture == "deepseek2" and leaf in ("attn_k_b", "attn_v_b", "exp_probs_b"):
                if leaf == "exp_probs_b":  # the router's score correction (a buffer: no .bias suffix)
                    sources[prefix + "mlp.gate.e_score_correction_bias"] = _Source(t)
                elif leaf == "attn_k_b":
                    v_b = self.tensors.get(f"blk.{layer}.attn_v_b.weight")
                    if v_b is None or kind != "weight":
                        raise SourceError(f"{self.path}: {name} has no blk.{layer}.attn_v_b.weight to rebuild kv_b_proj with")
                    heads_kv, nope, v_dim = _check_kv_b(t, v_b, self.config, self.path)
                    shape = (heads_kv * (nope + v_dim), t.shape[1])
                    sources[prefix + "self_attn.kv_b_proj.weight"] = _Source(t, shape=shape, v_b=v_b)
                elif f"blk.{layer}.attn_k_b.weight" not in self.tensors:
                    raise SourceError(f"{self.path}: {name} has no blk.{layer}.attn_k_b.weight to rebuild kv_b_proj with")
            elif leaf in layer_names:
                unpermute = None
                if permuted and leaf in ("attn_q", "attn_k"):
                    unpermute = heads if leaf == "attn_q" else kv_heads
                shape = (1, t.shape[0]) if leaf == "ffn_gate_inp_shexp" and len(t.shape) == 1 else None
                # gpt-oss's sinks are a bare parameter (`self_attn.sinks`); llama.cpp names them attn_sinks.weight
                hf_name = prefix + layer_names[leaf] + ("" if leaf == "attn_sinks" else f".{kind}")
                sources[hf_name] = _Source(t, unpermute_heads=unpermute, shape=shape)
            else:
                sources[name] = _Source(t)
        return sources

    def _gpt_oss_experts(self, name: str, t: _Tensor, layer: int, leaf: str, kind: str) -> dict[str, _Source]:
        """gpt-oss's experts module's tensors from llama.cpp's: gate_up_proj [E, H, 2I] is ffn_gate_exps and
        ffn_up_exps [E, I, H] interleaved along I and transposed (their biases [E, I] interleaved);
        down_proj [E, I, H] is ffn_down_exps [E, H, I] transposed."""
        prefix = f"model.layers.{layer}.mlp.experts."
        suffix = "" if kind == "weight" else "_bias"
        if len(t.shape) != (3 if kind == "weight" else 2):
            raise SourceError(
                f"{self.path}: {name} has shape {t.shape}; expected [experts, ...] of {3 if kind == 'weight' else 2} dimensions"
            )
        if leaf == "ffn_down_exps":
            return {f"{prefix}down_proj{suffix}": _Source(t, transposed=kind == "weight")}
        if leaf == "ffn_up_exps":
            return {}  # read with its gate
        up = self.tensors.get(f"blk.{layer}.ffn_up_exps.{kind}")
        if up is None or up.shape != t.shape:
            raise SourceError(f"{self.path}: {name} has no blk.{layer}.ffn_up_exps.{kind} of its shape to interleave with")
        return {f"{prefix}gate_up_proj{suffix}": _Source(t, interleave=up, transposed=kind == "weight")}


# ---------------------------------------------------------------------------------------------------------
# Header


# Bits of a block type's codes, by the prefix of its ggml name (IQ1 counted as 2: no store format has fewer).
_CODE_BITS = (
    ("Q2", 2), ("IQ1", 2), ("IQ2", 2), ("TQ", 2), ("Q3", 3), ("IQ3", 3), ("Q4", 4), ("IQ4", 4), ("MXFP4", 4),
    ("Q5", 5), ("Q6", 6), ("Q8", 8),
)  # fmt: skip
_FLOAT_TYPES: dict[int, torch.dtype] = {}
_INT_TYPES: dict[int, torch.dtype] = {}


def _init_types() -> None:
    from gguf import GGMLQuantizationType as Q

    _FLOAT_TYPES.update({Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16, Q.F64: torch.float64})
    _INT_TYPES.update({Q.I8: torch.int8, Q.I16: torch.int16, Q.I32: torch.int32, Q.I64: torch.int64})


_init_types()


def _split_files(path: Path) -> list[Path]:
    """The files of a split GGUF (all of them, in order, whichever one was named), or [path]."""
    if not path.is_file():
        raise SourceError(f"{path} does not exist or is not a file")
    m = _SPLIT.match(path.name)
    if m is None:
        return [path]
    count = int(m["count"])
    files = [path.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise SourceError(
            f"{path} is part {int(m['no'])} of a GGUF split into {count} files, and {', '.join(missing[:5])} "
            f"{'is' if len(missing) == 1 else 'are'} missing; put all the parts in one directory"
        )
    return files


def _read_header(path: Path) -> tuple[dict, list[_Tensor]]:
    """Metadata and tensor table of one GGUF file, checked against the file's size (a truncated download)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    size = path.stat().st_size
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise SourceError(
            f"{path} is not a GGUF file (it does not start with the GGUF magic bytes); pass a llama.cpp .gguf file "
            "or a Hugging Face checkpoint directory"
        )
    try:
        metadata, table = read_header(path)
        tensors = []
        for name, kind, shape, start in table:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
            if shape and shape[-1] % block:
                raise ValueError(f"tensor {name}: rows of {shape[-1]} values do not fill {block}-value blocks")
            nbytes = math.prod(shape) // block * type_size
            tensors.append(_Tensor(path, name, kind, shape, start, nbytes))
    except (ValueError, KeyError, OverflowError, UnicodeDecodeError) as e:  # (an unknown type is a ValueError)
        raise SourceError(
            f"{path} is a truncated or damaged GGUF file ({size} bytes; reading its header and tensor table failed: "
            f"{type(e).__name__}: {e}); download it again"
        ) from None
    for t in tensors:
        if t.start + t.nbytes > size:
            raise SourceError(
                f"{path} is truncated: tensor {t.name} ends at byte {t.start + t.nbytes}, the file has {size} bytes; "
                "download it again"
            )
    if "general.architecture" not in metadata and "split.no" not in metadata:
        raise SourceError(f"{path} has no general.architecture in its metadata; it is not a model GGUF")
    return metadata, tensors


# ---------------------------------------------------------------------------------------------------------
# Values


def _dequantize(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Blocks (uint8) -> float32 [*shape], decoded a bounded number of rows at a time."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    cols = shape[-1]
    rows = raw.size // (cols // block * type_size)
    raw = raw.reshape(rows, cols // block * type_size)
    out = np.empty((rows, cols), dtype=np.float32)
    step = max(1, _DEQUANT_ELEMENTS // cols)
    try:
        for r in range(0, rows, step):
            if ggml_type == gguf_blocks.Q6_K:
                out[r : r + step] = gguf_blocks.q6_k_decoded(raw[r : r + step]).view(-1, cols).numpy()
            else:
                out[r : r + step] = dequantize(raw[r : r + step], GGMLQuantizationType(ggml_type))
    except NotImplementedError:
        raise SourceError(
            f"the gguf package cannot dequantize ggml type {GGMLQuantizationType(ggml_type).name}; "
            "upgrade it (pip install -U gguf) or use a GGUF of another quantization"
        ) from None
    return torch.from_numpy(out).reshape(shape)


def _check_kv_b(k_b: _Tensor, v_b: _Tensor, config, path: Path) -> tuple[int, int, int]:
    """(heads, qk_nope_head_dim, v_head_dim) of a split kv_b_proj, checked against the config."""
    want_k = (config.num_attention_heads, config.kv_lora_rank, config.qk_nope_head_dim)
    want_v = (config.num_attention_heads, config.v_head_dim, config.kv_lora_rank)
    if k_b.shape != want_k or v_b.shape != want_v:
        raise SourceError(
            f"{path}: {k_b.name} {k_b.shape} and {v_b.name} {v_b.shape} do not have the shapes the metadata implies "
            f"([heads, kv_lora_rank, qk_nope_head_dim] = {list(want_k)}, [heads, v_head_dim, kv_lora_rank] = {list(want_v)})"
        )
    return want_k[0], want_k[2], want_v[1]


def _join_kv_b(k_b: torch.Tensor, v_b: torch.Tensor) -> torch.Tensor:
    """Undo llama.cpp's MLA split (DeepseekV2Model.modify_tensors): kv_b_proj viewed [H, nope + v, kv_lora] was
    split into k_b [H, nope, kv_lora] (stored transposed, [H, kv_lora, nope]) and v_b [H, v, kv_lora]."""
    if k_b.dtype != v_b.dtype:
        k_b, v_b = k_b.float(), v_b.float()
    kv = torch.cat([k_b.transpose(1, 2), v_b], dim=1)
    return kv.reshape(-1, kv.shape[-1])


def _rows_of(t: _Tensor, start: int, stop: int) -> _Tensor:
    """Rows [start, stop) of matrix `t` as a tensor of the file (a block never spans two rows)."""
    row_bytes = t.nbytes // t.shape[0]
    return _Tensor(
        t.file, t.name, t.ggml_type, (stop - start, t.shape[1]), t.start + start * row_bytes, (stop - start) * row_bytes
    )


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's `LlamaModel.permute` of q/k rows (its rotary pairs interleaved per head), as
    transformers' `LlamaTensorProcessor._reverse_permute_weights` does."""
    dim = w.shape[0] // heads // 2
    return w.reshape(heads, dim, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ---------------------------------------------------------------------------------------------------------
# Config and tokenizer


def _build_config(arch: str, md: dict, tensors: dict[str, _Tensor], path: Path):
    """The transformers config of the model, from llama.cpp's metadata keys (and tensor shapes where the
    metadata is silent). transformers' own GGUF config reader misses some keys (e.g. Qwen3-MoE's expert width,
    `expert_feed_forward_length`, falls back to the config class's default), so every field is set here."""
    from transformers import AutoConfig

    def key(name, default=KeyError):
        value = md.get(f"{arch}.{name}", default)
        if value is KeyError:
            raise SourceError(f"{path}: the GGUF metadata lacks {arch}.{name}; the file is incomplete or not a model")
        return value

    def shape(name):
        t = tensors.get(name)
        return t.shape if t is not None else None

    layers = int(key("block_count"))
    embed = shape("token_embd.weight")
    if embed is None:
        raise SourceError(f"{path} has no token_embd.weight tensor; it is not a complete model GGUF")
    heads = int(key("attention.head_count"))
    kv_heads = key("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # one count per layer in some files
        if len(set(kv_heads)) != 1:
            raise SourceError(f"{path}: layers with different key/value head counts ({sorted(set(kv_heads))}) are not supported")
        kv_heads = kv_heads[0]
    experts = int(key("expert_count", 0))
    if experts == 0:
        raise SourceError(
            f"{path} is a dense {arch} model (no {arch}.expert_count); moestream streams the experts of MoE models only"
        )
    config = dict(
        vocab_size=embed[0],
        hidden_size=int(key("embedding_length")),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=int(kv_heads),
        max_position_embeddings=int(key("context_length", 4096)),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_parameters=_rope_parameters(key, path),
        num_experts_per_tok=int(key("expert_used_count")),
        # llama.cpp writes the output projection only when it is not the embedding matrix
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=md.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=md.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=md.get("tokenizer.ggml.padding_token_id"),
        dtype=_model_dtype(tensors),
    )
    if arch != "deepseek2" and (head_dim := key("attention.key_length", None)) is not None:
        config["head_dim"] = int(head_dim)
    gate_exps = shape("blk.0.ffn_gate_exps.weight") or next(
        (t.shape for n, t in tensors.items() if n.endswith(".ffn_gate_exps.weight")), None
    )
    if arch in ("qwen3moe", "qwen2moe"):
        width = key("expert_feed_forward_length", None) or (gate_exps[1] if gate_exps else None)
        if width is None:
            raise SourceError(
                f"{path}: neither {arch}.expert_feed_forward_length nor an ffn_gate_exps tensor says the experts' width"
            )
        moe_layers = {int(n.split(".")[1]) for n in tensors if n.startswith("blk.") and ".ffn_gate_inp." in n}
        config.update(
            num_experts=experts,
            moe_intermediate_size=int(width),
            decoder_sparse_step=1,
            mlp_only_layers=[i for i in range(layers) if i not in moe_layers],
            # llama.cpp's qwen3moe graph normalizes the top-k weights, its qwen2moe graph does not
            norm_topk_prob=arch == "qwen3moe",
        )
        if (ff := key("feed_forward_length", None)) is not None:
            config["intermediate_size"] = int(ff)
        if arch == "qwen2moe":
            shared = key("expert_shared_feed_forward_length", None) or (shape("blk.0.ffn_gate_shexp.weight") or (0,))[0]
            config["shared_expert_intermediate_size"] = int(shared)
    elif arch == "deepseek2":
        config.update(_deepseek2_config(key, tensors, path, experts, layers))
        config["num_key_value_heads"] = heads  # llama.cpp writes MLA as one shared latent head (1)
        config["rope_parameters"] = _rope_parameters(key, path, deepseek=True)
    elif arch == "gpt-oss":
        config.update(_gpt_oss_config(key, gate_exps, path, experts, layers))
        config["rope_parameters"]["truncate"] = False  # gpt-oss's yarn keeps its fractional bounds (its own config)
    else:  # llama with experts: Mixtral
        width = key("feed_forward_length", None) or (
            gate_exps[1] if gate_exps else (shape("blk.0.ffn_gate.0.weight") or (None,))[0]
        )
        if width is None:
            raise SourceError(f"{path}: neither {arch}.feed_forward_length nor an expert tensor says the experts' width")
        config.update(num_local_experts=experts, intermediate_size=int(width), sliding_window=None)
        if "head_dim" not in config and (rope_dim := key("rope.dimension_count", None)) is not None:
            config["head_dim"] = int(rope_dim)
    model_type = config.pop("model_type", SUPPORTED_ARCHITECTURES[arch][0])  # deepseek2: V2 or V3, by its gating
    try:
        return AutoConfig.for_model(model_type, **config)
    except Exception as e:  # config classes validate with their own error types
        raise SourceError(f"{path}: the GGUF metadata does not make a valid {model_type} config ({e})") from None


def _deepseek2_config(key, tensors: dict[str, _Tensor], path: Path, experts: int, layers: int) -> dict:
    """DeepSeek-V3's fields (with its `model_type`) from llama.cpp's deepseek2 keys (DeepseekV2Model
    .set_gguf_parameters), or DeepSeek-V2's for a file whose experts are routed with softmax: V2 and V2.5
    files, whose gating key llama.cpp's converter leaves out (llama.cpp then routes with softmax)."""
    gating = int(key("expert_gating_func", 1))  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE: 1 softmax, 2 sigmoid
    if gating not in (1, 2):
        raise SourceError(
            f"{path}: this deepseek2 GGUF routes its experts with gating function {gating}; moestream converts "
            "softmax (1: DeepSeek-V2/V2.5) and sigmoid (2: DeepSeek-V3/R1) ones"
        )
    softmax = gating == 1
    if softmax and bool(key("expert_weights_norm", False)):
        raise SourceError(
            f"{path}: this deepseek2 GGUF routes with softmax and normalizes the top-k weights, which "
            "transformers' DeepSeek-V2 does not; convert the Hugging Face checkpoint instead"
        )

    def one(name):  # a per-layer array with one value, or a number
        value = key(name)
        if isinstance(value, list):
            if len(set(value)) != 1:
                raise SourceError(f"{path}: layers with different {name} ({sorted(set(value))}) are not supported")
            value = value[0]
        return int(value)

    rope = one("rope.dimension_count")
    # Files written since llama.cpp absorbed MLA state the per-head sizes as *_mla; before, as key/value_length.
    qk = key("attention.key_length_mla", None)
    v = key("attention.value_length_mla", None)
    if qk is None:
        qk, v = key("attention.key_length"), key("attention.value_length")
    q_lora = key("attention.q_lora_rank", None)
    groups = int(key("expert_group_count", 1))
    fields = dict(
        n_routed_experts=experts,
        moe_intermediate_size=one("expert_feed_forward_length"),
        intermediate_size=one("feed_forward_length"),
        n_shared_experts=int(key("expert_shared_count", 0)),
        first_k_dense_replace=int(key("leading_dense_block_count", 0)),
        routed_scaling_factor=float(key("expert_weights_scale", 1.0)),
        norm_topk_prob=bool(key("expert_weights_norm", False)),
        n_group=groups,
        topk_group=int(key("expert_group_used_count", 1)),
        q_lora_rank=int(q_lora) if q_lora is not None else None,
        kv_lora_rank=int(key("attention.kv_lora_rank")),
        qk_rope_head_dim=rope,
        qk_nope_head_dim=int(qk) - rope,
        v_head_dim=int(v),
    )
    if softmax:  # V2's router: the experts' softmax, top-k within the best groups by their best expert
        return dict(fields, model_type="deepseek_v2", topk_method="group_limited_greedy" if groups > 1 else "greedy")
    return dict(
        fields,
        model_type="deepseek_v3",
        rope_interleave=True,  # llama.cpp rotates DeepSeek's adjacent pairs (its NORM rope), as the original does
        num_mtp_layers=0,  # llama.cpp leaves the multi-token-prediction layers out of deepseek2 files
    )


def _gpt_oss_config(key, gate_exps, path: Path, experts: int, layers: int) -> dict:
    """gpt-oss's fields from llama.cpp's gpt-oss keys (GptOssModel.set_gguf_parameters). Its clamped SwiGLU's
    alpha and limit are not in the file: llama.cpp's graph fixes them at the values gpt-oss's config has."""
    width = key("expert_feed_forward_length", None) or (gate_exps[1] if gate_exps else None)
    if width is None:
        raise SourceError(
            f"{path}: neither gpt-oss.expert_feed_forward_length nor an ffn_gate_exps tensor says the experts' width"
        )
    # Sliding-window layers: a per-layer array, or every n-th layer full (llama.cpp's default for gpt-oss: 2,
    # the even layers sliding), as llama.cpp's load_swa_pattern reads them.
    pattern = key("attention.sliding_window_pattern", 2)
    if isinstance(pattern, list):
        sliding = [bool(p) for p in pattern]
        if len(sliding) != layers:
            raise SourceError(f"{path}: gpt-oss.attention.sliding_window_pattern has {len(sliding)} entries for {layers} layers")
    else:
        sliding = [int(pattern) == 0 or i % int(pattern) < int(pattern) - 1 for i in range(layers)]
    return dict(
        num_local_experts=experts,
        intermediate_size=int(width),
        sliding_window=int(key("attention.sliding_window")),
        layer_types=["sliding_attention" if s else "full_attention" for s in sliding],
        attention_bias=True,
    )


def _rope_parameters(key, path: Path, deepseek: bool = False) -> dict:
    params = {"rope_type": "default", "rope_theta": float(key("rope.freq_base", 10000.0))}
    kind = key("rope.scaling.type", None) or "none"
    if kind == "none":
        return params
    if kind not in ("linear", "yarn"):
        raise SourceError(f"{path}: rope scaling {kind!r} is not supported for GGUF import (linear and yarn are)")
    params.update(rope_type=kind, factor=float(key("rope.scaling.factor")))
    if kind == "yarn":
        params["original_max_position_embeddings"] = int(key("rope.scaling.original_context_length"))
        for gguf_key, hf_key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if (value := key(f"rope.scaling.{gguf_key}", None)) is not None:
                params[hf_key] = float(value)
        if deepseek and (log_mul := key("rope.scaling.yarn_log_multiplier", None)) is not None:
            # llama.cpp's converter writes 0.1 * mscale_all_dim, and its graph scales attention by
            # yarn_get_mscale(factor, mscale_all_dim)**2 with cos/sin left unscaled: mscale == mscale_all_dim.
            params["mscale_all_dim"] = params["mscale"] = round(float(log_mul) / 0.1, 6)
    return params


def _model_dtype(tensors: dict[str, _Tensor]) -> str:
    """The resident weights' dtype: float32 for an all-F32 file; else bfloat16, what these models are trained
    and run in (an F16 file's dense weights round to bfloat16; `--experts-dtype fp16` keeps its experts exact)."""
    full = {t.ggml_type for t in tensors.values() if t.ggml_type not in _INT_TYPES}
    return "float32" if all(_FLOAT_TYPES.get(ggml_type) == torch.float32 for ggml_type in full) else "bfloat16"


def _build_tokenizer(path: Path, arch: str):
    """transformers' tokenizer rebuilt from the GGUF metadata (vocabulary, merges, special tokens, chat
    template). It reads the metadata only: no tensor data."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    # The fast tokenizer class reads the tokenizer keys alone and builds the tokenizer from them (about 3 s
    # for a 150k vocabulary). AutoTokenizer also reads the model config from the file (which transformers
    # cannot for deepseek2) and its model-specific class rebuilds the vocabulary in Python (about 20 s more
    # for Qwen's): kept only for llama files, whose sentencepiece vocabularies its class completes (BOS).
    cls = AutoTokenizer if arch == "llama" else PreTrainedTokenizerFast
    try:
        return cls.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    except Exception as e:  # transformers' GGUF tokenizer builders raise ValueError, KeyError, ...
        raise SourceError(
            f"{path}: transformers cannot build a tokenizer from this GGUF's metadata ({type(e).__name__}: {e}); "
            "pass --tokenizer DIR with the model's Hugging Face tokenizer files"
        ) from None


def _no_tokenizer(path: Path, arch: str) -> None:
    """What `convert --tokenizer DIR` builds from the GGUF: nothing (the store gets DIR's files)."""
    return None
