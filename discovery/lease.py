"""A lease kept alive in the background. Its id, in lowercase hex, is the holder's default identity.

Only etcd's own answer ends a lease: a keep-alive reply with TTL <= 0, or NOT_FOUND. etcd being
unreachable is not loss: the lease may well still exist (etcd keeps leases across its own restart
and extends each by its TTL when a leader is elected), so the state is `unknown`, the holder keeps
serving, and renewals resume as soon as etcd answers again.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
from etcd3aio import Etcd3Client, EtcdError
from etcd3aio._protobuf import LeaseKeepAliveRequest, LeaseRevokeRequest, LeaseStub

from discovery.answer_deadline import StalledPast, answer_within
from discovery.auth_token import rejects_token
from discovery.next_pick import HURRY_S, next_pick_wait
from runtime import cancel_and_wait

__all__ = ["MIN_LEASE_TTL", "Lease", "LeaseLost", "LeaseState", "renewal_interval"]

log = logging.getLogger(__name__)
RETRY_MIN_S = 0.1
RETRY_MAX_S = 1.0
# etcd grants no TTL under 1.5 election timeouts, rounded up: 2 s at its default 1 s (etcd 3.4
# grants 2 where 1 is asked, 5 under --election-timeout 3000); a shorter one asked is refused, never
# raised behind the owner's back (Discovery.grant).
MIN_LEASE_TTL = 2
RETRY_ROOM_S = 1.0  # of a short TTL, left for retries after a stream is given up (answer_deadline)


def renewal_interval(ttl: float) -> float:
    """Seconds between a lease's renewals while etcd answers: what a live holder's lease never goes
    much longer without (worker_shim.takeover reads a holder as gone by it)."""
    return max(ttl / 3.0, 0.2)


def answer_deadline(ttl: float) -> float:
    """Seconds a keep-alive stream may go without an answer before it is given up for another:
    two renewals, so one more try still comes within the TTL; for a short TTL no more than leaves
    RETRY_ROOM_S for the next streams (at 2 s, two renewals left 0.67 s: a hung member cost 1 lease
    of 30 in each of 3 runs, review of 2026-12-07)."""
    return min(2 * renewal_interval(ttl), ttl - RETRY_ROOM_S)


def _unexpected(exc: BaseException) -> Exception | None:
    """`exc` when a revoke raised it and it is no failure of etcd's (gRPC, etcd3aio, the network:
    TimeoutError is an OSError), a defect to be said with its traceback; else None."""
    if isinstance(exc, (grpc.RpcError, EtcdError, OSError)) or not isinstance(exc, Exception):
        return None
    return exc


class LeaseLost(RuntimeError):
    def __init__(self, lease_id: int, why: str) -> None:
        self.lease_id = lease_id
        super().__init__(f"lease {lease_id:x} lost: {why}")


class LeaseState(enum.Enum):
    ALIVE = "alive"  # etcd renewed it on the last try
    UNKNOWN = "unknown"  # etcd does not answer: it may still exist; keep serving
    LOST = "lost"  # etcd said it is gone: every key attached to it is gone too
    REVOKED = "revoked"  # revoked by its holder


class Lease:
    """Renews every ttl/3 s (renewal_interval) over one keep-alive stream, reopening it when etcd goes
    away or an answer is a renewal late (answer_deadline: its member hung).

    `lost` is set once etcd says the lease is gone, or the keep-alive loop failed on a defect and
    the lease was revoked (then the owner must register anew); `state`
    says where renewal stands. `revoke()` deletes the attached keys at once; it is safe to call twice,
    and tries again where a revoke failed (etcd may still hold the lease and its keys).
    """

    def __init__(
        self,
        client: Etcd3Client,
        lease_id: int,
        ttl: int,
        renew_token: Callable[[], Awaitable[bool]] | None = None,
    ) -> None:
        self._client = client
        self._renew_token = renew_token  # with etcd auth: a new token now, True if one came
        self.id = lease_id
        self.ttl = ttl
        self.lost = asyncio.Event()
        self.lost_reason = ""
        self.outages = 0
        self._state = LeaseState.ALIVE
        self._stalled = False  # its state unknown was said as this process's stall, not etcd's silence
        # etcd revoked it or said it is gone: nothing left to revoke. State REVOKED is set as a revoke
        # begins and LOST as a defect ends the keep-alive, each whether etcd still holds it or not.
        self._gone = False
        self._renewed_at = time.monotonic()
        self._retry = RETRY_MIN_S
        self._hurry = 0.0  # a stream went unanswered: the next one's first answer is due this soon
        self._given_up = 0  # streams given up in a row for no answer in time
        self._task: asyncio.Task[None] | None = None

    @property
    def state(self) -> LeaseState:
        # A stream that hangs without failing (etcd stopped, not closed) renews nothing either.
        if self._state is LeaseState.ALIVE and time.monotonic() - self._renewed_at > self.ttl:
            return LeaseState.UNKNOWN
        return self._state

    @property
    def unrenewed_s(self) -> float:
        """Seconds since etcd last renewed it: past `ttl` while etcd does not answer, the key is
        gone for whoever still reaches etcd."""
        return time.monotonic() - self._renewed_at

    @property
    def hex_id(self) -> str:
        return f"{self.id:x}"

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._keep_alive(), name=f"lease-{self.hex_id}")

    async def _keep_alive(self) -> None:
        try:
            await self._renew()
        except Exception as exc:  # a defect of the loop: said, and lost, so its owner registers anew
            log.exception("lease %s: its keep-alive failed (%r); the lease is taken as lost", self.hex_id, exc)
            # etcd still holds it: revoked first, or its keys (a name, an engine claim) stay until its
            # TTL passes and block the owner's registering anew under them.
            defect: Exception | None = None
            try:
                failure = await self._revoke_renewing(min(3.0, self.ttl)) if self._client.lease is not None else None
            except Exception as again:  # the same defect may stand in its way: its TTL it is, then
                # another defect is an ERROR with its traceback (as in revoke()); this one's is just above
                failure = again
                defect = None if again is exc else _unexpected(again)
            if failure is not None:
                self._say_unrevoked(said(failure), defect)
            self._mark_lost(f"its keep-alive failed: {exc!r}", gone=failure is None)

    async def _renew(self) -> None:
        interval = renewal_interval(self.ttl)
        while not self.lost.is_set():
            try:
                if await self._stream(interval):
                    continue  # given up on a hung member: the next stream at once, the TTL runs
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND:
                    self._mark_lost("etcd does not know it")
                    return
                self._unreachable(exc.code().name)
            except (EtcdError, OSError) as exc:
                self._unreachable(repr(exc))
            await asyncio.sleep(self._retry)
            self._retry = min(self._retry * 2, RETRY_MAX_S, interval)

    def _unreachable(self, why: str, stalled_s: float = 0.0) -> None:
        """The state is unknown: said as etcd's silence, or as this process's stall (`stalled_s`: an
        answer due while it stood still, StalledPast); one said as a stall is said again once etcd is
        silent while the process is awake."""
        said_now = self._state is LeaseState.ALIVE or (self._stalled and not stalled_s)
        if self._state is LeaseState.ALIVE:
            self.outages += 1
        self._state = LeaseState.UNKNOWN
        if not said_now:
            return
        self._stalled = bool(stalled_s)
        if stalled_s:
            # Not etcd's silence: until 2026-12-07 a shim stopped 10 s woke to "etcd does not answer"
            # (the TTL left no re-wait: discovery.answer_deadline), sending its operator to the network.
            log.warning(
                "lease %s: this process was stalled %.1fs or more as etcd's answer came due (%s; not etcd): lease "
                "state unknown, keeping on and retrying",
                self.hex_id,
                stalled_s,
                why,
            )
        else:
            log.warning(
                "lease %s: etcd does not answer (%s): lease state unknown, keeping on and retrying", self.hex_id, why
            )

    async def _stream(self, interval: float) -> bool:
        """Renew over one stream until it ends; True when given up for no answer in time."""

        async def requests() -> AsyncIterator[LeaseKeepAliveRequest]:
            while True:
                yield LeaseKeepAliveRequest(ID=self.id)
                await asyncio.sleep(interval)

        service = self._client.lease
        if service is None:
            raise LeaseLost(self.id, "the etcd client was closed")
        # etcd3aio's own keep-alive helper reopens a stream per renewal; one long stream is cheaper.
        call = service._stub.LeaseKeepAlive(requests(), metadata=service._metadata or None)
        # A hung member (stopped, not closed) keeps the stream open and silent, and gRPC's keepalive
        # takes longer than a short TTL to say so: give up on an answer late by one renewal, so the
        # next stream (another member, the channel's balancer going round) renews in time.
        patience = answer_deadline(self.ttl)
        # After one went unanswered, the balancer may pick the hung member again: a healthy one
        # answers a new stream at once, so wait less for its first answer, several tries in the TTL
        # (discovery.next_pick; a silent watch's re-read waits so too).
        wait = min(self._hurry, patience) if self._hurry else patience
        answers = aiter(call)
        try:
            while True:
                try:
                    # Not wait_for, which reads in a task of its own: cancelling that hung a stop.
                    # A stall of this process is not etcd's (discovery.answer_deadline), but its
                    # re-waits end HURRY_S before the TTL, so another member still renews it; after
                    # a give-up (etcd's silence said once), a new stream is the better bet: none.
                    left = 0.0 if self._given_up else self.ttl - HURRY_S - self.unrenewed_s
                    latest = asyncio.get_running_loop().time() + left
                    async with answer_within(wait, f"lease {self.hex_id}", latest):
                        resp = await anext(answers)
                except StopAsyncIteration:
                    return False
                except TimeoutError as exc:
                    stalled = exc.stalled_s if isinstance(exc, StalledPast) else 0.0
                    self._unreachable(f"no keep-alive answer in {wait:.1f}s", stalled)
                    self._given_up += 1
                    self._hurry = next_pick_wait(self._given_up, wait, patience)
                    return True
                wait, self._hurry, self._given_up = patience, 0.0, 0
                if resp.TTL <= 0:
                    self._mark_lost("etcd reports it expired")
                    return False
                if self._state is LeaseState.UNKNOWN:
                    again = "renewed after this process's stall" if self._stalled else "etcd answers again"
                    log.info("lease %s: %s; the lease survived", self.hex_id, again)
                self._state, self._stalled = LeaseState.ALIVE, False
                self._renewed_at = time.monotonic()
                self._retry = RETRY_MIN_S
        finally:
            call.cancel()

    def _mark_lost(self, why: str, *, gone: bool = True) -> None:
        """`gone`: etcd's own word, or no revoke left to try (its keep-alive failed on a defect with
        the etcd client closed: Discovery.close() revokes its leases); not when that defect's revoke
        failed."""
        if not self.lost.is_set():
            self._gone = gone
            self.lost_reason = why
            self._state = LeaseState.LOST
            log.warning("lease %s lost: %s", self.hex_id, why)
            self.lost.set()

    async def revoke(self, timeout: float = 3.0) -> bool:
        """Whether the lease is gone (revoked now, or already revoked, lost or expired); False after
        a WARNING naming why etcd did not revoke it (an ERROR with its traceback for an unexpected
        error): its keys then stay until its TTL passes, and an owner whose peers act on them says
        what that costs (router.service). A lease whose revoke failed before (here, or as a defect
        ended its keep-alive) is revoked again: until a review of 2026-12-08 such a lease read as
        gone, etcd still holding it and its keys."""
        await self.stop_keep_alive()
        if self._gone:
            return True
        self._state = LeaseState.REVOKED
        defect: Exception | None = None
        try:
            failure = await self._revoke_renewing(timeout)
        except Exception as exc:  # etcd's failure raised, or the defect that ended its keep-alive (_keep_alive):
            # said, not raised: raised, it failed each round's release before registering anew, never
            # waiting out the lease, and stop() raised (review of 2026-12-08)
            failure, defect = exc, _unexpected(exc)
        # or revoke_now (a second SIGTERM) revoked it while this one waited on etcd
        self._gone = self._gone or failure is None
        if failure is not None and not self._gone:
            self._say_unrevoked(said(failure), defect)
        return self._gone

    async def _revoke_renewing(self, timeout: float) -> BaseException | None:
        """_revoke, once more after renewing a refused token: keep-alives carry no token check, so
        after an etcd restart the revoke may be the first call to find the token forgotten
        (discovery.auth_token)."""
        failure = await self._revoke(timeout)
        renew = self._renew_token
        if failure is not None and rejects_token(failure) and renew is not None and await renew():
            failure = await self._revoke(timeout)
        return failure

    def _say_unrevoked(self, why: str, defect: Exception | None = None) -> None:
        if defect is None:
            log.warning("lease %s: revoke failed (%s); it expires within %ss", self.hex_id, why, self.ttl)
            return
        # a defect, not etcd: its traceback, or a programming error reads as etcd's (review of 2026-12-08)
        log.error(
            "lease %s: revoke failed (%s), an unexpected error, not etcd's; it expires within %ss",
            self.hex_id,
            why,
            self.ttl,
            exc_info=defect,
        )

    def revoke_now(self, timeout: float = 1.0) -> None:
        """Revoke without the event loop, for a process about to exit at once (a second SIGTERM):
        one try on a blocking channel of its own, in a thread of its own, given up after `timeout`
        (an etcd that is down or hung cannot hold the exit). Safe whatever the loop is doing: a
        revoke() under way or failed before does not stand in its way (until a review of 2026-12-08 a
        second SIGTERM during a stop's slow revoke revoked nothing, and said nothing)."""
        if self._gone:
            return
        failure: list[BaseException] = []
        thread = threading.Thread(target=self._revoke_blocking, args=(timeout, failure), daemon=True)
        thread.start()
        thread.join(timeout + 0.1)
        if thread.is_alive() or failure:
            why = said(failure[0]) if failure else "no answer in time"
            self._say_unrevoked(why, _unexpected(failure[0]) if failure else None)
            return
        self._state = LeaseState.REVOKED
        self._gone = True
        log.info("lease %s revoked", self.hex_id)

    def _revoke_blocking(self, timeout: float, failure: list[BaseException]) -> None:
        client, service = self._client, self._client.lease
        manager, tls = client._manager, client._conn_args
        try:
            if tls.get("ca_cert") is not None:
                creds = grpc.ssl_channel_credentials(tls["ca_cert"], tls.get("cert_key"), tls.get("cert_chain"))
                name = client._tls_server_name
                options = [*manager.grpc_options, *([("grpc.ssl_target_name_override", name)] if name else [])]
                channel = grpc.secure_channel(manager.target, creds, options=options)
            else:
                channel = grpc.insecure_channel(manager.target, options=manager.grpc_options)
            with channel:
                metadata = service._metadata if service is not None else ()  # the auth token, if any
                LeaseStub(channel).LeaseRevoke(LeaseRevokeRequest(ID=self.id), timeout=timeout, metadata=metadata)
        except grpc.RpcError as exc:
            if not (isinstance(exc, grpc.Call) and exc.code() == grpc.StatusCode.NOT_FOUND):  # expired already
                failure.append(exc)
        except Exception as exc:
            failure.append(exc)

    async def _revoke(self, timeout: float) -> BaseException | None:
        """None when etcd revoked it, or it had already expired; else what failed."""
        service = self._client.lease
        if service is None:  # a revoke tried again after Discovery.close()
            return RuntimeError("the etcd client was closed")
        try:
            await service.revoke(self.id, timeout=timeout, max_attempts=2)
        except grpc.aio.AioRpcError as exc:
            return None if exc.code() == grpc.StatusCode.NOT_FOUND else exc
        except (EtcdError, TimeoutError) as exc:
            return exc
        return None

    async def stop_keep_alive(self) -> None:
        """Stop renewing without revoking: the lease then expires within its TTL (tests use this)."""
        task, self._task = self._task, None
        if task is not None:
            await cancel_and_wait(task)


def said(exc: BaseException) -> str:
    """What failed, in one line: a timeout's str() is empty, an RpcError's a multi-line repr."""
    if isinstance(exc, grpc.aio.AioRpcError | grpc.Call):
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
