"""NATS subject and etcd key names (DESIGN.md). No other module formats a subject or key."""

from __future__ import annotations

import re

__all__ = [
    "DEFAULT_NAMESPACE",
    "cancel",
    "config_key",
    "engine_key",
    "engines_prefix",
    "gen",
    "kv",
    "kv_all",
    "kvstate",
    "kvstate_all",
    "load",
    "load_all",
    "name_from_key",
    "router_key",
    "routers_prefix",
    "sync",
    "validate_namespace",
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


def kvstate_all(ns: str) -> str:
    return f"{ns}.kvstate.*"


def load(ns: str, worker: str) -> str:
    return f"{ns}.load.{_token(worker, 'worker id')}"


def load_all(ns: str) -> str:
    return f"{ns}.load.*"


def gen(ns: str, role: str, worker: str) -> str:
    return f"{ns}.gen.{_token(role, 'role')}.{_token(worker, 'worker id')}"


def cancel(ns: str, worker: str) -> str:
    return f"{ns}.cancel.{_token(worker, 'worker id')}"


def sync(ns: str) -> str:
    return f"{ns}.router.sync"


# --- etcd ------------------------------------------------------------------------------------------


def workers_prefix(ns: str) -> str:
    return f"/{ns}/workers/"


def worker_key(ns: str, worker: str) -> str:
    return workers_prefix(ns) + _token(worker, "worker id")


def name_from_key(prefix: str, key: bytes) -> str:
    """The name `key` has under `prefix` (`workers_prefix`, `routers_prefix`): the key with the
    prefix cut off. Never raises (one bad key must not end a watch, and with it every consumer's
    view): a key that is not UTF-8, which anyone who may write under the prefix can put, has its bad
    bytes escaped (`\\xff`), and one not under `prefix` is named whole (it starts with `/`); both
    are names no id has, for the consumer to refuse."""
    start = prefix.encode()
    return (key[len(start) :] if key.startswith(start) else key).decode(errors="backslashreplace")


def routers_prefix(ns: str) -> str:
    return f"/{ns}/routers/"


def router_key(ns: str, router: str) -> str:
    return routers_prefix(ns) + _token(router, "router id")


def engines_prefix(ns: str) -> str:
    return f"/{ns}/engines/"


def engine_key(ns: str, engine: str) -> str:
    """The claim on one engine (worker_shim.engine_claim): `engine` is its identity, `host:port`
    and path, with `/` in it, so it is not a token; it is only ever a key's last part."""
    if not engine or any(c.isspace() for c in engine):
        raise ValueError(f"engine identity {engine!r} must be non-empty with no whitespace")
    return engines_prefix(ns) + engine


def config_key(ns: str) -> str:
    return f"/{ns}/config/router"
