"""kvswitch: the CLI and the local cluster supervisor (the embedded default)."""

__version__ = "0.1.0"
