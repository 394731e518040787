"""kvswitch: the CLI and the local cluster supervisor (the embedded default)."""

from protocol.version import __version__

__all__ = ["__version__"]
