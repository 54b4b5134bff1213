"""Measurement: bench (against the disk's limit and peers), routing traces, the cache simulator, plan
(before downloading), plots, eval (quality against a reference) and the demo."""
