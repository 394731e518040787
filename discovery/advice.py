"""What an operator does about an etcd call that failed: etcd not answering (unreachable, out of
time, no leader) is the endpoints' or the server's to fix; etcd answering and refusing is what it
said. Until 2026-12-07 a shim named --etcd-endpoints for both, a full etcd's quota included, a TLS
handshake that failed during a run (gRPC says UNAVAILABLE) and a token etcd forgot (which the
token keeper renews by itself) too."""

from __future__ import annotations

import grpc
from etcd3aio import EtcdConnectionError, EtcdError, EtcdTransientError

from discovery.auth_token import rejects_token
from discovery.lease import said

__all__ = ["CALL_FAILED", "NO_SPACE", "REFUSED", "TLS", "TLS_FAILED", "TOKEN_FORGOTTEN", "UNANSWERED", "advice"]

UNANSWERED = "check --etcd-endpoints and the server"
# etcd's words (its rpctypes ErrGRPCNoSpace) once its backend reached --quota-backend-bytes: it
# raised the NOSPACE alarm and takes no write (a lease grant included) until an operator acts.
_NO_SPACE = "database space exceeded"
NO_SPACE = (
    "etcd's quota is full (--quota-backend-bytes) and it takes no write until it is compacted, defragmented "
    "and its alarm disarmed (etcdctl compact REV, etcdctl defrag, etcdctl alarm disarm)"
)
REFUSED = "etcd answered and refused it: the endpoints are right, its words say why"
# gRPC's words for a handshake that failed on a certificate (the CA's, the server's name in it, or
# the client's): a wrong or outdated file, which blaming the endpoints would not fix. At connect
# (Discovery.connect) they name --etcd-tls-ca; during a run gRPC reports them as UNAVAILABLE.
TLS_FAILED = ("Tls handshake failed", "is not in peer certificate", "Hostname Verification Check failed")
TLS = (
    "the TLS handshake with etcd failed: its certificate no longer verifies against --etcd-tls-ca or names "
    "the host in --etcd-endpoints (rotated to another CA?), or --etcd-tls-cert/--etcd-tls-key expired"
)
# etcd's UNAUTHENTICATED (its rpctypes ErrGRPCInvalidAuthToken): the token this process holds is
# one etcd no longer knows; the token keeper (discovery.auth_token) renews it on this very error.
TOKEN_FORGOTTEN = (
    "etcd forgot this process's auth token (etcd restarted, or the token's TTL passed): a new one is "
    "taken and the next try uses it"
)
_UNANSWERED_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
CALL_FAILED = (TimeoutError, EtcdError, grpc.RpcError)  # how an etcd call fails (AioRpcError is an RpcError)


def advice(exc: BaseException) -> str:
    """What to do about `exc`, a failed etcd call (or the error raised from one, a DiscoveryError);
    "" for anything else (a DiscoveryError of discovery's own, with no call's error under it)."""
    if not isinstance(exc, CALL_FAILED):
        if exc.__cause__ is None:
            return ""
        exc = exc.__cause__
    if any(words in said(exc) for words in TLS_FAILED):  # before UNAVAILABLE, which gRPC says it as
        return TLS
    if rejects_token(exc):
        return TOKEN_FORGOTTEN
    # etcd3aio raises UNAVAILABLE and DEADLINE_EXCEEDED as these once its retries are spent
    if isinstance(exc, TimeoutError | EtcdConnectionError | EtcdTransientError):
        return UNANSWERED
    if isinstance(exc, EtcdError):  # PERMISSION_DENIED
        return REFUSED
    if isinstance(exc, grpc.aio.AioRpcError | grpc.Call):
        if exc.code() in _UNANSWERED_CODES:
            return UNANSWERED
        if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and _NO_SPACE in (exc.details() or ""):
            return NO_SPACE
        return REFUSED
    return ""
