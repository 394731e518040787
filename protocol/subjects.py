"""NATS subject and etcd key names (DESIGN.md). No other module formats a subject or key."""

from __future__ import annotations

import re

__all__ = [
    "DEFAULT_NAMESPACE",
    "cancel",
    "config_key",
    "gen",
    "gen_wildcard",
    "kv",
    "kv_all",
    "kvstate",
    "load",
    "load_all",
    "router_key",
    "routers_prefix",
    "sync",
    "validate_namespace",
    "worker_from_key",
    "worker_key",
    "workers_prefix",
]

DEFAULT_NAMESPACE = "kvswitch"
_TOKEN = re.compile(r"[A-Za-z0-9_-]+")


def validate_namespace(ns: str) -> str:
    """A namespace is one NATS token and one etcd path segment."""
    if not _TOKEN.fullmatch(ns):
        raise ValueError(f"namespace {ns!r} must match [A-Za-z0-9_-]+")
    return ns


def _token(value: str, what: str) -> str:
    if not _TOKEN.fullmatch(value):
        raise ValueError(f"{what} {value!r} must match [A-Za-z0-9_-]+")
    return value


# --- NATS ----------------------------------------------------------------------------------------


def kv(ns: str, worker: str) -> str:
    return f"{ns}.kv.{_token(worker, 'worker id')}"


def kv_all(ns: str) -> str:
    return f"{ns}.kv.*"


def kvstate(ns: str, worker: str) -> str:
    return f"{ns}.kvstate.{_token(worker, 'worker id')}"


def load(ns: str, worker: str) -> str:
    return f"{ns}.load.{_token(worker, 'worker id')}"


def load_all(ns: str) -> str:
    return f"{ns}.load.*"


def gen(ns: str, role: str, worker: str) -> str:
    return f"{ns}.gen.{_token(role, 'role')}.{_token(worker, 'worker id')}"


def gen_wildcard(ns: str) -> str:
    return f"{ns}.gen.*.*"


def cancel(ns: str, worker: str) -> str:
    return f"{ns}.cancel.{_token(worker, 'worker id')}"


def sync(ns: str) -> str:
    return f"{ns}.router.sync"


# --- etcd ------------------------------------------------------------------------------------------


def workers_prefix(ns: str) -> str:
    return f"/{ns}/workers/"


def worker_key(ns: str, worker: str) -> str:
    return workers_prefix(ns) + _token(worker, "worker id")


def worker_from_key(ns: str, key: str) -> str:
    prefix = workers_prefix(ns)
    if not key.startswith(prefix):
        raise ValueError(f"{key!r} is not under {prefix!r}")
    return key[len(prefix) :]


def routers_prefix(ns: str) -> str:
    return f"/{ns}/routers/"


def router_key(ns: str, router: str) -> str:
    return routers_prefix(ns) + _token(router, "router id")


def config_key(ns: str) -> str:
    return f"/{ns}/config/router"
