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

The roles and users are etcd-wide, the grants per namespace: two namespaces sharing an etcd share
the `router` and `worker` users (and their passwords), each role holding both namespaces' grants. A
run revokes only grants inside its own namespace's prefix that this release does not make; until
2026-12-06 it revoked every grant it did not make, so a run for a second namespace took the first
one's away from its running processes. For the same reason a rerun given a password that does not
work for an existing user is refused (PasswordsRefused) unless asked to rotate it: it changed it,
and every process of every namespace signing in as that user lost its token and its password.

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

__all__ = [
    "PING_KEY",
    "AuthSetup",
    "EtcdAuthError",
    "EtcdGateway",
    "EtcdUser",
    "PasswordsRefused",
    "b64",
    "enable_auth",
    "namespace_users",
]

PING_KEY = "__etcd3aio:ping__"


class EtcdAuthError(RuntimeError):
    """etcd refused a step of the authentication setup."""


class PasswordsRefused(EtcdAuthError):
    """Authentication is on and etcd refuses the passwords given for `users`, which exist: changing
    them was not asked for (enable_auth's rotate_passwords). Nothing was changed."""

    def __init__(self, shown: str, users: list[str]) -> None:
        super().__init__(f"etcd authentication is on at {shown} and refuses the password given for {', '.join(users)}")
        self.shown, self.users = shown, users


@dataclass(frozen=True)
class EtcdUser:
    """A user with one role of the same name: `read` prefixes, `readwrite` prefixes, `keys` read.
    `scope`: the prefix (a namespace's `/{ns}/`) inside which a grant the role holds and these do
    not make is revoked; grants outside it are another namespace's, and kept."""

    name: str
    password: str
    read: list[str] = field(default_factory=list)
    readwrite: list[str] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)
    scope: str = ""


@dataclass(frozen=True)
class AuthSetup:
    """What `enable_auth` did: whether it turned authentication on (False: it was on already), the
    grants it revoked, one line each ("worker READWRITE /ns/old/ (prefix)"), and the users whose
    password it changed while authentication was on (rotate_passwords)."""

    turned_on: bool
    revoked: list[str]
    changed: list[str]


def namespace_users(ns: str, router_password: str, worker_password: str) -> list[EtcdUser]:
    subjects.validate_namespace(ns)
    workers, routers = subjects.workers_prefix(ns), subjects.routers_prefix(ns)
    engines = subjects.engines_prefix(ns)
    scope = f"/{ns}/"
    return [
        EtcdUser("router", router_password, read=[scope], readwrite=[routers], keys=[PING_KEY], scope=scope),
        EtcdUser("worker", worker_password, read=[routers], readwrite=[workers, engines], keys=[PING_KEY], scope=scope),
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


def _role(gw: EtcdGateway, user: EtcdUser) -> list[str]:
    """`user`'s role with its grants, whether or not it existed: each granted (etcd updates a grant
    of the same range in place), then every other grant inside `user.scope` revoked (one left wider
    was kept); returns those revoked. In that order: a role that users of a running cluster hold
    never lacks a grant it keeps. A grant outside the scope is another namespace's: kept."""
    grants, held = _grants(user), []
    if not gw.created("auth/role/add", {"name": user.name}):
        held = gw.call("auth/role/get", {"role": user.name}).get("perm", [])
    for perm in grants:
        gw.call("auth/role/grant", {"name": user.name, "perm": perm})
    wanted = {(perm["key"], perm.get("range_end", "")) for perm in grants}
    revoked = []
    for perm in held:
        key, end = perm.get("key", ""), perm.get("range_end", "")
        if (key, end) in wanted or not _inside(user.scope, _unb64(key), _unb64(end)):
            continue
        gw.call("auth/role/revoke", {"role": user.name, "key": key} | ({"range_end": end} if end else {}))
        revoked.append(f"{user.name} {perm.get('permType', 'READ')} {_shown(_unb64(key), _unb64(end))}")
    return revoked


FROM_KEY = "\0"  # a range end meaning every key from `key` on (etcdctl --from-key)


def _inside(scope: str, key: str, end: str) -> bool:
    """Whether the range [key, end) (a single key when `end` is empty) lies inside prefix `scope`."""
    return bool(scope) and key.startswith(scope) and end != FROM_KEY and (not end or end <= _prefix_end(scope))


def _shown(key: str, end: str) -> str:
    """A grant's range as etcdctl's flags say it."""
    if not end:
        return key
    if end == FROM_KEY:
        return f"{key} (from key)"
    return f"{key} (prefix)" if end == _prefix_end(key) else f"[{key}, {end})"


def _unb64(text: str) -> str:
    return base64.b64decode(text).decode(errors="replace")


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


def enable_auth(
    url: str,
    root_password: str,
    users: list[EtcdUser],
    *,
    context: ssl.SSLContext | None = None,
    rotate_passwords: bool = False,
) -> AuthSetup:
    """Create `root` and `users` with their roles, then enable authentication (any member's client
    URL). A rerun after one that stopped part-way sets the passwords and permissions given,
    whatever that one left. Once authentication is on (an upgrade's rerun, whose release may grant
    more), it signs in as root and sets each role's grants (inside `EtcdUser.scope`), and creates a
    user that is missing. An existing user's password is left alone when it works; one that does
    not is PasswordsRefused, before anything is changed, unless `rotate_passwords`: the users are
    shared by every namespace on the etcd, and a new password ends the tokens of all their
    processes, which then sign in with the old one in vain."""
    gw = EtcdGateway(url, context)
    already = _as_root(gw, root_password)
    to_set, stale = {user.name for user in users}, []
    if already:
        held = set(gw.call("auth/user/list", {}).get("users", []))
        stale = [user.name for user in users if user.name in held and not _password_works(gw, user)]
        if stale and not rotate_passwords:
            raise PasswordsRefused(gw.shown, stale)
        to_set -= held - set(stale)
    else:
        gw.call("auth/role/add", {"name": "root"}, exists_ok=True)
        _user(gw, "root", root_password)
        gw.call("auth/user/grant", {"user": "root", "role": "root"})
    revoked = []
    for user in users:
        revoked += _role(gw, user)
        if user.name in to_set:
            _user(gw, user.name, user.password)
        gw.call("auth/user/grant", {"user": user.name, "role": user.name})
    if not already:
        gw.call("auth/enable", {})
    return AuthSetup(turned_on=not already, revoked=revoked, changed=stale)
