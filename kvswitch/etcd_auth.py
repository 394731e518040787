"""etcd users for one kvswitch namespace, and turning etcd's authentication on.

Two users, each scoped to what its processes touch (DESIGN.md's keys):
- `router` reads the whole namespace (`/{ns}/`: workers, routers, live config) and writes its own
  registration under `/{ns}/routers/`;
- `worker` reads and writes `/{ns}/workers/` (its leased registration) and `/{ns}/engines/` (its
  claim on its engine: worker_shim.engine_claim), and reads `/{ns}/routers/` (the legs of a router
  that died are cancelled: worker_shim.orphaned_legs).
Both may read etcd3aio's health-check key, which every client reads on connect. `root` exists
because etcd requires it before authentication can be enabled; operators keep its password.
Run again once authentication is on (an upgrade whose release grants more: `/{ns}/engines/` from
2026-12-06), it signs in as root and sets the roles' grants and the users as this release makes
them; before 2026-12-06 such a rerun changed nothing.

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


def _grants(user: EtcdUser) -> list[dict[str, str]]:
    """The permissions of `user`'s role, as etcd's gateway takes them."""
    ranges = [(p, _prefix_end(p), "READ") for p in user.read]
    ranges += [(p, _prefix_end(p), "READWRITE") for p in user.readwrite]
    ranges += [(k, "", "READ") for k in user.keys]
    return [{"permType": kind, "key": b64(key)} | ({"range_end": b64(end)} if end else {}) for key, end, kind in ranges]


def _role(gw: EtcdGateway, name: str, grants: list[dict[str, str]]) -> None:
    """`name` with exactly `grants`, whether or not it existed: each granted (etcd updates a grant
    of the same range in place), then every other grant revoked (one left wider was kept). In that
    order: a role that users of a running cluster hold never lacks a grant it keeps."""
    held = []
    if not gw.created("auth/role/add", {"name": name}):
        held = gw.call("auth/role/get", {"role": name}).get("perm", [])
    for perm in grants:
        gw.call("auth/role/grant", {"name": name, "perm": perm})
    wanted = {(perm["key"], perm.get("range_end", "")) for perm in grants}
    for perm in held:
        if (perm.get("key", ""), perm.get("range_end", "")) not in wanted:
            revoke = {"role": name, "key": perm.get("key", "")}
            if perm.get("range_end"):
                revoke["range_end"] = perm["range_end"]
            gw.call("auth/role/revoke", revoke)


def _as_root(gw: EtcdGateway, root_password: str) -> bool:
    """Whether authentication is on (then `gw` carries root's token); EtcdAuthError when it is and
    refuses `root_password`."""
    try:
        gw.token = gw.call("auth/authenticate", {"name": "root", "password": root_password})["token"]
    except EtcdAuthError as exc:
        if "authentication is not enabled" in str(exc):
            return False
        if "authentication failed" in str(exc):
            raise EtcdAuthError(f"etcd authentication is on at {gw.shown} and refuses root's password") from exc
        raise
    except KeyError as exc:
        raise EtcdAuthError(f"etcd auth/authenticate at {gw.shown}: the answer holds no token") from exc
    return True


def _password_works(gw: EtcdGateway, user: EtcdUser) -> bool:
    try:
        EtcdGateway(gw.url, gw.context).call("auth/authenticate", {"name": user.name, "password": user.password})
    except EtcdAuthError as exc:
        if "authentication failed" in str(exc):
            return False
        raise
    return True


def enable_auth(url: str, root_password: str, users: list[EtcdUser], *, context: ssl.SSLContext | None = None) -> bool:
    """Create `root` and `users` with their roles, then enable authentication (any member's client
    URL); True when this turned it on. A rerun after one that stopped part-way sets the passwords
    and permissions given, whatever that one left. Once authentication is on (an upgrade's rerun,
    whose release may grant more), it signs in as root and sets each role's grants and each user as
    given, and nothing else: a user's password that already works is left alone, since changing
    it ends the tokens every running process holds."""
    gw = EtcdGateway(url, context)
    already = _as_root(gw, root_password)
    if not already:
        gw.call("auth/role/add", {"name": "root"}, exists_ok=True)
        _user(gw, "root", root_password)
        gw.call("auth/user/grant", {"user": "root", "role": "root"})
    for user in users:
        _role(gw, user.name, _grants(user))
        if not already or not _password_works(gw, user):
            _user(gw, user.name, user.password)
        gw.call("auth/user/grant", {"user": user.name, "role": user.name})
    if not already:
        gw.call("auth/enable", {})
    return not already
