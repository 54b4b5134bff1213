"""moestream: run Mixture-of-Experts models larger than memory by streaming experts from disk.

Public API:
    moestream.convert(src, dst, experts_dtype=None)   # Hugging Face checkpoint -> store
    moestream.load(store, memory="4GiB")               # -> (transformers model, tokenizer)
    moestream.generate_batch(model, tok, prompts, 64)  # several prompts decoded together -> results in order
    moestream.SamplingParams.greedy(64)                # how (temperature, top_p, seed, stop, ...): generate_batch's params
    moestream.stats(model)                             # cache hits, misses, bytes read, per layer
    moestream.close(model)                             # stop its reader threads, release its cache
"""

from .version import __version__

__all__ = ["SamplingParams", "close", "convert", "generate_batch", "load", "stats", "__version__"]


def __getattr__(name: str):
    # The API is imported on first use: `moestream --help` (which imports this package) must not wait
    # seconds for torch and transformers before it knows whether it needs them.
    if name == "convert":
        from .conversion.convert import convert

        return convert
    if name == "generate_batch":
        from .generation.serving import generate_batch

        return generate_batch
    if name == "SamplingParams":
        from .generation.generate import SamplingParams

        return SamplingParams
    if name in ("close", "load", "stats"):
        from .core import loading

        return getattr(loading, name)
    raise AttributeError(f"module 'moestream' has no attribute {name!r}")
