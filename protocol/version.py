"""The kvswitch release every process reports (WorkerInfo.version, RouterInfo.version, --version).

It lives in protocol because it travels on the wire; pyproject.toml's version must match it.
"""

__all__ = ["__version__"]

__version__ = "0.1.0"
