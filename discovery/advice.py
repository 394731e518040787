"""What an operator does about an etcd call that failed: etcd not answering (unreachable, out of
time, no leader) is the endpoints' or the server's to fix; etcd answering and refusing is what it
said. Until 2026-12-07 a shim named --etcd-endpoints for both, a full etcd's quota included."""

from __future__ import annotations

import grpc
from etcd3aio import EtcdConnectionError, EtcdError, EtcdTransientError

from discovery.session import DiscoveryError

__all__ = ["advice"]

UNANSWERED = "check --etcd-endpoints and the server"
# etcd's words (its rpctypes ErrGRPCNoSpace) once its backend reached --quota-backend-bytes: it
# raised the NOSPACE alarm and takes no write (a lease grant included) until an operator acts.
_NO_SPACE = "database space exceeded"
NO_SPACE = (
    "etcd's quota is full (--quota-backend-bytes) and it takes no write until it is compacted, defragmented "
    "and its alarm disarmed (etcdctl compact REV, etcdctl defrag, etcdctl alarm disarm)"
)
REFUSED = "etcd answered and refused it: the endpoints are right, its words say why"
_UNANSWERED_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def advice(exc: BaseException) -> str:
    """What to do about `exc`, a failed etcd call (or the DiscoveryError raised from one); "" for
    anything else (a DiscoveryError of discovery's own, with no call's error under it)."""
    if isinstance(exc, DiscoveryError):
        if exc.__cause__ is None:
            return ""
        exc = exc.__cause__
    # etcd3aio raises UNAVAILABLE and DEADLINE_EXCEEDED as these once its retries are spent
    if isinstance(exc, TimeoutError | EtcdConnectionError | EtcdTransientError):
        return UNANSWERED
    if isinstance(exc, EtcdError):  # UNAUTHENTICATED, PERMISSION_DENIED
        return REFUSED
    if isinstance(exc, grpc.aio.AioRpcError | grpc.Call):
        if exc.code() in _UNANSWERED_CODES:
            return UNANSWERED
        if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and _NO_SPACE in (exc.details() or ""):
            return NO_SPACE
        return REFUSED
    return ""
