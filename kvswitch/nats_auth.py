"""NATS authorization for one kvswitch namespace: who may publish and subscribe to what.

DESIGN.md's "Permissions follow the subjects", as nats-server users:
- a worker (one shim, started with `--worker-name NAME`) publishes only `{ns}.kv.NAME` and
  `{ns}.load.NAME`, plus replies to the requests it was sent (`allow_responses`: at most
  RESPONSE_MAX messages per request, for `response_ttl_s`; a streamed response is one message per
  chunk, so the count is high and the time bounds it); it subscribes only to
  `{ns}.gen.{role}.NAME`, `{ns}.cancel.NAME` and `{ns}.kvstate.NAME`. It cannot read another
  worker's prompts, forge another worker's KV events or load, or answer requests not sent to it.
- a router publishes anything in the namespace except worker subjects (`kv`, `load`), and
  subscribes to anything in the namespace and to reply inboxes (`_INBOX.>`).
- nobody else connects: with users defined, nats-server refuses a client without credentials.

Every identity is an nkey: the server's block holds public keys only, so it is no secret; each
process gets its own seed file (`--nats-nkey-file`), readable by its owner alone.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

import nkeys
import yaml

from protocol import subjects
from protocol.config import MAX_RESPONSE_TTL_S
from protocol.messages import Role

__all__ = [
    "MAX_RESPONSE_TTL_S",
    "RESPONSE_MAX",
    "RESPONSE_TTL_S",
    "IdentityRole",
    "NatsAuthPlan",
    "NatsIdentity",
    "router_permissions",
    "worker_permissions",
]

IdentityRole = Literal["router", "worker"]
RESPONSE_MAX = 1_000_000
RESPONSE_TTL_S = 900
"""How long a worker may keep replying to one request, by default: above the router's default
--request-timeout (600 s), as it must be."""
ENGINE_ROLES: tuple[str, ...] = get_args(Role)


@dataclass(frozen=True)
class NatsIdentity:
    """One NATS user: a router replica or a worker, with its nkey seed (the secret)."""

    name: str
    role: IdentityRole
    seed: str

    @classmethod
    def create(cls, name: str, role: IdentityRole) -> NatsIdentity:
        seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER).decode()
        return cls(name, role, seed)

    @property
    def public_key(self) -> str:
        key_pair = nkeys.from_seed(bytearray(self.seed.encode()))
        try:
            return str(key_pair.public_key.decode())
        finally:
            key_pair.wipe()

    @property
    def seed_file_name(self) -> str:
        return f"{self.role}-{self.name}.nk"


def worker_permissions(ns: str, worker: str, response_ttl_s: int) -> dict[str, Any]:
    return {
        "publish": {"allow": [subjects.kv(ns, worker), subjects.load(ns, worker)]},
        "subscribe": {
            "allow": [
                *(subjects.gen(ns, role, worker) for role in ENGINE_ROLES),
                subjects.cancel(ns, worker),
                subjects.kvstate(ns, worker),
            ]
        },
        "allow_responses": {"max": RESPONSE_MAX, "expires": f"{response_ttl_s}s"},
    }


def router_permissions(ns: str) -> dict[str, Any]:
    return {
        "publish": {"allow": [f"{ns}.>"], "deny": [f"{ns}.kv.>", f"{ns}.load.>"]},
        "subscribe": {"allow": [f"{ns}.>", "_INBOX.>"]},
    }


@dataclass
class NatsAuthPlan:
    """Every identity of one namespace, and the nats-server configuration that admits them.

    response_ttl_s: how long a worker may keep replying to one request; keep it above the
    router's request deadline (`--request-timeout`, 600 s by default).
    """

    ns: str
    identities: list[NatsIdentity]
    response_ttl_s: int = RESPONSE_TTL_S

    def __post_init__(self) -> None:
        subjects.validate_namespace(self.ns)
        seen: set[tuple[str, str]] = set()
        for identity in self.identities:
            if identity.role not in get_args(IdentityRole):
                raise ValueError(f"role {identity.role!r} must be one of {', '.join(get_args(IdentityRole))}")
            subjects.kv(self.ns, identity.name)  # a name is one subject token
            if (identity.role, identity.name) in seen:
                raise ValueError(f"{identity.role} name {identity.name!r} is given twice")
            seen.add((identity.role, identity.name))
        if not 0 < self.response_ttl_s <= MAX_RESPONSE_TTL_S:
            raise ValueError(f"response_ttl_s must be in 1..{MAX_RESPONSE_TTL_S} (seconds), got {self.response_ttl_s}")

    @classmethod
    def generate(
        cls,
        ns: str,
        routers: list[str],
        workers: list[str],
        *,
        response_ttl_s: int = RESPONSE_TTL_S,
        seeds_dir: Path | None = None,
    ) -> NatsAuthPlan:
        """New identities, reusing any seed already in `seeds_dir` (so re-running adds workers
        without rotating everyone's key)."""
        wanted: list[tuple[str, IdentityRole]] = [(r, "router") for r in routers] + [(w, "worker") for w in workers]
        identities = []
        for name, role in wanted:
            fresh = NatsIdentity.create(name, role)
            existing = seeds_dir / fresh.seed_file_name if seeds_dir is not None else None
            if existing is not None and existing.is_file():
                fresh = NatsIdentity(name, role, existing.read_text().strip())
            identities.append(fresh)
        return cls(ns, identities, response_ttl_s)

    def identity(self, role: IdentityRole, name: str) -> NatsIdentity:
        for identity in self.identities:
            if identity.role == role and identity.name == name:
                return identity
        raise KeyError(f"no {role} named {name!r}")

    def permissions(self, identity: NatsIdentity) -> dict[str, Any]:
        if identity.role == "worker":
            return worker_permissions(self.ns, identity.name, self.response_ttl_s)
        return router_permissions(self.ns)

    def users(self) -> list[dict[str, Any]]:
        return [{"nkey": i.public_key, "permissions": self.permissions(i)} for i in self.identities]

    def authorization_block(self) -> str:
        """`authorization { users = [...] }` for nats-server's config (its syntax takes JSON)."""
        lines = [f"# kvswitch namespace {self.ns}: {i.role} {i.name}" for i in self.identities]
        return "\n".join([*lines, "authorization: " + json.dumps({"users": self.users()}, indent=2)]) + "\n"

    def helm_values(self) -> dict[str, Any]:
        """The same users as values for the official NATS Helm chart (merged into its nats.conf)."""
        return {"config": {"merge": {"authorization": {"users": self.users()}}}}

    def write(self, out: Path) -> list[Path]:
        """nats-auth.conf (include it in nats-server's config), nats-auth-values.yaml (Helm) and one
        seed file per identity, mode 0600. Returns the paths written."""
        out.mkdir(parents=True, exist_ok=True)
        conf, values = out / "nats-auth.conf", out / "nats-auth-values.yaml"
        conf.write_text(self.authorization_block())
        values.write_text(yaml.safe_dump(self.helm_values(), sort_keys=False))
        written = [conf, values]
        for identity in self.identities:
            path = out / identity.seed_file_name
            path.touch(mode=0o600)
            path.chmod(0o600)
            path.write_text(identity.seed + "\n")
            written.append(path)
        return written
