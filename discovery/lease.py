"""A lease kept alive in the background. Its id, in lowercase hex, is the worker's identity."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

import grpc
from etcd3aio import Etcd3Client, EtcdError
from etcd3aio._protobuf import LeaseKeepAliveRequest

__all__ = ["Lease", "LeaseLost"]

log = logging.getLogger(__name__)


class LeaseLost(RuntimeError):
    def __init__(self, lease_id: int, why: str) -> None:
        self.lease_id = lease_id
        super().__init__(f"lease {lease_id:x} lost: {why}")


class Lease:
    """Renews every ttl/3 s over one keep-alive stream, reopening it when etcd goes away.

    `lost` is set once the lease is gone for good: etcd answered TTL <= 0, or no renewal succeeded
    for a whole TTL. Then every key attached to it is gone too, and the owner must register anew
    (with a new id). `revoke()` deletes the attached keys at once; it is safe to call twice.
    """

    def __init__(self, client: Etcd3Client, lease_id: int, ttl: int) -> None:
        self._client = client
        self.id = lease_id
        self.ttl = ttl
        self.lost = asyncio.Event()
        self.lost_reason = ""
        self._renewed_at = time.monotonic()
        self._task: asyncio.Task[None] | None = None
        self._revoked = False

    @property
    def hex_id(self) -> str:
        return f"{self.id:x}"

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._keep_alive(), name=f"lease-{self.hex_id}")

    async def _keep_alive(self) -> None:
        interval = max(self.ttl / 3.0, 0.2)
        while not self.lost.is_set():
            if time.monotonic() - self._renewed_at > self.ttl:
                self._mark_lost("no renewal succeeded for a whole TTL")
                return
            try:
                await self._stream(interval)
            except (grpc.aio.AioRpcError, EtcdError, OSError) as exc:
                log.warning("lease %s: keep-alive failed (%s); retrying", self.hex_id, exc)
            await asyncio.sleep(min(interval, 0.5))

    async def _stream(self, interval: float) -> None:
        async def requests() -> AsyncIterator[LeaseKeepAliveRequest]:
            while True:
                yield LeaseKeepAliveRequest(ID=self.id)
                await asyncio.sleep(interval)

        service = self._client.lease
        if service is None:
            raise LeaseLost(self.id, "the etcd client was closed")
        # etcd3aio's own keep-alive helper reopens a stream per renewal; one long stream is cheaper.
        call = service._stub.LeaseKeepAlive(requests(), metadata=service._metadata or None)
        try:
            async for resp in call:
                if resp.TTL <= 0:
                    self._mark_lost("etcd reports it expired")
                    return
                self._renewed_at = time.monotonic()
        finally:
            call.cancel()

    def _mark_lost(self, why: str) -> None:
        if not self.lost.is_set():
            self.lost_reason = why
            log.warning("lease %s lost: %s", self.hex_id, why)
            self.lost.set()

    async def revoke(self, timeout: float = 3.0) -> None:
        await self.stop_keep_alive()
        if self._revoked or self.lost.is_set():
            return
        self._revoked = True
        assert self._client.lease is not None
        try:
            await self._client.lease.revoke(self.id, timeout=timeout, max_attempts=2)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:  # NOT_FOUND: it already expired
                log.warning("lease %s: revoke failed (%s); it expires within %ss", self.hex_id, exc, self.ttl)
        except (EtcdError, TimeoutError) as exc:
            log.warning("lease %s: revoke failed (%s); it expires within %ss", self.hex_id, exc, self.ttl)

    async def stop_keep_alive(self) -> None:
        """Stop renewing without revoking: the lease then expires within its TTL (tests use this)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
