"""The errors moestream raises on purpose. Each message names the problem and what to do about it."""


class MoestreamError(Exception):
    """Base class: the CLI prints these as one clear line instead of a traceback."""


class UsageError(MoestreamError, ValueError):
    """A bad argument: a size that does not parse, a budget too small, an unknown dtype."""


class SourceError(MoestreamError):
    """The Hugging Face checkpoint being converted is missing something or is malformed."""


class StoreError(MoestreamError):
    """A store directory is missing, damaged, truncated, foreign or of an unsupported version."""


class ExpertReadError(MoestreamError, OSError):
    """Reading an expert record from disk failed (after retries) or returned the wrong bytes."""


class RecordChecksumError(ExpertReadError):
    """An expert record read from disk does not match the checksum in the manifest: the store is damaged."""


class ReadsInterrupted(MoestreamError):
    """A forward pass was cut short on purpose: the model is stopping (a server's drain ran out of time), so
    the step ends at its next MoE layer, or at once where it waits for a stalled disk."""
