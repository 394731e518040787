"""`Discovery`: one etcd connection per process, and what kvswitch does with it."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import NamedTuple, Self, TypeVar

import grpc
import msgspec
from etcd3aio import Etcd3Client, EtcdPermissionDeniedError, EtcdTransientError, prefix_range_end
from etcd3aio._protobuf import Compare
from etcd3aio.kv import KVService
from etcd3aio.watch import WatchService

from discovery.advice import CALL_FAILED, TLS_FAILED
from discovery.auth_token import TokenKeeper
from discovery.lease import Lease, said
from discovery.watch import ReadHealth, WatchEvent, watch_prefix
from protocol import ConfigError, RouterInfo, WorkerInfo, decode_json, encode_json, subjects
from protocol.config import EtcdSettings

__all__ = [
    "DEFAULT_TTL",
    "Discovery",
    "DiscoveryError",
    "KeyTaken",
    "RouterNamespaces",
]

DEFAULT_TTL = 10
# Discovery.router_namespaces reads two keys' names a namespace: bounded, it holds the shim's check of
# its routers' legs (worker_shim.orphaned_legs) a few seconds at most on an etcd others share.
_NAMESPACES_READ = 1000
_NAMESPACES_READ_S = 3.0
_LAST_READ_S = 0.5  # the timeout of a read begun as those 3 s run out: one key's name
M = TypeVar("M", bound=msgspec.Struct)
# gRPC's default reconnect backoff grows to two minutes: after an etcd outage longer than a lease
# TTL, the first renewal would come too late for the lease etcd kept. Retry at least every second.
# Not grpc.min_reconnect_backoff_ms: gRPC core takes it as each attempt's least connect timeout too
# (20 s by default; subchannel.cc's ParseArgsForBackoffValues), and at 100 ms no etcd 150 ms away
# (one way) ever connected: its SETTINGS frame came after the attempt had timed out (audit of 2026-12-07).
_RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
# etcd3aio pings every 10 s, and gRPC waits for the answer its ping timeout (60 s) however short the
# keepalive timeout: a member that hangs (stopped, not closed) held the calls balanced onto it for a
# minute. Ping as often as etcd allows by default (its --grpc-keepalive-min-time, 5 s: more often is
# answered with GOAWAY), and give the ping up after 2 s: the member is left within 8 s.
_KEEPALIVE = {"grpc.keepalive_time_ms": 6000, "grpc.keepalive_timeout_ms": 2000, "grpc.http2.ping_timeout_ms": 2000}
# etcd's words (its rpctypes) for credentials it refuses at connect; their gRPC codes are
# INVALID_ARGUMENT and FAILED_PRECONDITION, which say nothing of credentials, so the text decides.
_AUTH_FAILED = "authentication failed, invalid user ID or password"
_NO_USER = "user name is empty"
_AUTH_OFF = "authentication is not enabled"
# gRPC's words for a connection attempt out of time: its connect timeout, or the keepalive ping's
# (_KEEPALIVE) on a connection whose first answer has not come.
_TIMED_OUT = ("timed out", "ping timeout", "DEADLINE_EXCEEDED")
_REQUIRE_LEADER = ("hasleader", "true")
_PING_KEY = "__etcd3aio:ping__"  # what etcd3aio's ping reads (kvswitch.etcd_auth grants it)


class RouterNamespaces(NamedTuple):
    """Discovery.router_namespaces: the namespaces read that have a router, and where and why the
    read stopped short of the keyspace's end (None: it read to the end)."""

    found: list[str]
    cut: str | None


class DiscoveryError(RuntimeError):
    """etcd could not be reached or refused an operation."""


class KeyTaken(DiscoveryError):
    """A create-if-absent put found the key held by another lease (a stable name used twice, or
    an engine claimed twice); `value` is the holder's (b"" when not read)."""

    def __init__(self, key: str, holder: int, value: bytes = b"") -> None:
        self.key = key
        self.holder = holder
        self.value = value
        super().__init__(f"{key} is already registered by lease {holder:x}")


def channel_target(settings: EtcdSettings) -> tuple[str, str | None]:
    """The gRPC target of etcd's endpoints, and the name the servers' TLS certificates are checked
    against where the target cannot say it.

    One DNS name: gRPC's resolver takes every address it resolves to, balances over them and
    resolves again when they fail. Several IP addresses: a static list (etcd3aio's own `ipv4:`
    target, which takes nothing else: a name there never connects). A list names no one host, so
    its TLS check uses the first endpoint's, which every member's certificate must name (kvswitch
    secrets gives all members one certificate)."""
    version, addresses = settings.members()
    if version is None:
        host, port = addresses[0]
        return f"dns:///{host}:{port}", None
    listed = ",".join(f"[{h}]:{p}" if version == 6 else f"{h}:{p}" for h, p in addresses)
    return f"ipv{version}:{listed}", addresses[0][0] if len(addresses) > 1 else None


class _LeaderWatch(WatchService):
    """Watches that ask for a member with a leader (etcd's WithRequireLeader, the `hasleader`
    metadata): a member cut off from its cluster keeps a plain watch open and silent for as long as
    the cut lasts, its workers and routers stale; with it etcd fails the watch, which is logged and
    made again through the channel (another member of a list, or a name resolved again)."""

    def set_token(self, token: str | None) -> None:
        super().set_token(token)
        self._metadata = (*self._metadata, _REQUIRE_LEADER)


def _held(key: str, holder: int) -> Compare:
    """Lease `holder` holds `key` (0: none, or the key absent: etcd compares a missing key's lease as 0)."""
    return Compare(result=Compare.EQUAL, target=Compare.LEASE, key=key.encode(), lease=holder)


def _segment(prefix: bytes, key: bytes) -> tuple[bytes, bool, bytes]:
    """`key`'s path segment after `prefix`, whether `key` ends with it, and where a read of the next
    segment starts: past every key under prefix/segment/ ('0' follows '/')."""
    rest = key[len(prefix) :]
    seg, slash, _ = rest.partition(b"/")
    return seg, not slash, key + b"\0" if not slash else prefix + seg + b"0"


def _require_leader(client: Etcd3Client) -> None:
    assert client.watch is not None
    client.watch.__class__ = _LeaderWatch
    client.watch._metadata = (*client.watch._metadata, _REQUIRE_LEADER)


def _read(path: str | None) -> bytes | None:
    return Path(path).read_bytes() if path else None


def _credentials_error(s: EtcdSettings, exc: BaseException) -> ConfigError | None:
    """The setting to fix when etcd refused the credentials given (or their absence) at connect,
    or its certificate did not verify: a wrong configuration, which retrying or blaming the
    endpoints would not fix."""
    why = said(exc)
    where = f"etcd at {', '.join(s.endpoints)}"
    flags = "--etcd-user and --etcd-password (or their KVSWITCH_ETCD_* variables)"
    if _AUTH_FAILED in why:
        return ConfigError("etcd_user", s.user, f"{where} refused the user or its password ({why}): check {flags}")
    if _NO_USER in why:
        return ConfigError("etcd_user", s.user, f"{where} has authentication on ({why}): give {flags}")
    if _AUTH_OFF in why:
        # On Kubernetes this is most often the etcd-auth Job not having run yet: dropping is wrong there.
        return ConfigError(
            "etcd_user",
            s.user,
            f"{where} has authentication off ({why}): turn it on (kvswitch secrets --etcd-endpoint; on "
            f"Kubernetes the etcd-auth Job, which may not have run yet), or drop {flags}",
        )
    if isinstance(exc, EtcdPermissionDeniedError):
        return ConfigError(
            "etcd_user",
            s.user,
            f"{where} does not let this user read {_PING_KEY!r}, which every client reads on connect ({why}): "
            "grant its role read on that key (as kvswitch secrets --etcd-endpoint does), or check --etcd-user",
        )
    if s.tls_ca is not None and any(m in why for m in TLS_FAILED):
        return ConfigError(
            "etcd_tls_ca",
            s.tls_ca,
            f"the TLS handshake with {where} failed ({why}): give the CA that signed its certificate, which must "
            "name the host in --etcd-endpoints (and --etcd-tls-cert/--etcd-tls-key if it asks for a client one)",
        )
    return None


def _late(exc: BaseException, timeout: float) -> str:
    """What a failed connect's error adds when its attempts ran out of time rather than being
    refused: the endpoints may well be right."""
    if not isinstance(exc, TimeoutError) and not any(m in said(exc) for m in _TIMED_OUT):
        return ""
    return (
        f"; the attempts timed out: a link too slow to connect within {timeout:g} s, or a TLS handshake "
        "that does not finish (a server that hangs, or no TLS at an https:// endpoint), as likely as a "
        "wrong address"
    )


class Discovery:
    """Registration under leases and watches under one namespace.

    Usage: `async with Discovery(settings, ns) as d: lease = await d.register_worker(make_info)`.
    `close()` revokes every lease this object granted that is still held, then closes the channel;
    it is safe to call twice.
    """

    def __init__(self, settings: EtcdSettings, ns: str = subjects.DEFAULT_NAMESPACE) -> None:
        self.settings = settings
        self.ns = subjects.validate_namespace(ns)
        self._client: Etcd3Client | None = None
        self._leases: list[Lease] = []
        self.token: TokenKeeper | None = None  # with etcd auth on
        self._wrote = False  # etcd took a write of ours: a denial after it is a role changed under us

    @property
    def client(self) -> Etcd3Client:
        if self._client is None:
            raise DiscoveryError("not connected: call connect() or use `async with`")
        return self._client

    async def connect(self, timeout: float = 10.0) -> Self:
        """DiscoveryError when etcd cannot be reached; ConfigError naming --etcd-user when it
        refuses the credentials given, or their absence, and --etcd-tls-ca when the TLS handshake
        fails on a certificate."""
        s = self.settings
        target, tls_name = channel_target(s)
        if s.tls_ca:
            ca, key, chain = _read(s.tls_ca), _read(s.tls_key), _read(s.tls_cert)
            client = Etcd3Client(tls_server_name=tls_name, ca_cert=ca, cert_key=key, cert_chain=chain)
        else:
            client = Etcd3Client()
        client._manager.target = target  # etcd3aio builds an ipv4: target, where a DNS name never connects
        options = client._manager.grpc_options
        options[:] = [(name, value) for name, value in options if name not in _KEEPALIVE]
        options.extend([*_KEEPALIVE.items(), *_RECONNECT_OPTIONS])
        await client.connect()
        _require_leader(client)
        token = TokenKeeper(client, s.user, s.password) if s.user is not None and s.password is not None else None
        try:
            if token is not None:
                await token.start()
            await client.ping(write_check=False, timeout=timeout)
        except CALL_FAILED as exc:
            if token is not None:
                await token.stop()
            await client.close()
            if (wrong := _credentials_error(s, exc)) is not None:
                raise wrong from exc
            why = f"{said(exc)}{_late(exc, timeout)}"
            raise DiscoveryError(f"etcd at {', '.join(s.endpoints)} is not reachable: {why}") from exc
        self._client, self.token = client, token
        return self

    def _failed(self, exc: BaseException) -> None:
        """An etcd call failed with `exc` (a refused token is renewed at once)."""
        if self.token is not None:
            self.token.rejected(exc)

    @contextmanager
    def _calling(self, error: Callable[[BaseException], Exception] | None) -> Iterator[None]:
        """Around one etcd call: its failure is told to `_failed`, then raised as `error(exc)` (from
        it), or as it is when `error` is None."""
        try:
            yield
        except CALL_FAILED as exc:
            self._failed(exc)
            if error is None:
                raise
            raise error(exc) from exc

    def _write_failed(self, what: str, key: str, exc: BaseException) -> ConfigError | DiscoveryError:
        """The error of a failed write of `key`. etcd denying the first write to the user (another
        role's credentials: a swapped Secret or variable) is a ConfigError naming --etcd-user, which
        retrying or blaming the endpoints would not fix. Anything else, a later denial included (the
        role changed under a running process, whose retries go on), is a DiscoveryError."""
        if not isinstance(exc, EtcdPermissionDeniedError):
            return DiscoveryError(f"{what} {key} failed: {said(exc)}")
        roles = {
            subjects.routers_prefix(self.ns): "router",
            subjects.workers_prefix(self.ns): "worker",
            subjects.engines_prefix(self.ns): "worker",
        }
        role = next((r for prefix, r in roles.items() if key.startswith(prefix)), None)
        which = f"the {role} user kvswitch secrets made" if role is not None else "a user that may write it"
        why = f"does not let this user write {key} ({said(exc)}): give {which}"
        if key.startswith(engines := subjects.engines_prefix(self.ns)):
            # Granted from 2026-12-06 (the engine claim): a worker user made before lacks it.
            why += (
                f"; one made before 2026-12-06 lacks it: run kvswitch secrets --etcd-endpoint again with this "
                f"release (it signs in as root, KVSWITCH_ETCD_ROOT_PASSWORD, and grants it), or "
                f"etcdctl role grant-permission worker --prefix=true readwrite {engines}"
            )
        if self._wrote:
            return DiscoveryError(f"{what} {key} failed: etcd {why} (--etcd-user)")
        flags = "--etcd-user and --etcd-password (or their KVSWITCH_ETCD_* variables)"
        return ConfigError(
            "etcd_user", self.settings.user, f"etcd at {', '.join(self.settings.endpoints)} {why}, with {flags}"
        )

    async def close(self) -> None:
        leases, self._leases = self._leases, []
        for lease in leases:
            await lease.revoke()
        token, self.token = self.token, None
        if token is not None:
            await token.stop()
        client, self._client = self._client, None
        if client is not None:
            await client.close()

    async def __aenter__(self) -> Self:
        return await self.connect()

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    # --- registration ---------------------------------------------------------------------------

    async def grant(self, ttl: int = DEFAULT_TTL, *, setting: str | None = "lease_ttl") -> Lease:
        """A lease of `ttl` s, kept alive. etcd grants no TTL under its least (1.5 x its
        --election-timeout, rounded up) and raises a shorter one to that: a ConfigError naming the
        owner's `setting` that gave `ttl`, the lease revoked; with `setting` None (a TTL no operator
        chose) the lease etcd grants, its `ttl` the one to count, which the caller says."""
        assert self.client.lease is not None
        with self._calling(lambda exc: DiscoveryError(f"lease grant failed: {said(exc)}")):
            resp = await self.client.lease.grant(ttl, timeout=5.0)
        lease = Lease(self.client, resp.ID, resp.TTL, self.token.renew if self.token is not None else None)
        if ttl != resp.TTL and setting is not None:
            # the owner's own waits and words would count the one asked for
            await lease.revoke()
            raise ConfigError(
                setting,
                ttl,
                f"etcd grants no lease under {resp.TTL} s (its least TTL: 1.5 x its --election-timeout, rounded "
                f"up); give at least {resp.TTL}",
            )
        lease.start()
        self._leases.append(lease)
        return lease

    async def _put(self, key: str, value: bytes, lease: Lease | None = None) -> None:
        assert self.client.kv is not None
        with self._calling(lambda exc: self._write_failed("put", key, exc)):
            await self.client.kv.put(key, value, lease=lease.id if lease else 0, timeout=5.0)
        self._wrote = True

    async def create(self, key: str, value: bytes, lease: Lease) -> None:
        """Put `key` under `lease` only if it does not exist (or is already ours); KeyTaken otherwise,
        ConfigError naming --etcd-user when the user may not write it (as from `put`)."""
        absent = KVService.txn_compare_create_revision(key, 0)
        found = await self._put_if(absent, key, value, lease, "create")
        if found is None:
            return
        if found[0] != lease.id:
            raise KeyTaken(key, *found)
        # Ours already (an earlier attempt whose answer was lost): write the current value.
        await self._put(key, value, lease)

    async def reclaim(self, key: str, value: bytes, lease: Lease) -> None:
        """Put `key` under `lease` only while no lease holds it (a put by hand; or absent: etcd
        compares a missing key's lease as 0); KeyTaken naming the holder otherwise, so an owner's
        create in between is never overwritten."""
        found = await self._put_if(_held(key, 0), key, value, lease, "put back")
        if found is not None and found[0] != lease.id:  # ours already: an earlier attempt whose answer was lost
            raise KeyTaken(key, *found)

    async def rewrite(self, key: str, value: bytes, lease: Lease) -> bool:
        """Put `key` anew under `lease` only while `lease` holds it; False when it does not exist or no
        lease holds it (for the owner to put it back as it would: create, reclaim), KeyTaken naming
        the holder when another lease does, so a live second owner's key is never overwritten."""
        found = await self._put_if(_held(key, lease.id), key, value, lease, "put")
        if found is not None and found[0]:
            raise KeyTaken(key, *found)
        return found is None

    async def _put_if(self, cond: Compare, key: str, value: bytes, lease: Lease, what: str) -> tuple[int, bytes] | None:
        """Put `key` under `lease` in one transaction only while `cond` holds; None when put, else
        the key's holder and value ((0, b"") when absent)."""
        kv = self.client.kv
        assert kv is not None
        with self._calling(lambda exc: self._write_failed(what, key, exc)):
            resp = await kv.txn([cond], [kv.txn_op_put(key, value, lease=lease.id)], [kv.txn_op_get(key)], timeout=5.0)
        self._wrote = True
        if resp.succeeded:
            return None
        found = resp.responses[0].response_range.kvs
        return (int(found[0].lease), bytes(found[0].value)) if found else (0, b"")

    async def holder(self, key: str) -> int | None:
        """The id of the lease holding `key` (0: a key put without one), or None when it does not exist."""
        found = await self.held(key)
        return None if found is None else found.holder

    async def held(self, key: str) -> KeyTaken | None:
        """`key`'s holder and value, as a create of it would find them (KeyTaken, not raised: its
        holder 0 for a key put without a lease), or None when it does not exist."""
        kv = self.client.kv
        assert kv is not None
        with self._calling(lambda exc: DiscoveryError(f"get {key} failed: {said(exc)}")):
            resp = await kv.get(key, timeout=5.0)
        return KeyTaken(key, int(resp.kvs[0].lease), bytes(resp.kvs[0].value)) if resp.kvs else None

    async def time_to_live(self, lease_id: int) -> tuple[int, int] | None:
        """(seconds left, TTL granted) of any lease, as etcd's leader counts them, the seconds left
        rounded down; None once it is gone. DiscoveryError when etcd does not answer."""
        assert self.client.lease is not None
        with self._calling(lambda exc: DiscoveryError(f"reading lease {lease_id:x} failed: {said(exc)}")):
            resp = await self.client.lease.time_to_live(lease_id, timeout=5.0)
        return (int(resp.TTL), int(resp.grantedTTL)) if resp.TTL >= 0 else None

    async def revoke(self, lease_id: int) -> None:
        """Revoke a lease this process does not hold (a dead holder's: worker_shim.takeover); one
        already gone is no failure. DiscoveryError otherwise."""
        assert self.client.lease is not None
        with self._calling(lambda exc: DiscoveryError(f"revoking lease {lease_id:x} failed: {said(exc)}")):
            try:
                await self.client.lease.revoke(lease_id, timeout=5.0)
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.NOT_FOUND:
                    raise

    async def put(self, key: str, value: bytes, lease: Lease | None = None) -> None:
        await self._put(key, value, lease)

    async def register_worker(self, make_info: Callable[[str], WorkerInfo], ttl: int = DEFAULT_TTL) -> Lease:
        """Grant a lease, then put `make_info(worker_id)` under /{ns}/workers/{worker_id}."""
        lease = await self.grant(ttl)
        info = make_info(lease.hex_id)
        if info.worker != lease.hex_id:
            raise ValueError(f"WorkerInfo.worker must be the lease id {lease.hex_id}, got {info.worker}")
        await self._put(subjects.worker_key(self.ns, info.worker), encode_json(info), lease)
        return lease

    async def update_worker(self, lease: Lease, info: WorkerInfo) -> None:
        await self._put(subjects.worker_key(self.ns, info.worker), encode_json(info), lease)

    async def register_router(self, make_info: Callable[[str], RouterInfo], ttl: int = DEFAULT_TTL) -> Lease:
        """A router's record under a lease of its own, for tests: a router registers through a
        Registration, keeping the TTL etcd grants (setting=None) as this does."""
        lease = await self.grant(ttl, setting=None)
        info = make_info(lease.hex_id)
        await self._put(subjects.router_key(self.ns, info.router), encode_json(info), lease)
        return lease

    async def release(self, lease: Lease) -> bool:
        """Revoke `lease` now: its keys disappear for every watcher at once. False when etcd did not
        revoke it (Lease.revoke: a WARNING said why; its keys stay until its TTL passes)."""
        if lease in self._leases:
            self._leases.remove(lease)
        return await lease.revoke()

    # --- watches --------------------------------------------------------------------------------

    def _others_may_answer(self) -> bool:
        """Whether another member may answer a call one left unanswered (watch_prefix's `hurry`): a
        list of several addresses, or a DNS name (how many members it resolves to is unknown); not a
        list of one, which every pick of the channel gives the same member (nor one address twice)."""
        version, addresses = self.settings.members()
        return version is None or len(set(addresses)) > 1

    @staticmethod
    def _parser(kind: type[M]) -> Callable[[bytes], M]:
        """A value's parser for watch_prefix: ProtocolError (a ValueError) skips a malformed one."""
        return lambda raw: decode_json(raw, kind)

    def watch_workers(self, health: ReadHealth | None = None) -> AsyncGenerator[WatchEvent[WorkerInfo], None]:
        """A Snapshot of /{ns}/workers/, then each change; names are worker ids. A record that does
        not decode, or is held by no lease (it would outlive its shim: DESIGN.md's "a worker exists
        exactly as long as its lease"), is not logged here: its key reads as absent, with why
        (`Snapshot.skipped`, `Deleted.why`), for the consumer to report (router.worker_registry
        refuses it). `health` says while reading the prefix fails."""
        return watch_prefix(
            self.client,
            subjects.workers_prefix(self.ns),
            self._parser(WorkerInfo),
            failed=self._failed,
            log_skipped=False,
            leased=True,
            health=health,
            hurry=self._others_may_answer(),
        )

    def watch_routers(self) -> AsyncGenerator[WatchEvent[RouterInfo], None]:
        """A Snapshot of /{ns}/routers/, then each change; names are router ids. A record that does
        not decode is not logged here, as in `watch_workers`: its key reads as absent, with why, for
        the consumer to report once per key and count (router.replica_sync in a router,
        worker_shim.orphaned_legs in a shim). Logged here, each bad put was a WARNING in every router
        and every shim, uncapped (logonce audit of 2026-12-07)."""
        return watch_prefix(
            self.client,
            subjects.routers_prefix(self.ns),
            self._parser(RouterInfo),
            failed=self._failed,
            log_skipped=False,
            hurry=self._others_may_answer(),
        )

    async def readable(self, prefix: str) -> bool:
        """Whether this user may read `prefix` (a role may lack it: a watch of it would be refused
        and retried for good); DiscoveryError when etcd cannot say."""
        assert self.client.kv is not None
        with self._calling(lambda exc: DiscoveryError(f"reading {prefix} failed: {said(exc)}")):
            try:
                await self.client.kv.get(prefix.encode(), prefix_range_end(prefix.encode()), timeout=5.0)
            except EtcdPermissionDeniedError:  # the answer sought (no read), not a failure
                return False
        return True

    async def router_namespaces(
        self, most: int = _NAMESPACES_READ, within_s: float = _NAMESPACES_READ_S
    ) -> RouterNamespaces | None:
        """The namespaces a router is registered in (`/{ns}/routers/{router}` keys), found a key at a
        time: the first key of the keyspace gives its first path segment, a read of one key under
        /{seg}/routers/ whether a router is there, and the next read starts past /{seg}/. One read of
        every key overflowed gRPC's 4 MiB answer on a large shared etcd (review of 2026-12-07). At
        most `most` namespaces and `within_s` s, or _LAST_READ_S past it for a read begun at its end
        (RouterNamespaces.cut says where it stopped, a read timed out then too); None
        when this user may not read beyond its own namespace (a role kvswitch secrets makes),
        DiscoveryError when etcd cannot say."""
        found: list[str] = []
        deadline = time.monotonic() + within_s
        start, end = b"/", prefix_range_end(b"/")
        read = 0
        unread = "from / on"  # what a read stopped now leaves unread
        with self._calling(lambda exc: DiscoveryError(f"reading the routers of every namespace failed: {said(exc)}")):
            try:
                while (key := await self._first_key(start, end, deadline)) is not None:
                    seg, leaf, start = _segment(b"/", key)
                    where = seg.decode(errors="replace")
                    unread = f"from /{where} on"
                    if read >= most or time.monotonic() >= deadline:
                        why = f"{most} namespaces" if read >= most else f"{within_s:g} s"
                        return RouterNamespaces(found, f"the read stopped at its most, {why}: {unread} unread")
                    if seg and not leaf:  # else a key of one segment, or under //: no namespace's
                        read += 1
                        if await self._has_router(b"/" + seg + b"/routers/", deadline):
                            found.append(where)
                    unread = f"after /{where}"
            except EtcdPermissionDeniedError:
                return None
            except (TimeoutError, EtcdTransientError):
                if time.monotonic() < deadline:
                    raise  # etcd's own failure: a DiscoveryError
                return RouterNamespaces(found, f"the read stopped at its most, {within_s:g} s: {unread} unread")
        return RouterNamespaces(found, None)

    async def _first_key(self, start: bytes, end: bytes, deadline: float) -> bytes | None:
        """The first key in [start, end), or None: a read of one key's name, which times out by
        `deadline` (time.monotonic), or within _LAST_READ_S past it."""
        assert self.client.kv is not None
        timeout = min(5.0, max(_LAST_READ_S, deadline - time.monotonic()))
        resp = await self.client.kv.get(start, end, keys_only=True, limit=1, timeout=timeout)
        return bytes(resp.kvs[0].key) if resp.kvs else None

    async def _has_router(self, prefix: bytes, deadline: float) -> bool:
        """Whether a key is exactly `prefix` + a router id (deeper keys are no router's); TimeoutError
        once `deadline` passes before it can say."""
        start, end = prefix, prefix_range_end(prefix)
        while (key := await self._first_key(start, end, deadline)) is not None:
            seg, leaf, start = _segment(prefix, key)
            if leaf and seg:
                return True
            if time.monotonic() >= deadline:
                raise TimeoutError
        return False

    def watch_raw(self, prefix: str) -> AsyncGenerator[WatchEvent[bytes], None]:
        """The raw values under `prefix`, named by what follows it: for tests and debugging (no
        kvswitch process watches a prefix it does not decode)."""
        return watch_prefix(self.client, prefix, lambda raw: raw, failed=self._failed, hurry=self._others_may_answer())

    def watch_key(self, key: str, health: ReadHealth | None = None) -> AsyncGenerator[WatchEvent[bytes], None]:
        """The raw value of `key` alone (named ""): keys it is a prefix of are not read."""
        return watch_prefix(
            self.client,
            key,
            lambda raw: raw,
            failed=self._failed,
            exact=True,
            health=health,
            hurry=self._others_may_answer(),
        )

    async def put_raw(self, key: str, value: bytes) -> None:
        await self._put(key, value)

    async def delete(self, key: str) -> None:
        assert self.client.kv is not None
        with self._calling(None):
            await self.client.kv.delete(key, timeout=5.0)
