"""moestream: run Mixture-of-Experts models larger than memory by streaming experts from disk.

Public API:
    moestream.convert(src, dst, experts_dtype=None)   # Hugging Face checkpoint -> store
    moestream.load(store, memory="4GiB")               # -> (transformers model, tokenizer)
    moestream.stats(model)                             # cache hits, misses, bytes read, per layer
    moestream.close(model)                             # stop its reader threads, release its cache
"""

__version__ = "0.1.0"

from .conversion.convert import convert  # noqa: E402
from .core.loading import close, load, stats  # noqa: E402

__all__ = ["close", "convert", "load", "stats", "__version__"]
