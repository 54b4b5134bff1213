"""The package version: its one definition (pyproject.toml reads it from here)."""

__version__ = "0.1.0"
