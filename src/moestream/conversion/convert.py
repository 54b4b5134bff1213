"""Hugging Face checkpoint -> moestream store, one tensor (or one expert) at a time.

Key names come from transformers' own conversion mapping (the same one `from_pretrained` applies), so a
per-expert checkpoint key such as `model.layers.0.mlp.experts.3.gate_proj.weight` or Mixtral's
`block_sparse_moe.experts.3.w1.weight` ends up in the slice `[3]` of the model's fused
`experts.gate_up_proj`, exactly where transformers would put it. We run transformers' conversion
operations on one expert at a time (a "stack" of one), so the fused [E, ...] tensors are never built.

The output is written into a hidden temporary directory next to DST, manifest last, and renamed into
place at the end: an interrupted conversion never leaves a directory that loads.
"""

from __future__ import annotations

import errno
import functools
import gc
import os
import re
import shutil
import threading
from collections import defaultdict, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

from ..choices import EXPERT_FORMATS, FLOAT_FORMATS, GROUP_SIZES
from ..errors import SourceError, UsageError
from ..units import format_bytes
from .gguf_blocks import GROUP as BLOCK_GROUP
from .quant import (
    DEFAULT_GROUP_SIZE,
    DENSE_FORMATS,
    TABLE_GROUP,
    QuantFormat,
    Quantized,
    dense_formats,
    expert_record_specs,
    group_for,
    int4_parts,
    pack,
    parse_layer_rules,
    quantize,
    rows_dim,
)
from .resident_writer import ResidentFileWriter, resident_order, spec_bytes
from .skeleton import build_skeleton, dense_linears, expert_parameters, experts_modules, load_source_config, model_dtype
from .source import DecodedCheckpoint
from .store import DTYPES, RECORD_ALIGNMENT, ExpertLayer, FileEntry, Manifest, RecordLayout, checksum

EXPERT_DTYPES = dict(zip(FLOAT_FORMATS, (torch.bfloat16, torch.float16, torch.float32)))
# Files copied verbatim so that the store can build the tokenizer and generation defaults by itself.
EXTRA_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)
TOKENIZER_FILES = tuple(name for name in EXTRA_FILES if name != "generation_config.json")  # what --tokenizer gives
RESIDENT_SHARD_BYTES = 512 * 1024**2  # resident tensors per file (about)
RESIDENT_SLICE_BYTES = 32 * 1024**2  # float32 rows decoded at a time of a matrix the source reads by rows (per worker)


@dataclass
class _Group:
    """Source keys that transformers' converter combines into one target tensor (for one expert, if any)."""

    converter: WeightConverter
    keys: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))  # source pattern -> keys


@dataclass
class _ExpertSource:
    """How to obtain one per-expert parameter of one experts module from the checkpoint."""

    fused_key: str | None = None  # a checkpoint tensor [E, ...] already in the module's layout
    per_expert: dict[int, _Group] = field(default_factory=dict)  # expert -> converter group


@dataclass
class ConversionPlan:
    resident: dict[str, str | _Group]  # target name -> source key, or a converter group
    experts: list[tuple[str, torch.nn.Module, dict[str, _ExpertSource]]]
    unused: list[str]


_LAST_INDEX = re.compile(r"\.(\d+)\.(?!.*\.\d+\.)")


def _expert_index(key: str) -> int:
    """Per-expert checkpoint keys carry the expert number as their last numeric path component."""
    match = _LAST_INDEX.search(key)
    if match is None:
        raise SourceError(f"cannot find the expert number in checkpoint key {key!r}")
    return int(match.group(1))


def _renamer(model):
    """Checkpoint key -> (model key, converter or None, matched source pattern), as from_pretrained renames."""
    mapping = get_model_conversion_mapping(model)
    renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
    converters = [t for t in mapping if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    meta = model.state_dict()

    def rename(key: str):
        renamed, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, meta)
        if renamed not in meta and key in meta:
            renamed, pattern = key, None  # already the model's name: a renaming must not have applied
        return renamed, by_pattern.get(pattern), pattern

    return rename


def plan_conversion(model: torch.nn.Module, ckpt: DecodedCheckpoint) -> ConversionPlan:
    """Decide, from names and shapes alone, where every checkpoint tensor goes."""
    rename = _renamer(model)
    meta_names = set(model.state_dict())
    modules = experts_modules(model)
    expert_params = {}
    sources: list[dict[str, _ExpertSource]] = []
    for name, module in modules:
        per_module = {}
        for pname, _ in expert_parameters(module):
            expert_params[f"{name}.{pname}"] = per_module.setdefault(pname, _ExpertSource())
        sources.append(per_module)

    resident: dict[str, str | _Group] = {}
    unused = []
    for key in ckpt.keys():
        target, converter, pattern = rename(key)
        if target in expert_params:
            src = expert_params[target]
            if converter is None:
                src.fused_key = key
            else:
                group = src.per_expert.setdefault(_expert_index(key), _Group(converter))
                group.keys[pattern].append(key)
        elif target in meta_names:
            if converter is None:
                resident[target] = key
            else:
                group = resident.setdefault(target, _Group(converter))
                group.keys[pattern].append(key)
        else:
            unused.append(key)

    tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
    missing = [n for n in meta_names if n not in resident and n not in expert_params and n not in tied]
    # Persistent buffers that a checkpoint may omit are rebuilt by the runtime like non-persistent ones.
    buffers = {n for n, _ in model.named_buffers()}
    missing = [n for n in missing if n not in buffers]
    if missing:
        raise SourceError(
            f"the checkpoint lacks {len(missing)} tensors the model needs, e.g. {sorted(missing)[:5]}; "
            "is it complete, and is its config.json the one it was saved with?"
        )
    experts = []
    for (name, module), per_module in zip(modules, sources):
        for pname, src in per_module.items():
            n = module.num_experts
            if src.fused_key is None and sorted(src.per_expert) != list(range(n)):
                have = sorted(src.per_expert)
                raise SourceError(
                    f"{name}.{pname}: the checkpoint has {len(have)} of {n} experts' weights "
                    f"(missing e.g. {sorted(set(range(n)) - set(have))[:5]})"
                )
        experts.append((name, module, per_module))
    return ConversionPlan(resident, experts, unused)


def _run_converter(group: _Group, ckpt: DecodedCheckpoint, model, target: str, read=None) -> torch.Tensor:
    """Apply transformers' own conversion operations (merge, concatenate, ...) to the group's tensors, as
    `read(key)` gives them (default: `ckpt.read`)."""
    read = read or ckpt.read
    tensors = {pattern: [read(k) for k in sorted(keys, key=dot_natural_key)] for pattern, keys in group.keys.items()}
    conv = group.converter
    for op in conv.operations:
        tensors = op.convert(
            tensors,
            source_patterns=conv.source_patterns,
            target_patterns=conv.target_patterns,
            full_layer_name=target,
            model=model,
            config=model.config,
        )
    if len(tensors) != 1:
        raise SourceError(f"transformers' conversion for {target} produced {len(tensors)} tensors, expected one")
    return next(iter(tensors.values()))


def _group_keys(group: _Group) -> list[str]:
    """The checkpoint keys a converter group merges, all patterns together."""
    return [k for keys in group.keys.values() for k in keys]


def _expert_codes(src: _ExpertSource, e: int, ckpt, model, target: str, shape, table: str | None) -> list | None:
    """`_code_pieces` of expert `e`'s weight (None where its source has no codes)."""
    if src.fused_key is not None:
        return _code_pieces(src.fused_key, ckpt, model, target, shape, index=e, table=table)
    return _code_pieces(src.per_expert[e], ckpt, model, target, shape, table=table)


def _expert_tensor(src: _ExpertSource, e: int, ckpt, model, target: str, shape) -> torch.Tensor:
    if src.fused_key is not None:
        t = ckpt.read(src.fused_key, index=e)
    else:
        t = _run_converter(src.per_expert[e], ckpt, model, target)
        t = t[0] if t.dim() == len(shape) + 1 and t.shape[0] == 1 else t  # the "stack of one" made by the merge
    if tuple(t.shape) != tuple(shape):
        raise SourceError(f"{target}[{e}] has shape {tuple(t.shape)} in the checkpoint, the model expects {tuple(shape)}")
    return t


def _keeps_codes(fmt, ckpt, transposed: bool = False) -> bool:
    """Whether weights stored in `fmt` are taken as codes from the source's blocks where it has them (a
    GGUF's 4-bit blocks of 32, or its MXFP4/IQ4 blocks for a table format: gguf_blocks.py) instead of being
    decoded and quantized again. A table format's codes come in the record's [N, K] orientation whatever
    the module's float one (GGUFCheckpoint.read_table)."""
    if isinstance(fmt, QuantFormat) and fmt.table is not None:
        return hasattr(ckpt, "read_table")
    return (
        hasattr(ckpt, "read_int4")
        and isinstance(fmt, QuantFormat)
        and fmt.name == "int4"
        and fmt.group_size == BLOCK_GROUP
        and not transposed
    )


def _code_pieces(source, ckpt, model, target: str, shape, index: int | None = None, table: str | None = None) -> list | None:
    """A weight of `shape` [N, K] whose source blocks hold its codes, as the pieces that make it: (codes,
    source row, target row, rows), codes being one source tensor's (portable int4 bytes [n, K/2], float32
    scales and zeros [n, K/32]: `ckpt.read_int4`, or with `table` a table format's: `ckpt.read_table`), so
    that the weight's rows [target row, + rows) are the codes' rows [source row, + rows). None where a
    source tensor has no codes or another shape, or the conversion is not a move of whole rows.
    `source`: a checkpoint key (slice `index` of it), or a converter group."""

    def read_codes(key: str, i: int | None = None):
        return ckpt.read_table(key, table, i) if table else ckpt.read_int4(key, i)

    if isinstance(source, str):
        codes = read_codes(source, index)
        pieces = None if codes is None else [(codes, 0, 0, codes[0].shape[0])]
    else:
        read = {k: read_codes(k) for k in _group_keys(source)}
        runs = None if any(v is None for v in read.values()) else _row_runs(source, read, ckpt, model, target)
        pieces = None if runs is None else [(read[key], first, at, count) for key, first, at, count in runs]
    if pieces is None or sum(count for *_, count in pieces) != shape[0]:
        return None
    for (nibbles, scales, zeros), first, _, count in pieces:
        groups = (nibbles.shape[0], shape[1] // BLOCK_GROUP)
        if nibbles.shape[1:] != (shape[1] // 2,) or tuple(scales.shape) != groups or tuple(zeros.shape) != groups:
            return None
        if first + count > nibbles.shape[0]:
            return None
    return pieces


def _row_runs(group: _Group, read: dict, ckpt, model, target: str) -> list[tuple[str, int, int, int]] | None:
    """Where the rows of `target` come from when `group`'s conversion operations run on the tensors `read`
    gives (codes: their first element's rows): runs (key, first source row, first target row, rows), in
    target order. Found by running the operations on each key's row numbers, an [n, 1] tensor, instead of
    its codes (they stack, concatenate and rename along the rows, which a block's codes, scales and zeros
    share): the rows are then copied once, straight to where they go. None where the operations give
    anything but one column of rows (they did more than move rows)."""
    keys = _group_keys(group)
    ids = {k: torch.arange(read[k][0].shape[0], dtype=torch.int64).add_(i << 32)[:, None] for i, k in enumerate(keys)}
    moved = _run_converter(group, ckpt, model, target, read=ids.__getitem__)
    moved = moved[0] if moved.dim() == 3 and moved.shape[0] == 1 else moved
    if moved.dim() != 2 or moved.shape[1] != 1:
        return None
    moved = moved[:, 0]
    key, row = moved >> 32, moved & 0xFFFFFFFF
    # a run starts at row 0 and wherever the key changes or the source row does not follow the previous one
    starts = torch.ones_like(moved, dtype=torch.bool)
    starts[1:] = (key[1:] != key[:-1]) | (row[1:] != row[:-1] + 1)
    at = starts.nonzero()[:, 0].tolist()
    ends = at[1:] + [len(moved)]
    return [(keys[key[a]], int(row[a]), a, b - a) for a, b in zip(at, ends)]


def _place_codes(pieces: list, qweight: torch.Tensor, scales_zeros: torch.Tensor) -> None:
    """Copy `_code_pieces` into a matrix's int4-family record tensors: its bytes [N, K/2] and its scales and
    zeros side by side per group [K/G, N, 2] (bf16; quant.int4_parts)."""
    for (nibbles, scales, zeros), first, at, count in pieces:
        qweight[at : at + count] = nibbles[first : first + count]
        scales_zeros[:, at : at + count, 0] = scales[first : first + count].t()
        scales_zeros[:, at : at + count, 1] = zeros[first : first + count].t()


def _source_codes(source, ckpt, model, target: str, shape, name: str, table: str | None = None) -> dict | None:
    """The int4 group-32 record tensors (`quant.int4_parts` named `name`) of `_code_pieces`, or None."""
    pieces = _code_pieces(source, ckpt, model, target, shape, table=table)
    if pieces is None:
        return None
    qweight = torch.empty(shape[0], shape[1] // 2, dtype=torch.uint8)
    scales_zeros = torch.empty(shape[1] // BLOCK_GROUP, shape[0], 2, dtype=torch.bfloat16)
    _place_codes(pieces, qweight, scales_zeros)
    return {f"{name}.qweight": qweight, f"{name}.scales_zeros": scales_zeros}


RECORD_WORKERS = 2  # records built at once (reads, unpacking and packing release the GIL for most of their time)


def _in_order(make, items, ahead: int = 2 * RECORD_WORKERS):
    """`make(item)` of each item, in order, built by RECORD_WORKERS threads at most `ahead` items ahead of
    the one handed out (so at most that many records wait in memory)."""
    with ThreadPoolExecutor(RECORD_WORKERS) as pool:
        pending = deque()
        for item in items:
            pending.append(pool.submit(make, item))
            if len(pending) > ahead:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def _shards(resident: list) -> list[list]:
    """The resident tensors split into files of about RESIDENT_SHARD_BYTES, in order."""
    shards, size = [[]], 0
    for entry in resident:
        nbytes = _spec_bytes(entry[3])
        if shards[-1] and size + nbytes > RESIDENT_SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes
    return [shard for shard in shards if shard]


def _resident_pieces(target: str, source, fmt: QuantFormat | None, want: torch.Tensor, ckpt, model):
    """The file tensors of resident tensor `target` (`fmt`'s parts, or the tensor in the model's dtype), in
    file order, as (name, piece) pairs. A matrix the source reads by rows (`ckpt.rows`) comes a slice of
    RESIDENT_SLICE_BYTES at a time, the slices decoded and quantized by RECORD_WORKERS threads (`_in_order`,
    one slice ahead each): its first part streams, its other parts (a quantized matrix's scales, small)
    are joined and follow."""
    module = target.rpartition(".")[0]
    rows = ckpt.rows(source) if isinstance(source, str) and hasattr(ckpt, "rows") and want.dim() == 2 else None
    sliced = rows is not None and rows == want.shape[0]
    table = fmt.name if isinstance(fmt, QuantFormat) and fmt.table is not None else None
    # a matrix read a slice of rows at a time keeps codes only where all its blocks hold them (`sliced`: a plain key)
    codes_kept = _keeps_codes(fmt, ckpt) and (
        not sliced or (ckpt.table_of(source) == table if table else ckpt.has_int4_codes(source))
    )
    if codes_kept and not sliced:
        kept = _source_codes(source, ckpt, model, target, want.shape, module, table)
        if kept is not None:
            yield from kept.items()
            return

    def parts(t: torch.Tensor, shape) -> dict[str, torch.Tensor]:
        if tuple(t.shape) != tuple(shape):
            raise SourceError(f"{target} has shape {tuple(t.shape)} in the checkpoint, the model expects {tuple(shape)}")
        # FP8 sources arrive here decoded, one tensor at a time, like every other resident tensor.
        return {target: t.to(want.dtype)} if fmt is None else pack(quantize(t, fmt), fmt, module)

    if sliced:
        step = max(1, RESIDENT_SLICE_BYTES // (4 * want.shape[1]))
        int8_rows = isinstance(fmt, QuantFormat) and fmt.name == "int8" and hasattr(ckpt, "read_int8_rows")

        def piece(r: int) -> dict[str, torch.Tensor]:
            stop = min(rows, r + step)
            if codes_kept:  # the blocks' codes, a slice of rows at a time (a 150k-token embedding: 170 MB of them)
                read_rows = ckpt.read_table_rows if table else ckpt.read_int4_rows
                nibbles, scales, zeros = read_rows(source, r, stop)
                if nibbles.shape[1] * 2 != want.shape[1]:
                    raise SourceError(
                        f"{target} has {nibbles.shape[1] * 2} columns in the checkpoint, the model expects {want.shape[1]}"
                    )
                return int4_parts(module, nibbles, scales.to(torch.bfloat16), zeros.to(torch.bfloat16))
            if int8_rows:  # int8 straight from the blocks (a GGUF's Q6_K LM head), or None: decoded, then quantized
                got = ckpt.read_int8_rows(source, r, stop)
                if got is not None and tuple(got[0].shape) == (stop - r, *want.shape[1:]):
                    return pack(Quantized(got[0], got[1], None), fmt, module)
            return parts(ckpt.read_rows(source, r, stop), (stop - r, *want.shape[1:]))

        pieces = _in_order(piece, range(0, rows, step), ahead=RECORD_WORKERS)
    else:
        whole = ckpt.read(source) if isinstance(source, str) else _run_converter(source, ckpt, model, target)
        pieces = iter([parts(whole, want.shape)])
    rest: dict[str, list[torch.Tensor]] = {}
    for piece_parts in pieces:
        (name, first), *others = piece_parts.items()
        yield name, first
        for other, value in others:
            rest.setdefault(other, []).append(value)
    for name, joined in rest.items():
        yield name, torch.cat(joined, dim=rows_dim(name))


def _expert_record(ckpt, model, name: str, module, sources: dict[str, _ExpertSource], layout: RecordLayout, fmt, e: int):
    """Expert e's record (its stride of bytes, zero-padded) and its payload's checksum."""
    params = dict(expert_parameters(module))
    entries = {t.name: t for t in layout.tensors}
    codes_kept = _keeps_codes(fmt, ckpt, module.is_transposed)
    record = _aligned_zeros(layout.stride)

    def view(entry) -> torch.Tensor:
        return torch.from_numpy(record[entry.offset : entry.offset + entry.nbytes]).view(DTYPES[entry.dtype]).view(entry.shape)

    for p in sources:
        target, shape = f"{name}.{p}", params[p].shape[1:]
        if codes_kept and len(shape) == 2:  # codes come [N, K], as records hold them: copied straight in
            rows_cols = tuple(reversed(shape)) if module.is_transposed else shape
            pieces = _expert_codes(sources[p], e, ckpt, model, target, rows_cols, fmt.name if fmt.table else None)
            if pieces is not None:
                _place_codes(pieces, view(entries[f"{p}.qweight"]), view(entries[f"{p}.scales_zeros"]))
                continue
        t = _expert_tensor(sources[p], e, ckpt, model, target, shape)
        if fmt is not None and t.dim() == 2:
            # Kernels take [N, K]; a module that keeps [K, N] (gpt-oss) is transposed first.
            parts = pack(quantize(t.t() if module.is_transposed else t, fmt), fmt, p)
        else:
            parts = {p: t}
        for part, value in parts.items():
            entry = entries[part]
            record[entry.offset : entry.offset + entry.nbytes] = _tensor_bytes(value.to(DTYPES[entry.dtype]))
    return record, checksum(record[: layout.nbytes])


def _tensor_bytes(t: torch.Tensor):
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


def _cleanup_stale(dst: Path) -> None:
    """Remove temporary directories left by conversions to the same DST that were killed."""
    for stale in dst.parent.glob(f".{dst.name}.partial-*"):
        pid = stale.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _without_collector(fn):
    """`fn` run with Python's garbage collector off: a conversion makes no reference cycles, but its many
    short-lived objects (the tokenizer's vocabulary, the skeleton, the records' tensors) would set it off
    again and again, each pass walking all the objects made so far (4-6% of a GGUF import's CPU time in
    `perf` profiles)."""

    @functools.wraps(fn)
    def without_collector(*args, **kwargs):
        collecting = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if collecting:
                gc.enable()

    return without_collector


@_without_collector
def convert(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    experts_dtype: str | None = None,
    *,
    layer_dtypes: list[str] = (),
    group_size: int | None = None,
    dense_dtype: str | None = None,
    overwrite: bool = False,
    progress: bool = True,
    trust_remote_code: bool = False,
    tokenizer: str | os.PathLike | None = None,
) -> Path:
    """Convert the Hugging Face checkpoint directory `src` (or a llama.cpp GGUF file, gguf_source.py) into a
    moestream store at `dst`.

    experts_dtype: "bf16", "fp16", "fp32" (floats) or "int8", "int6", "int4", "int3", "int2" (quant.py); default:
        the checkpoint's own float dtype (bf16 for FP8/MXFP4 sources); for a GGUF, each layer at the bits
        of its blocks (`_gguf_bits_format`).
    layer_dtypes: per-layer overrides such as ["0-3=int3", "-1=int4"], counted over the MoE layers.
    group_size: inputs per scale of the int6/int4/int3/int2 formats (32, 64 or 128); default 32 (its blocks'
        size for a GGUF, so that 4-bit blocks keep their codes), 64 for int6.
    dense_dtype: "float" (the model's dtype; the default), "int8", "int6" or "int4": the resident linear layers
        (attention projections, shared experts, dense MLPs, an untied LM head at 6 bits at least: int6 in
        groups of 64 unless asked otherwise; not the routers); default for a GGUF: each at the bits of its
        blocks. A layer whose shape the int4 kernel cannot take is stored int8, one neither kernel can take
        stays float.
    tokenizer: a directory whose tokenizer files (EXTRA_FILES) the store gets instead of the source's (a
        GGUF's tokenizer is then not rebuilt from its metadata).
    """
    src, dst = Path(src), Path(dst)
    if tokenizer is not None and not any((Path(tokenizer) / name).is_file() for name in TOKENIZER_FILES):
        raise UsageError(
            f"--tokenizer {tokenizer} holds no tokenizer files ({', '.join(TOKENIZER_FILES)}); pass the directory of "
            "the model's Hugging Face checkpoint or tokenizer"
        )
    # Checked before any work; the rules' syntax and layer numbers are checked once the model is known.
    for choice in [experts_dtype] + [rule.rpartition("=")[2] for rule in layer_dtypes if "=" in rule]:
        if choice is not None and choice not in EXPERT_FORMATS:
            raise UsageError(f"unknown experts dtype {choice!r}; choose one of {', '.join(EXPERT_FORMATS)}")
    if dense_dtype is not None and dense_dtype not in DENSE_FORMATS:
        raise UsageError(f"unknown dense dtype {dense_dtype!r}; choose one of {', '.join(DENSE_FORMATS)}")
    if dst.exists() and not overwrite:
        raise UsageError(f"{dst} already exists; choose another path, delete it, or pass --overwrite")
    gguf = None
    if src.is_file():  # a llama.cpp GGUF file: its metadata is the config, its tensors are decoded to float
        from .gguf_source import GGUFCheckpoint

        gguf = GGUFCheckpoint(src, build_tokenizer=tokenizer is None)
        config = gguf.config
    else:
        config = load_source_config(src, trust_remote_code)
    quantized_source = getattr(config, "quantization_config", None) is not None
    if quantized_source:
        # The store holds decoded floats; the quantization settings of the source no longer apply.
        del config.quantization_config
    model = build_skeleton(config, model_dtype(config))
    ckpt = gguf or DecodedCheckpoint(src)
    try:
        plan = plan_conversion(model, ckpt)
        rules = parse_layer_rules(list(layer_dtypes), len(plan.experts))
        asked_formats = set(rules) | (set(range(len(plan.experts))) if experts_dtype is not None else set())
        asked_group = group_size
        if group_size is None:
            group_size = BLOCK_GROUP if gguf is not None else DEFAULT_GROUP_SIZE

        def group_of(choice: str | None) -> int:
            return group_for(choice, asked_group, group_size)

        if gguf is not None and experts_dtype is None:  # each layer at its blocks' bits, unless a rule says
            rules = {
                i: rules.get(i, _gguf_expert_choice(gguf, sources, module)) for i, (_, module, sources) in enumerate(plan.experts)
            }
        chosen = [rules.get(i, experts_dtype) for i in range(len(plan.experts))]
        formats = [_layer_format(choice, group_of(choice)) for choice in chosen]
        # A format or group size the converter chose itself never fails a layer whose matrices it cannot take:
        # the nearest one that can is taken instead; only an option the user gave ends in that error.
        formats = [
            _fitting(fmt, module, group_asked=asked_group is not None, format_asked=i in asked_formats)
            for i, (fmt, (_, module, _)) in enumerate(zip(formats, plan.experts))
        ]
        linears = [(n, m.out_features, m.in_features, head) for n, m, head in dense_linears(model)]
        if gguf is not None and dense_dtype is None:
            dense = _gguf_dense_formats(gguf, plan, linears, group_of)
        else:
            dense = dense_formats(linears, dense_dtype or "float", group_of(dense_dtype), group_of("int6"))
        if gguf is not None and dense_dtype != "float":  # its quantized token embedding kept quantized
            dense.update(_gguf_embedding_format(gguf, model, plan, group_size))
        dst.parent.mkdir(parents=True, exist_ok=True)
        _cleanup_stale(dst)
        tmp = dst.parent / f".{dst.name}.partial-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        # Records and slices are built by 2 * RECORD_WORKERS threads at once (both sides of `_write_store`);
        # torch's own threads per op on top of them only contend (on two cores: 6% slower, more memory).
        threads = torch.get_num_threads()
        torch.set_num_threads(max(1, threads // (2 * RECORD_WORKERS)))
        try:
            manifest = _write_store(tmp, src, model, ckpt, plan, formats, dense, progress, tokenizer)
            manifest.write(tmp)
            _move_into_place(tmp, dst)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:
            torch.set_num_threads(threads)
    finally:
        ckpt.close()
    return dst


# The store formats a GGUF block type's bits map to by default (None: the checkpoint's float dtype), for
# experts and for resident linear layers (which have no int3/int2 kernels).
_EXPERT_BITS = {2: "int2", 3: "int3", 4: "int4", 6: "int6", 8: "int8", 16: None}
_DENSE_BITS = {4: "int4", 6: "int6", 8: "int8", 16: "float"}


def _gguf_bits_format(bits: float, table: dict[int, str | None]) -> str | None:
    """The format of `table` at the bits nearest a tensor's code bits (Q4_K: 4 -> int4, Q5_K: 5 -> int6,
    Q6_K: 6 -> int6, Q8_0: 8 -> int8, Q3_K: 3 -> int3; float: 16); a tie goes to the wider one, which loses
    nothing."""
    return table[min(table, key=lambda b: (abs(b - bits), -b))]


def _first_key(source) -> str:
    return source if isinstance(source, str) else _group_keys(source)[0]


def _gguf_expert_choice(gguf, sources: dict[str, _ExpertSource], module) -> str | None:
    """An experts layer's default format from a GGUF: the table format its projections' blocks are all codes
    of (MXFP4, IQ4_NL/IQ4_XS: kept exactly); else one format per layer, so the bits of its projections'
    blocks averaged over their weights (Q4_K_M's Q4_K gate and up with a Q6_K down: 4.67 -> int4)."""
    params = dict(expert_parameters(module))
    # A fused parameter's tensor, or the tensors merged into it (gate and up: equal shares of its weights)
    keys = {p: [s.fused_key] if s.fused_key is not None else _group_keys(s.per_expert[0]) for p, s in sources.items()}
    matrices = [k for p, ks in keys.items() if params[p][0].dim() == 2 for k in ks]
    tables = {gguf.table_of(k) for k in matrices}
    if len(tables) == 1 and None not in tables:
        return tables.pop()
    total = weights = 0
    for p in sources:
        bits = sum(gguf.code_bits(k) or 16 for k in keys[p]) / len(keys[p])
        total += bits * params[p][0].numel()
        weights += params[p][0].numel()
    return _gguf_bits_format(total / weights, _EXPERT_BITS)


def _gguf_dense_formats(gguf, plan: ConversionPlan, linears, group_of) -> dict[str, QuantFormat]:
    """Each resident linear layer's default format from a GGUF: the table format its MXFP4/IQ4 blocks are codes
    of (kept exactly); else the bits of its blocks (dense_formats then widens where a kernel cannot take the
    shape, and keeps the LM head at 6 bits at least)."""
    by_choice: dict[str, list] = {}
    dense = {}
    for linear in linears:
        name, n, k, head = linear
        source = plan.resident.get(f"{name}.weight")
        table = gguf.table_of(source) if isinstance(source, str) else None
        if table is not None and not head and k % TABLE_GROUP == 0 and n % 16 == 0:  # MXFP4/IQ4 blocks: kept exactly
            dense[name] = QuantFormat.make(table)
            continue
        bits = gguf.code_bits(_first_key(source)) if source is not None else None
        by_choice.setdefault(_gguf_bits_format(bits or 16, _DENSE_BITS), []).append(linear)
    for choice, group in by_choice.items():
        dense.update(dense_formats(group, choice, group_of(choice), group_of("int6")))
    return dense


def _gguf_embedding_format(gguf, model, plan: ConversionPlan, group_size: int) -> dict[str, QuantFormat]:
    """{name: format} for a GGUF's untied token embedding stored in blocks, so that the store does not hold
    a bf16 copy two to six times their size (core/compute/dense.py's QuantizedEmbedding looks rows up in it): the
    narrowest dense format with at least their code bits, int4 in groups for Q2_K to Q4_K (4-bit blocks of
    32 keep their codes: _keeps_codes), int8 by rows for Q5_x to Q8_0; MXFP4/IQ4 blocks keep theirs in their
    table format. Unlike a linear layer's (nearest bits), a lookup reads one row per token, so its bits cost
    memory, not decode time: Q5_K re-rounded to int4 cost a third more KL on the fixture, int8 nothing
    measurable (docs/BENCHMARKS.md). Other blocks are decoded and quantized a slice of rows at a time. Empty
    for a float embedding, one the LM head shares, or a width no format takes."""
    embedding = model.get_input_embeddings()
    output = model.get_output_embeddings()
    if type(embedding) is not torch.nn.Embedding or (output is not None and output.weight is embedding.weight):
        return {}
    name = next(n for n, m in model.named_modules() if m is embedding)
    source = plan.resident.get(f"{name}.weight")
    bits = gguf.code_bits(source) if isinstance(source, str) else None
    if bits is None:
        return {}
    table = gguf.table_of(source)
    if table is not None:  # MXFP4/IQ4 blocks: their codes kept in the table format
        fmt = QuantFormat.make(table)
    else:
        fmt = QuantFormat.make("int8") if bits > 4 else QuantFormat.make("int4", group_size)
    if fmt.group_size and embedding.embedding_dim % fmt.group_size:
        return {}
    return {name: fmt}


def _fitting(fmt, module, *, group_asked: bool, format_asked: bool):
    """`fmt` for an experts layer, or, where its matrices do not fit it and the converter chose it (not the
    user), the nearest that fits: the same format in smaller groups (a little more scale per weight), then
    int8 (more bits: nothing lost). `inspect` shows the format each layer got."""
    if not isinstance(fmt, QuantFormat):
        return fmt
    shapes = [tuple(p.shape[1:]) for _, p in expert_parameters(module) if p.dim() == 3]
    matrices = [(shape[1], shape[0]) if module.is_transposed else shape for shape in shapes]

    def fits(candidate: QuantFormat) -> bool:
        try:
            for n, k in matrices:
                candidate.check_shape(n, k, "")
        except UsageError:
            return False
        return True

    if fits(fmt):
        return fmt
    candidates = []
    if not group_asked and fmt.group_size and fmt.table is None:
        candidates += [QuantFormat.make(fmt.name, g) for g in sorted(GROUP_SIZES, reverse=True) if g < fmt.group_size]
    if not format_asked:
        candidates.append(QuantFormat.make("int8"))
    return next((c for c in candidates if fits(c)), fmt)  # (none: writing it names what to do)


def _layer_format(choice: str | None, group_size: int) -> torch.dtype | QuantFormat | None:
    """A layer's storage: a float dtype, a quantized format, or None (the checkpoint's own dtype)."""
    if choice is None:
        return None
    return EXPERT_DTYPES[choice] if choice in EXPERT_DTYPES else QuantFormat.make(choice, group_size)


def _layer_layout(name: str, module, sources, ckpt, storage) -> tuple[RecordLayout, QuantFormat | None]:
    """The record layout of one experts module stored as `storage` (see _layer_format)."""
    params = dict(expert_parameters(module))
    shapes = {p: tuple(params[p].shape[1:]) for p in sources}
    fmt = storage if isinstance(storage, QuantFormat) else None
    # Float parts (all parameters, or a quantized layer's biases): the chosen float dtype, else the source's.
    float_dtype = storage if isinstance(storage, torch.dtype) else ckpt.dtype(_first_source_key(sources))
    return RecordLayout.pack(expert_record_specs(shapes, float_dtype, fmt, module.is_transposed, name)), fmt


def _move_into_place(tmp: Path, dst: Path) -> None:
    """Rename the finished store to DST and make the rename durable. With --overwrite the old store is
    first renamed aside, so a crash at any moment leaves a complete store at DST or beside it."""
    old = None
    if dst.exists():
        old = dst.parent / f".{dst.name}.replaced-{os.getpid()}"
        os.rename(dst, old)
    os.rename(tmp, dst)
    directory = os.open(dst.parent, os.O_RDONLY)
    try:
        os.fsync(directory)  # the directory entry, not only the files, must survive a power cut
    finally:
        os.close(directory)
    if old is not None:
        shutil.rmtree(old)


def _resident_tensors(model, plan: ConversionPlan, dense: dict[str, QuantFormat]) -> list:
    """(target, source, storage format or None, the file tensors it becomes) of every resident tensor, in
    the order the files hold them."""
    meta = model.state_dict()
    resident = []
    for target in plan.resident:
        want = meta[target]
        module, _, leaf = target.rpartition(".")
        fmt = dense.get(module) if leaf == "weight" else None
        specs = fmt.record_specs(module, *want.shape) if fmt is not None else [(target, want.dtype, tuple(want.shape))]
        resident.append((target, plan.resident[target], fmt, specs))
    resident.sort(key=lambda entry: resident_order(entry[3][0][0]))  # (a target's parts sort together)
    return resident


def _spec_bytes(specs) -> int:
    return sum(spec_bytes(spec) for spec in specs)


def _write_store(tmp: Path, src: Path, model, ckpt, plan: ConversionPlan, formats, dense, progress, tokenizer=None) -> Manifest:
    layouts = [
        _layer_layout(name, module, sources, ckpt, storage) for (name, module, sources), storage in zip(plan.experts, formats)
    ]
    resident = _resident_tensors(model, plan, dense)
    resident_total = sum(_spec_bytes(specs) for *_, specs in resident)
    experts_total = sum(layout.stride * module.num_experts for (layout, _), (_, module, _) in zip(layouts, plan.experts))
    free = shutil.disk_usage(tmp).free
    need = resident_total + experts_total + 64 * 1024**2
    if free < need:
        raise UsageError(
            f"not enough disk space at {tmp.parent}: the store needs about {format_bytes(need)}, "
            f"{format_bytes(free)} is free. Free space or choose another destination."
        )
    bar = tqdm(total=resident_total + experts_total, unit="B", unit_scale=True, desc="convert", disable=not progress)
    # The resident files are written by a thread of their own while the expert layers are: each side waits
    # on its reads, fsyncs and single-threaded steps where the other computes (docs/BENCHMARKS.md, "GGUF
    # files as a convert source"). An error on either side stops the other before the store is removed.
    stop = threading.Event()
    try:
        with ThreadPoolExecutor(1, thread_name_prefix="moestream-resident") as side:
            resident_files = side.submit(_write_resident, tmp, model, ckpt, resident, bar, stop)
            try:
                layers = _write_expert_layers(tmp, model, ckpt, plan, layouts, bar, stop)
            except BaseException:
                stop.set()
                raise
            files = resident_files.result()
    finally:
        bar.close()  # (on an error too: its message then starts a line of its own, not the bar's)

    # A GGUF source writes the tokenizer it rebuilt from its metadata; a checkpoint directory has the files;
    # --tokenizer's directory replaces either (its generation defaults come from the source all the same).
    extra = ckpt.write_extra_files(tmp) if hasattr(ckpt, "write_extra_files") and tokenizer is None else []
    for name in EXTRA_FILES:
        origin = Path(tokenizer) if tokenizer is not None and name in TOKENIZER_FILES else src
        if (origin / name).is_file() and name not in extra:
            shutil.copyfile(origin / name, tmp / name)
            extra.append(name)
    if plan.unused:
        print(f"note: {len(plan.unused)} checkpoint tensors are not used by the model and were skipped, e.g. {plan.unused[:3]}")
    config = model.config.to_dict()
    config.pop("_experts_implementation", None)
    return Manifest(
        model_config=config,
        experts_dtype=_describe_formats(layers),
        resident_files=files,
        resident_bytes=sum(f.size for f in files),
        layers=layers,
        extra_files=extra,
        source={
            "path_name": src.name,
            "model_type": model.config.model_type,
            **({"gguf_types": ckpt.source_types()} if hasattr(ckpt, "source_types") else {}),
        },
        dense=dense,
    )


def _write_expert_layers(tmp: Path, model, ckpt, plan: ConversionPlan, layouts, bar, stop: threading.Event) -> list[ExpertLayer]:
    """Each MoE layer's experts file, its records built by RECORD_WORKERS threads (`_in_order`) in one stream
    across the layers: the next layer's first records are built while this one's last are written."""
    makers = [
        functools.partial(_expert_record, ckpt, model, name, module, sources, layout, fmt)
        for (name, module, sources), (layout, fmt) in zip(plan.experts, layouts)
    ]
    items = [(index, e) for index, (_, module, _) in enumerate(plan.experts) for e in range(module.num_experts)]
    records = _in_order(lambda item: makers[item[0]](item[1]), items)
    (tmp / "experts").mkdir(exist_ok=True)
    layers, direct = [], []
    try:
        for index, ((name, module, _), (layout, fmt)) in enumerate(zip(plan.experts, layouts)):
            rel = f"experts/layer-{index:03d}.bin"
            offsets, sums = [], []
            out = _RecordsFile(tmp / rel)
            try:
                for _ in range(module.num_experts):
                    record, record_sum = next(records)
                    if stop.is_set():  # the resident side failed: its error is the one to report
                        return layers
                    offsets.append(len(offsets) * layout.stride)
                    sums.append(record_sum)
                    out.write(record)
                    bar.update(layout.stride)
            finally:
                out.close()
            # Written buffered, made durable and dropped from the page cache now (hundreds of GB of it would
            # otherwise sit there); written direct, all at the end: an fsync is a flush of the disk's cache,
            # 0.4 s each here, which per layer had cost a fifth of a 24-layer import (docs/BENCHMARKS.md; on a
            # thread of its own, the flushes slowed the next layer's writes as much).
            (direct.append if out.direct else _make_durable)(tmp / rel)
            layers.append(ExpertLayer(index, name, rel, layout, tuple(offsets), tuple(sums), fmt))
    finally:
        records.close()  # (an early return or an error: the records still being built are waited for)
    for path in direct:
        _make_durable(path)
    return layers


class _RecordsFile:
    """A new experts file written one record at a time (4 KiB-aligned buffers of a multiple of 4 KiB,
    `_aligned_zeros`), with O_DIRECT where the filesystem takes it: records go from memory to the disk
    without a copy into the page cache and the kernel's writeback of it later, CPU time that an import on
    two cores is short of (docs/BENCHMARKS.md, "GGUF files as a convert source"), and hundreds of GB
    written once leave the page cache alone. Buffered writes where O_DIRECT is refused (tmpfs), at the
    open or at the first write."""

    def __init__(self, path: Path):
        self.path, self.written = path, 0
        self.fd, self.direct = self._open(hasattr(os, "O_DIRECT"))

    def _open(self, direct: bool) -> tuple[int, bool]:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        if direct:
            try:
                return os.open(self.path, flags | os.O_DIRECT, 0o644), True
            except OSError:
                pass
        return os.open(self.path, flags, 0o644), False

    def write(self, record: np.ndarray) -> None:
        try:
            _write_all(self.fd, record)
        except OSError as e:
            if not (self.direct and self.written == 0 and e.errno == errno.EINVAL):
                raise
            os.close(self.fd)  # opened with O_DIRECT, but its writes refused: buffered from the start
            self.fd, self.direct = self._open(False)
            _write_all(self.fd, record)
        self.written += len(record)

    def close(self) -> None:
        os.close(self.fd)


def _make_durable(path: Path) -> None:
    """fsync a written experts file, then drop what the page cache holds of it (a buffered file's pages): it
    is read by O_DIRECT, and hundreds of GB written once should not push out what the machine caches."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _write_all(fd: int, record: np.ndarray) -> None:
    view = memoryview(record)
    while view:
        view = view[os.write(fd, view) :]


def _aligned_zeros(nbytes: int) -> np.ndarray:
    """nbytes zeros starting on a 4 KiB boundary (O_DIRECT writes them as they are, `_RecordsFile`)."""
    raw = np.zeros(nbytes + RECORD_ALIGNMENT, dtype=np.uint8)
    start = -raw.ctypes.data % RECORD_ALIGNMENT
    return raw[start : start + nbytes]


def _write_resident(tmp: Path, model, ckpt, resident: list, bar, stop: threading.Event) -> list[FileEntry]:
    """The resident safetensors files, in shards of about RESIDENT_SHARD_BYTES. Sets `stop` if it fails;
    returns early once `stop` is set by the experts' side."""
    meta = model.state_dict()
    files = []
    try:
        for shard in _shards(resident):
            rel = f"resident-{len(files) + 1:05d}.safetensors"
            writer = ResidentFileWriter(tmp / rel, [spec for *_, specs in shard for spec in specs], metadata={"format": "pt"})
            for target, source, fmt, specs in shard:
                for name, piece in _resident_pieces(target, source, fmt, meta[target], ckpt, model):
                    if stop.is_set():
                        writer.abandon()
                        return files
                    writer.write(name, piece)
                bar.update(_spec_bytes(specs))
            files.append(FileEntry(rel, writer.nbytes, writer.close()))
    except BaseException:
        stop.set()
        raise
    return files


def _describe_formats(layers: list[ExpertLayer]) -> str:
    """What `inspect` shows as the experts dtype: one name, or "mixed: ..." with the layers of each."""
    names = [
        f"{layer.quantization.name}" + (f"-g{layer.quantization.group_size}" if layer.quantization.group_size else "")
        if layer.quantization
        else layer.layout.tensors[0].dtype
        for layer in layers
    ]
    if len(set(names)) == 1:
        return names[0]
    return "mixed: " + ", ".join(f"{n} x{names.count(n)}" for n in dict.fromkeys(names))


def _first_source_key(sources: dict[str, _ExpertSource]) -> str:
    src = next(iter(sources.values()))
    if src.fused_key is not None:
        return src.fused_key
    return next(iter(src.per_expert[0].keys.values()))[0]
