"""etcd users for one kvswitch namespace, and turning etcd's authentication on.

Two users, each scoped to what its processes touch (DESIGN.md's keys):
- `router` reads the whole namespace (`/{ns}/`: workers, routers, live config) and writes its own
  registration under `/{ns}/routers/`;
- `worker` reads and writes `/{ns}/workers/` (its leased registration) and `/{ns}/engines/` (its
  claim on its engine: worker_shim.engine_claim), and reads `/{ns}/routers/` (the legs of a router
  that died are cancelled: worker_shim.orphaned_legs).
Both may read etcd3aio's health-check key, which every client reads on connect. `root` exists
because etcd requires it before authentication can be enabled; operators keep its password.

It speaks etcd's JSON gateway (`/v3/auth/...`) over plain urllib, so it runs before any asyncio
loop exists (a test fixture, `kvswitch up` before its services start, a compose init job).
"""

from __future__ import annotations

import base64
import json
import ssl
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from protocol import subjects
from protocol.errors import without_userinfo

__all__ = ["PING_KEY", "EtcdAuthError", "EtcdGateway", "EtcdUser", "b64", "enable_auth", "namespace_users"]

PING_KEY = "__etcd3aio:ping__"


class EtcdAuthError(RuntimeError):
    """etcd refused a step of the authentication setup."""


@dataclass(frozen=True)
class EtcdUser:
    """A user with one role of the same name: `read` prefixes, `readwrite` prefixes, `keys` read."""

    name: str
    password: str
    read: list[str] = field(default_factory=list)
    readwrite: list[str] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)


def namespace_users(ns: str, router_password: str, worker_password: str) -> list[EtcdUser]:
    subjects.validate_namespace(ns)
    workers, routers = subjects.workers_prefix(ns), subjects.routers_prefix(ns)
    engines = subjects.engines_prefix(ns)
    return [
        EtcdUser("router", router_password, read=[f"/{ns}/"], readwrite=[routers], keys=[PING_KEY]),
        EtcdUser("worker", worker_password, read=[routers], readwrite=[workers, engines], keys=[PING_KEY]),
    ]


def b64(text: str) -> str:
    """`text` as etcd's JSON gateway takes keys and values."""
    return base64.b64encode(text.encode()).decode()


def _prefix_end(prefix: str) -> str:
    """The range end that covers every key starting with `prefix` (etcd's convention)."""
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)


class EtcdGateway:
    """etcd's JSON gateway (`/v3/...`) at one client URL, for the few calls a supervisor makes
    without an etcd client; `token` (from `auth/authenticate`) is sent once set."""

    def __init__(self, url: str, context: ssl.SSLContext | None) -> None:
        self.url = url.rstrip("/")
        self.shown = without_userinfo(self.url)  # in errors, which reach job logs
        self.context = context
        self.token: str | None = None

    def created(self, path: str, body: dict[str, object]) -> bool:
        """An `add` call: False when etcd says what it adds already exists."""
        try:
            self.call(path, body)
        except EtcdAuthError as exc:
            if "already exists" in str(exc):
                return False
            raise
        return True

    def call(self, path: str, body: dict[str, object], *, exists_ok: bool = False) -> dict[str, Any]:
        """The answer's JSON object ({} for another JSON value); EtcdAuthError for any failure."""
        headers = {"Content-Type": "application/json"} | ({"Authorization": self.token} if self.token else {})
        request = urllib.request.Request(
            f"{self.url}/v3/{path}", data=json.dumps(body).encode(), method="POST", headers=headers
        )
        try:
            with urllib.request.urlopen(request, timeout=5.0, context=self.context) as resp:
                answer = json.loads(resp.read())
                return answer if isinstance(answer, dict) else {}
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")
            if exists_ok and "already exists" in detail:
                return {}
            raise EtcdAuthError(f"etcd {path} at {self.shown}: HTTP {exc.code}: {detail[:300]}") from exc
        except (urllib.error.URLError, OSError, ValueError) as exc:  # ValueError: an answer not JSON
            raise EtcdAuthError(f"etcd {path} at {self.shown}: {exc}") from exc


def _user(gw: EtcdGateway, name: str, password: str) -> None:
    """`name` with `password`, whether or not an earlier run that stopped part-way made it: added
    with exists_ok alone, a rerun's new password was ignored and the old one kept working."""
    if not gw.created("auth/user/add", {"name": name, "password": password}):
        gw.call("auth/user/changepw", {"name": name, "password": password})


def _role(gw: EtcdGateway, name: str) -> None:
    """`name` with no permission, whether or not it existed: one left with wider grants kept them."""
    if gw.created("auth/role/add", {"name": name}):
        return
    for perm in gw.call("auth/role/get", {"role": name}).get("perm", []):
        revoke = {"role": name, "key": perm.get("key", "")}
        if perm.get("range_end"):
            revoke["range_end"] = perm["range_end"]
        gw.call("auth/role/revoke", revoke)


def enable_auth(url: str, root_password: str, users: list[EtcdUser], *, context: ssl.SSLContext | None = None) -> None:
    """Create `root` and `users` with their roles, then enable authentication. Run it once, on a
    fresh cluster (any member's client URL); it is refused once authentication is on. A rerun after
    one that stopped part-way sets the passwords and permissions given, whatever that one left."""
    gw = EtcdGateway(url, context)
    gw.call("auth/role/add", {"name": "root"}, exists_ok=True)
    _user(gw, "root", root_password)
    gw.call("auth/user/grant", {"user": "root", "role": "root"})
    for user in users:
        _role(gw, user.name)
        grants = [(p, _prefix_end(p), "READ") for p in user.read]
        grants += [(p, _prefix_end(p), "READWRITE") for p in user.readwrite]
        grants += [(k, "", "READ") for k in user.keys]
        for key, end, kind in grants:
            perm: dict[str, str] = {"permType": kind, "key": b64(key)}
            if end:
                perm["range_end"] = b64(end)
            gw.call("auth/role/grant", {"name": user.name, "perm": perm})
        _user(gw, user.name, user.password)
        gw.call("auth/user/grant", {"user": user.name, "role": user.name})
    gw.call("auth/enable", {})
