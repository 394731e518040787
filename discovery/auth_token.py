"""`TokenKeeper`: the etcd auth token, kept valid for as long as the process runs.

etcd hands out a token on Authenticate and forgets it when its TTL (`--auth-token-ttl`, 300 s by
default) passes or when etcd restarts (simple tokens live in its memory). etcd3aio authenticates
once, so before this every put, read and watch of a process that outlived its token failed with
"invalid auth token" for good, and the watches retried it every half second without end: a
router's worker set froze, a shim could not register again. The keeper authenticates again when a
call reports the token refused, and the caller's retry carries the new one; a failure to
authenticate (a password changed under the process) is an ERROR naming the flags. Not on a timer:
etcd checks a password with bcrypt, and a thousand workers renewing every minute would keep a
core of it busy for tokens nobody had lost.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
from etcd3aio import Etcd3Client, EtcdError, EtcdUnauthenticatedError

from runtime import background, cancel_and_wait

__all__ = ["TokenKeeper", "rejects_token"]

log = logging.getLogger(__name__)
RETRY_S = 1.0  # after an Authenticate that failed, before the next


def rejects_token(exc: BaseException) -> bool:
    """Whether `exc` is etcd refusing the token (not a permission or a connection problem)."""
    if isinstance(exc, EtcdUnauthenticatedError):
        return True
    return isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.UNAUTHENTICATED


class TokenKeeper:
    def __init__(self, client: Etcd3Client, user: str, password: str) -> None:
        self._client = client
        self.user = user
        self._password = password
        self.renewals = 0
        self._kick = asyncio.Event()
        self._failing = False
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Authenticate now (its error raised), then again whenever the token is refused."""
        await self._authenticate()
        self._task = background(self._run(), "etcd-auth-token", "the etcd auth token is not renewed")

    async def renew(self) -> bool:
        """Authenticate now; True when a new token came. A failure is an ERROR once per episode."""
        try:
            await self._authenticate()
        except (EtcdError, TimeoutError, grpc.aio.AioRpcError) as exc:
            if not self._failing:
                log.error(
                    "etcd authentication as %s failed: %s; etcd calls fail until it works (check "
                    "--etcd-user and --etcd-password, or KVSWITCH_ETCD_PASSWORD)",
                    self.user,
                    exc,
                )
            self._failing = True
            return False
        self.renewals += 1
        if self._failing:
            log.info("etcd authentication as %s works again", self.user)
        self._failing = False
        return True

    def rejected(self, exc: BaseException) -> None:
        """A call failed with `exc`: if etcd refused the token, get a new one now."""
        if rejects_token(exc):
            self._kick.set()

    @property
    def task(self) -> asyncio.Task[None] | None:
        """Its loop, while started: its owner's readiness names it should it end (runtime.ended)."""
        return self._task

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            await cancel_and_wait(task)

    async def _authenticate(self) -> None:
        auth = self._client.auth
        assert auth is not None
        resp = await auth.authenticate(self.user, self._password, timeout=5.0)
        self._client.set_token(resp.token)
        auth.set_token(None)  # etcd refuses an Authenticate that carries a token it forgot

    async def _run(self) -> None:
        while True:
            await self._kick.wait()
            self._kick.clear()
            if not await self.renew():
                await asyncio.sleep(RETRY_S)  # the next refused call asks again, at most this often
