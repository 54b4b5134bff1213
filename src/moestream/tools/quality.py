"""How far a store's next-token distributions are from a reference model's on the same text.

`moestream eval` answers "what did converting (and, for low-bit expert formats, quantizing) cost?" with
numbers that can be compared across formats and models:

- perplexity of each model on the text, and the store's change relative to the reference in %;
- KL(reference || store) of the next-token distributions, mean and 99th percentile over positions
  (the mean hides rare large disagreements, the tail shows them);
- top-1 agreement: the fraction of positions where both models would pick the same greedy token.

The text is tokenized once, without special tokens, by the store's tokenizer; its first `max_tokens`
ids are cut into non-overlapping windows of `context` tokens, and each window is one teacher-forced
forward of each model (no KV cache). A window of L tokens predicts L - 1 positions, so the first token
of every window is context only. Both models see exactly the same ids.

Only one window's logits of each model exist at a time: the reference runs on a window, then the store,
and the window's metrics are reduced before the next one. Keeping the reference's full distributions for
a whole text instead would cost vocab x tokens x 4 bytes (151k x 1024 x 4 = 620 MB for Qwen3).
"""

from __future__ import annotations

import math
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from .. import choices
from ..conversion.store import MANIFEST
from ..errors import SourceError, StoreError, UsageError

# Positions whose log-softmax is held in float64 at once: bounds the transient memory of one window to
# about 3 x chunk x vocab x 8 bytes (37 MB for a 151k vocabulary) however long the window is.
POSITION_CHUNK = 16
# KL is a difference of nearly equal log-probabilities; float64 keeps its rounding error (~1e-16 per
# term) far below the differences a quantized format causes (1e-4 and up).
METRIC_DTYPE = torch.float64


@dataclass
class QualityReport:
    store: str
    reference: str
    reference_kind: str  # "checkpoint" (a Hugging Face directory), "store", or "gguf" (a llama.cpp file)
    experts_dtype: (
        str  # the store's expert format (manifest experts_dtype: "int4-g32", "mixed: ..."), so reports can be told apart
    )
    reference_dtype: str  # the reference's: a store's expert format, or the dtype a checkpoint was loaded in
    tokens: int  # predicted positions, over all windows
    windows: int
    context: int
    store_perplexity: float
    reference_perplexity: float
    perplexity_change_percent: float  # (store / reference - 1) x 100
    kl_mean: float  # nats, KL(reference || store)
    kl_p99: float  # nats, 99th percentile over positions (linear interpolation, numpy's default)
    top1_agreement: float
    store_seconds: float  # forward passes only
    reference_seconds: float
    store_load_seconds: float = 0.0
    reference_load_seconds: float = 0.0
    store_cache: dict = field(default_factory=dict)  # hit rate, bytes read, rerouted choices during the forwards
    decode: bool = False  # the store decoded token by token (--decode)
    route_to_cached: float = 0.0  # the store's cache-aware routing margin (0: off)
    activations: str = ""  # what the store's low-bit matmuls took (plan.choose_activations' note)
    reference_activations: str = ""  # the same of a store reference

    def to_json(self) -> dict:
        return asdict(self)

    def table(self) -> str:
        """An aligned two-column table: metric and value, the store's numbers next to the reference's."""
        ref_tps = self.tokens / self.reference_seconds if self.reference_seconds else 0.0
        store_tps = self.tokens / self.store_seconds if self.store_seconds else 0.0
        rows = [
            ("store", f"{self.store} (experts {self.experts_dtype})"),
            ("reference", f"{self.reference} ({self.reference_kind}, experts {self.reference_dtype})"),
            (
                "tokens evaluated",
                f"{self.tokens} in {self.windows} windows of up to {self.context}"
                + (", the store decoding one token at a time" if self.decode else ""),
            ),
            ("perplexity", f"store {self.store_perplexity:.4f} | reference {self.reference_perplexity:.4f}"),
            ("perplexity change", f"{self.perplexity_change_percent:+.4f} %"),
            ("KL(ref || store) mean", f"{self.kl_mean:.3e} nats"),
            ("KL(ref || store) p99", f"{self.kl_p99:.3e} nats"),
            ("top-1 agreement", f"{self.top1_agreement:.2%}"),
            (
                "forward seconds",
                f"store {self.store_seconds:.2f} s ({store_tps:.0f} tok/s) | "
                f"reference {self.reference_seconds:.2f} s ({ref_tps:.0f} tok/s)",
            ),
            ("load seconds", f"store {self.store_load_seconds:.2f} s | reference {self.reference_load_seconds:.2f} s"),
        ]
        if self.activations:
            rows.append(
                (
                    "low-bit matmuls",
                    f"store {self.activations}"
                    + (f" | reference {self.reference_activations}" if self.reference_activations else ""),
                )
            )
        if self.store_cache:
            c = self.store_cache
            rows.append(("store cache", f"hit rate {c['hit_rate']:.1%}, read {c['bytes_read'] / 2**20:.1f} MiB"))
        if self.route_to_cached:
            rows.append(
                (
                    "cache-aware routing",
                    f"margin {self.route_to_cached:g}: {self.store_cache.get('rerouted', 0)} choices rerouted",
                )
            )
        width = max(len(name) for name, _ in rows)
        return "\n".join(f"  {name:<{width}}  {value}" for name, value in rows)


# -- the comparison on loaded models ---------------------------------------------------------------------


def token_windows(ids: torch.Tensor, context: int) -> list[torch.Tensor]:
    """Non-overlapping windows of `context` ids; a trailing window of one id predicts nothing and is dropped."""
    return [w for w in torch.split(ids, context) if w.numel() >= 2]


def vocab_size(model) -> int:
    """The number of logits the model produces (the LM head's rows; padded vocabularies count the padding)."""
    head = model.get_output_embeddings()
    weight = getattr(head, "weight", None)
    return int(weight.shape[0]) if weight is not None else int(model.config.vocab_size)


@dataclass
class _Totals:
    """Running sums over windows: only per-position KL values are kept (8 bytes each), for the percentile."""

    nll_store: float = 0.0
    nll_reference: float = 0.0
    agree: int = 0
    kl: list = field(default_factory=list)

    def add(self, ref_logits: torch.Tensor, store_logits: torch.Tensor, targets: torch.Tensor) -> None:
        for start in range(0, targets.numel(), POSITION_CHUNK):
            span = slice(start, start + POSITION_CHUNK)
            ref = torch.log_softmax(ref_logits[span].to(METRIC_DTYPE), dim=-1)
            store = torch.log_softmax(store_logits[span].to(METRIC_DTYPE), dim=-1)
            t = targets[span, None]
            self.nll_reference -= ref.gather(-1, t).sum().item()
            self.nll_store -= store.gather(-1, t).sum().item()
            # A token both models mask with -inf logits contributes 0, not nan (0 x (-inf - -inf)); a token
            # only the store masks contributes +inf, which is the true KL.
            p = ref.exp()
            self.kl.append(torch.where(p > 0, p * (ref - store), 0.0).sum(-1))
            self.agree += int((ref.argmax(-1) == store.argmax(-1)).sum().item())


def compare_models(
    store_model,
    reference_model,
    ids: torch.Tensor,
    context: int = choices.EVAL_CONTEXT,
    progress: bool = False,
    decode: bool = False,
) -> dict:
    """Metrics of `store_model` against `reference_model` on the 1-D token ids `ids`.

    decode: the store predicts each window one token at a time with its KV cache (`decode_logits`), as
    it generates, instead of in one forward pass; the reference always runs the window at once.
    Returns the metric fields of QualityReport (tokens, windows, perplexities, KL, agreement, seconds).
    """
    if context < 2:
        raise UsageError(f"--context must be at least 2 tokens (one to condition on, one to predict), not {context}")
    ids = ids.reshape(-1).long()
    windows = token_windows(ids, context)
    if not windows:
        raise UsageError(
            f"the text is {ids.numel()} token(s) long; at least 2 are needed (one to condition on, one to "
            "predict). Pass a longer text."
        )
    store_vocab, ref_vocab = vocab_size(store_model), vocab_size(reference_model)
    if store_vocab != ref_vocab:
        raise UsageError(
            f"the store predicts over {store_vocab} tokens and the reference over {ref_vocab}: their next-token "
            "distributions cannot be compared. Pass the checkpoint the store was converted from (or a store of it)."
        )
    if int(ids.max()) >= store_vocab:
        raise UsageError(
            f"the tokenizer produced id {int(ids.max())}, outside the model's {store_vocab}-token vocabulary; "
            "the store's tokenizer does not belong to its model. Convert the model again."
        )
    totals = _Totals()
    seconds = {"store": 0.0, "reference": 0.0}
    with torch.inference_mode():
        for window in tqdm(windows, desc="windows", unit="window", disable=not progress):
            batch = window[None]
            logits = {}
            for side, model in (("reference", reference_model), ("store", store_model)):
                start = time.perf_counter()
                device = model.device if model.device.type == "cuda" else batch.device  # a store on a GPU
                if side == "store" and decode:
                    logits[side] = decode_logits(model, batch.to(device))
                else:  # use_cache=False: one teacher-forced pass per window, a KV cache would only cost memory
                    logits[side] = model(batch.to(device), use_cache=False).logits[0, :-1].cpu()
                seconds[side] += time.perf_counter() - start
            totals.add(logits["reference"], logits["store"], window[1:])
            del logits  # only one window's logits of each model at a time
    kl = torch.cat(totals.kl).numpy()
    tokens = int(kl.size)
    store_ppl = math.exp(totals.nll_store / tokens)
    ref_ppl = math.exp(totals.nll_reference / tokens)
    return {
        "tokens": tokens,
        "windows": len(windows),
        "context": context,
        "store_perplexity": store_ppl,
        "reference_perplexity": ref_ppl,
        "perplexity_change_percent": (store_ppl / ref_ppl - 1.0) * 100.0,
        # Clamped at 0: a KL that rounds to -1e-17 is 0, and a negative number in a report reads as a bug.
        "kl_mean": max(float(kl.mean()), 0.0),
        "kl_p99": max(float(np.percentile(kl, 99)), 0.0),
        "top1_agreement": totals.agree / tokens,
        "store_seconds": seconds["store"],
        "reference_seconds": seconds["reference"],
    }


def decode_logits(model, batch: torch.Tensor) -> torch.Tensor:
    """[L - 1, vocab]: the next-token logits after each of a window's first L - 1 tokens, fed one at a time
    with the KV cache (teacher forced): every experts call a decode step's one-token call."""
    from ..generation.serving import teacher_forced

    steps: list[torch.Tensor] = []
    teacher_forced(model, batch[0, :-1], on_logits=steps.append)
    return torch.stack(steps)


# -- loading both sides ----------------------------------------------------------------------------------


def reference_kind(path: Path) -> str:
    """'store' (has manifest.json), 'checkpoint' (config.json and *.safetensors) or 'gguf' (a .gguf file, or
    the first of a split set); anything else is an error."""
    if path.is_file() and path.suffix == ".gguf":
        return "gguf"
    if not path.is_dir():
        raise UsageError(
            f"--reference {path} is not a directory nor a .gguf file; pass a Hugging Face checkpoint directory, a store "
            "or a llama.cpp GGUF file"
        )
    if (path / MANIFEST).is_file():
        return "store"
    if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        return "checkpoint"
    raise UsageError(
        f"--reference {path} is neither a moestream store (no {MANIFEST}) nor a Hugging Face checkpoint "
        "(config.json with *.safetensors); pass the checkpoint the store was converted from, or another store"
    )


REFERENCE_DTYPES = {name: getattr(torch, name) for name in choices.REFERENCE_DTYPES}


def _gguf_reference(path: Path, beside: Path, progress: bool) -> Path:
    """A GGUF file as a reference: its blocks dequantized into a temporary store beside `beside` (experts in
    float32, resident weights in the file's float dtype, as `convert --experts-dtype fp32` stores them),
    which the caller removes. The store streams under the budget like any other, so a large file needs disk
    for its float weights, not memory; that is checked first."""
    import tempfile

    from ..conversion.convert import convert
    from ..conversion.gguf_source import GGUFCheckpoint

    source = GGUFCheckpoint(path)  # refuses a truncated, foreign or unsupported file in one line
    try:
        needed = sum(4 * math.prod(t.shape) for t in source.tensors.values())
    finally:
        source.close()
    free = shutil.disk_usage(beside).free
    if needed > free:
        raise UsageError(
            f"--reference {path}: its weights dequantized to float32 take about {needed / 2**30:.1f} GiB, and {beside} has "
            f"{free / 2**30:.1f} GiB free; convert it yourself where there is room (moestream convert {path} REF "
            "--experts-dtype bf16) and pass that store as --reference"
        )
    directory = Path(tempfile.mkdtemp(prefix=".moestream-eval-reference-", dir=beside))
    try:
        return convert(path, directory / "store", "fp32", dense_dtype="float", progress=progress)
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise


def _load_checkpoint(path: Path, progress: bool, dtype_name: str | None = None):
    """The reference as transformers loads it: its own dtype (or `dtype_name`), safetensors only, never
    custom code. float32 measures a store against full precision, bf16 rounding included."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from ..conversion.skeleton import load_source_config, model_dtype

    config = load_source_config(path)  # refuses auto_map (custom code) and unknown model types, clearly
    dtype = REFERENCE_DTYPES[dtype_name] if dtype_name else model_dtype(config)
    bar_was_on = hf_logging.is_progress_bar_enabled()
    if not progress:
        hf_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, local_files_only=True, trust_remote_code=False, use_safetensors=True
        )
    except Exception as e:  # transformers raises many types (quantizers needing a GPU, missing keys, ...)
        raise SourceError(
            f"transformers cannot load the reference checkpoint {path} ({type(e).__name__}: {e}). Convert it "
            "with `moestream convert` and pass the resulting store as --reference instead."
        ) from None
    finally:
        if bar_was_on:
            hf_logging.enable_progress_bar()
    return model.eval(), str(dtype).removeprefix("torch.")


def _checkpoint_tokenizer(path: Path):
    """The reference checkpoint's tokenizer, or None when it has none or it cannot be loaded."""
    from ..core.loading import load_tokenizer

    try:
        return load_tokenizer(path)
    except StoreError:
        # The tokenizer is only used to cross-check the store's; an unloadable one cannot be cross-checked.
        return None


def _encode(tokenizer, text: str) -> torch.Tensor:
    # Without special tokens: the windows are cut from the middle of the text, and a BOS id on the first
    # window only would make that window unlike the others.
    return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)


def compare(
    store: str | os.PathLike,
    reference: str | os.PathLike,
    text: str,
    *,
    max_tokens: int = choices.EVAL_MAX_TOKENS,
    context: int = choices.EVAL_CONTEXT,
    memory: str | int = choices.EVAL_MEMORY,
    reference_dtype: str | None = None,
    progress: bool = False,
    device: str = "cpu",
    gpu_memory: str | int | None = None,
    decode: bool = False,
    route_to_cached: float = 0.0,
    activations: str | None = None,
    reference_activations: str = "float",
    attention: str | None = None,
    kv_cache_dtype: str = "auto",
) -> QualityReport:
    """Compare a store with a reference (a Hugging Face checkpoint directory or another store) on `text`.

    memory: the expert cache budget of the store (and of the reference, when it is a store too).
    device, gpu_memory: where the store (and a store reference) computes, as `moestream.load` takes them;
        a checkpoint reference stays on the CPU.
    reference_dtype: load a checkpoint reference in this dtype ("float32", "bfloat16", "float16")
        instead of its own; stores always compute in their own dtype.
    decode: the store decodes each window token by token (`compare_models`).
    route_to_cached: the store's cache-aware routing margin (`moestream.load`), 0 for off.
    activations, reference_activations: what the low-bit matmuls of the store and of a store reference take
        (`moestream.load`); the store against itself with "int8" and "float" prices int8 activations.
    attention: the store's attention function (`moestream.load`); a store reference keeps sdpa, so the store
        against itself with `decode` (one query per step: where the kernel runs) prices the kernel.
    kv_cache_dtype: the store's KV cache (`moestream.load`): "int8" against itself with `decode` prices the
        8-bit cache (with the kernel's own price; `attention` alone gives that one apart).
    """
    from ..core.loading import load, stats
    from ..core.runtime import runtime_of

    if max_tokens < 2:
        raise UsageError(f"--max-tokens must be at least 2 (one to condition on, one to predict), not {max_tokens}")
    if context < 2:
        raise UsageError(f"--context must be at least 2 tokens (one to condition on, one to predict), not {context}")
    store, reference = Path(store), Path(reference)
    kind = reference_kind(reference)
    if reference_dtype is not None and (reference_dtype not in REFERENCE_DTYPES or kind != "checkpoint"):
        raise UsageError(
            f"--reference-dtype {reference_dtype} needs a checkpoint reference and one of {', '.join(REFERENCE_DTYPES)}"
        )

    start = time.perf_counter()
    store_model, tokenizer = load(
        store,
        memory,
        device=device,
        gpu_memory=gpu_memory,
        route_to_cached=route_to_cached,
        activations=activations,
        attention=attention,
        kv_cache_dtype=kv_cache_dtype,
    )
    store_load = time.perf_counter() - start
    if tokenizer is None:
        raise UsageError(
            f"the store {store} has no tokenizer files, so the text cannot be turned into tokens; convert from a "
            "checkpoint directory that includes its tokenizer"
        )
    limit = getattr(store_model.config, "max_position_embeddings", None)
    if isinstance(limit, int) and context > limit:
        raise UsageError(f"--context {context} is longer than the model's {limit} positions; pass --context {limit} or less")
    ids = _encode(tokenizer, text)[:max_tokens]
    if ids.numel() < 2:  # found before the reference is loaded, which can take minutes for a large one
        raise UsageError(
            f"the text is {ids.numel()} token(s) long; at least 2 are needed (one to condition on, one to "
            "predict). Pass a longer text."
        )

    start = time.perf_counter()
    if kind == "gguf":
        converted = _gguf_reference(reference, store.resolve().parent, progress)
        try:
            reference_model, ref_tokenizer = load(
                converted, memory, device=device, gpu_memory=gpu_memory, activations=reference_activations, attention="sdpa"
            )
        finally:
            # The loaded model holds its files open (Linux keeps them readable); the directory goes now.
            shutil.rmtree(converted.parent, ignore_errors=True)
        reference_dtype = "float32, dequantized"
    elif kind == "store":
        reference_model, ref_tokenizer = load(
            reference, memory, device=device, gpu_memory=gpu_memory, activations=reference_activations, attention="sdpa"
        )
        reference_dtype = runtime_of(reference_model).store.manifest.experts_dtype
    else:
        reference_model, reference_dtype = _load_checkpoint(reference, progress, reference_dtype)
        ref_tokenizer = _checkpoint_tokenizer(reference)
    reference_load = time.perf_counter() - start
    if ref_tokenizer is not None and not torch.equal(_encode(ref_tokenizer, text)[:max_tokens], ids):
        raise UsageError(
            f"the reference {reference} tokenizes the text differently from the store {store}: the two models "
            "do not share a vocabulary, so their distributions cannot be compared"
        )

    runtime = runtime_of(store_model)
    runtime.reset_stats()
    metrics = compare_models(store_model, reference_model, ids, context, progress, decode)
    cache = runtime.stats()
    return QualityReport(
        store=str(store),
        reference=str(reference),
        reference_kind=kind,
        experts_dtype=runtime.store.manifest.experts_dtype,
        reference_dtype=reference_dtype,
        store_load_seconds=store_load,
        reference_load_seconds=reference_load,
        store_cache={"hit_rate": cache["hit_rate"], "bytes_read": cache["bytes_read"], "rerouted": cache["rerouted"]},
        decode=decode,
        route_to_cached=route_to_cached,
        activations=_low_bit_note(stats(store_model)),
        reference_activations=_low_bit_note(stats(reference_model)) if kind != "checkpoint" else "",
        **metrics,
    )


def _low_bit_note(model_stats: dict) -> str:
    return next((p["note"] for p in model_stats.get("fast_paths", []) if p["name"] == "low-bit matmuls"), "")
