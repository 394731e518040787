"""Taking a worker name or an engine claim over from a holder proven gone, instead of waiting out
its lease.

A shim killed without its stop (kill -9, the OOM killer) leaves its lease to expire: for up to
--lease-ttl (10 s) and a margin its worker key and engine claim stay, and a shim restarted in its
place (`kvswitch up` restarts one at once, as do a pod's or a compose service's restart) waited
that out, its engine serving nothing (worker_shim.engine_claim, the held --worker-name).

The proof that the holder of lease L is gone, both parts needed:
(a) its worker key `/{ns}/workers/{worker}` is held by L. A shim creates that key last, after
    subscribing to its subjects and flushing (Registration's before_create), and unsubscribes only
    after revoking its lease (a session's end, a stop): while the key lives under L, a live holder
    is subscribed to `{ns}.cancel.{worker}`.
(b) a CancelRequest for a request id nobody sent, on `{ns}.cancel.{worker}`, is answered "no
    responders" by NATS PROBES times in a row, PROBE_GAP_S apart (a subscription made on another
    server of a NATS cluster reaches this one within them). A live shim answers no cancel (an
    unknown id is noted, and nothing sent back), so the request times out, which proves nothing.
Then L alone is revoked (the holder's worker key and claim go with it) and the registration made
at once. Anything else proves nothing and the lease is waited out as before: no worker key, or one
under another lease, a timeout, NATS or etcd failing, and NATS credentials (an identity
`kvswitch secrets` makes may not publish on another's cancel subject, nor hear the answer).

A live holder cut off from NATS for all of a probe (its server gone, no other joined yet) looks
gone. Revoked, it registers again, finds the name or the engine taken and exits 2 naming the
holder (worker_shim.shim), so one shim still serves the engine, never two.
"""

from __future__ import annotations

import asyncio
import logging
import secrets

from nats.aio.client import Client as Nats
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from discovery import Discovery, DiscoveryError, KeyTaken
from protocol import CancelRequest, EngineClaim, ProtocolError, decode_json, encode_msg, subjects

__all__ = ["PROBES", "PROBE_GAP_S", "NotProven", "take_over"]

log = logging.getLogger(__name__)

PROBES = 3
PROBE_GAP_S = 0.4
PROBE_TIMEOUT_S = 0.5  # a live holder's silence: the wait for an answer that never comes


class NotProven(Exception):
    """The holder of a taken key is not proven gone; the message says why (the wait's warning)."""


async def take_over(nc: Nats, discovery: Discovery, ns: str, taken: KeyTaken) -> str:
    """Revoke `taken`'s lease once its holder is proven gone; returns the holder's worker id.
    NotProven, naming why, when it is not (nothing is changed then)."""
    if not taken.holder:
        raise NotProven(f"{taken.key} is held by no lease")
    worker = _holder_worker(ns, taken)
    try:
        held_by = await discovery.holder(subjects.worker_key(ns, worker))
    except DiscoveryError as exc:
        raise NotProven(f"etcd: {exc}") from exc
    if held_by != taken.holder:
        raise NotProven(f"the worker key of {worker} is not held by lease {taken.holder:x}")
    await _no_responders(nc, subjects.cancel(ns, worker))
    try:
        await discovery.revoke(taken.holder)
    except DiscoveryError as exc:
        raise NotProven(f"etcd: {exc}") from exc
    log.warning(
        "%s was held by worker %s, which NATS says has nobody on %s: it is gone (killed without its stop); "
        "revoked its lease %x rather than wait for it to expire",
        taken.key, worker, subjects.cancel(ns, worker), taken.holder,
    )  # fmt: skip
    return worker


def _holder_worker(ns: str, taken: KeyTaken) -> str:
    """The worker id whose key or engine claim `taken` names."""
    if taken.key.startswith(workers := subjects.workers_prefix(ns)):
        return taken.key[len(workers) :]
    try:
        return decode_json(taken.value, EngineClaim).worker
    except ProtocolError as exc:
        raise NotProven(f"{taken.key} does not name its worker: {exc}") from exc


async def _no_responders(nc: Nats, subject: str) -> None:
    """NotProven unless NATS answers `subject` with no responders PROBES times in a row."""
    for probe in range(PROBES):
        if probe:
            await asyncio.sleep(PROBE_GAP_S)
        ask = CancelRequest(request_id=f"kvswitch-takeover-probe-{secrets.token_hex(8)}")
        try:
            await nc.request(subject, encode_msg(ask), timeout=PROBE_TIMEOUT_S)
        except NoRespondersError:
            continue
        except NatsTimeout as exc:
            raise NotProven(f"a shim is subscribed on {subject} (alive)") from exc
        except Exception as exc:  # a NATS connection down or closed: nothing proven
            raise NotProven(f"NATS: {exc!r}") from exc
        raise NotProven(f"{subject} answered a cancel")
