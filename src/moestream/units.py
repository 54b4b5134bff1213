"""Human byte sizes: parse "4GiB" / "512MB" / "1.5G" and print them back."""

from __future__ import annotations

import re

from .errors import UsageError

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kb": 1000,
    "kib": 1024,
    "m": 1024**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1024**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "t": 1024**4,
    "tb": 1000**4,
    "tib": 1024**4,
}


def parse_bytes(text: str | int | float) -> int:
    """Parse a byte size. Bare numbers are bytes; K/M/G/T alone mean binary units (like `free -g`)."""
    if isinstance(text, (int, float)):
        value = int(text)
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
        if not match or match.group(2).lower() not in _UNITS:
            raise UsageError(f"cannot read the size {text!r}: write a number with a unit, e.g. 512MiB, 4GiB or 1.5GB")
        value = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if value < 0:
        raise UsageError(f"a size cannot be negative: {text!r}")
    return value


def format_bytes(n: float) -> str:
    """Binary units with three significant digits: 1.50 GiB, 384 MiB, 12.0 KiB."""
    for unit, scale in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= scale:
            value = n / scale
            return f"{value:.3g} {unit}" if value < 100 else f"{value:.0f} {unit}"
    return f"{int(n)} B"
