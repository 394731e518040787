"""Taking a worker name or an engine claim over from a holder proven gone, instead of waiting out
its lease.

A shim killed without its stop (kill -9, the OOM killer) leaves its lease to expire: for up to
--lease-ttl (10 s) and a margin its worker key and engine claim stay, and a shim restarted in its
place (`kvswitch up` restarts one at once, as do a pod's or a compose service's restart) waited
that out, its engine serving nothing (worker_shim.engine_claim, the held --worker-name).

The proof that the holder of lease L is gone is etcd's: a live holder renews L every
renewal_interval(TTL) (TTL/3: discovery.lease), so etcd's leader never counts less than TTL - that
interval - RENEWAL_MARGIN_S left on it. Less left is a renewal missed, read once or after waiting
(at most that interval and the margin) for it to show; a renewal meanwhile proves the holder
alive. A holder may miss renewals alive: its event loop stalled (a long synchronous step, a GC
pause, a starved CPU) or cut off from etcd's leader. So the holder must also be silent on NATS:
(a) its worker key `/{ns}/workers/{worker}` is held by L. A shim creates that key last, after
    subscribing to its subjects and flushing (Registration's before_create), and unsubscribes only
    after revoking its lease (a session's end, a stop): while the key lives under L, a live holder
    is subscribed to `{ns}.cancel.{worker}`;
(b) a CancelRequest for a request id nobody sent, on `{ns}.cancel.{worker}`, is answered "no
    responders" by NATS PROBES times in a row, PROBE_GAP_S apart. A live shim answers no cancel (an
    unknown id is noted, and nothing sent back), so the request times out: alive.
A stalled holder stays subscribed until its server drops its connection (PINGs unanswered:
minutes at nats-server's defaults; or writes to it blocked past the server's write_deadline, a
slow consumer), so short of that it is not evicted, however long it stalls within its lease.
NATS alone proved nothing: a NATS cluster whose route between two servers drops forgets, on each
side, the other side's subscriptions until the route is back (seconds), so a live holder on the
other server was "no responders"; etcd's proof does not depend on it.
Then L alone is revoked (the holder's worker key and claim go with it) and the registration made
at once. Anything else proves nothing and the lease is waited out as before: no worker key, or one
under another lease, a timeout or a renewal, NATS or etcd failing. With NATS credentials there is
no takeover (worker_shim.shim waits the lease out): an identity `kvswitch secrets` makes may not
publish on another worker's cancel subject, nor hear the answer, and etcd's proof alone evicted a
live, streaming holder whose event loop stalled 2.5 s across a renewal (review of 2026-12-06).

A live holder evicted all the same (missing renewals, and unknown to the newcomer's NATS server:
cut off from NATS too, or its server's route to the newcomer's down) registers again, finds the
name or the engine taken and exits 2 naming the holder (worker_shim.shim), so one shim still
serves the engine, never two.
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets

from nats.aio.client import Client as Nats
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from discovery import Discovery, DiscoveryError, KeyTaken, renewal_interval
from protocol import CancelRequest, EngineClaim, ProtocolError, decode_json, encode_msg, subjects

__all__ = ["PROBES", "PROBE_GAP_S", "RENEWAL_MARGIN_S", "NotProven", "take_over"]

log = logging.getLogger(__name__)

PROBES = 3
PROBE_GAP_S = 0.4
PROBE_TIMEOUT_S = 0.5  # a live holder's silence: the wait for an answer that never comes
# How late a live holder's renewal may reach etcd's leader: its event loop busy, the network, a
# keep-alive stream reopened after a member restarted (discovery.lease retries within 0.1-1 s).
RENEWAL_MARGIN_S = 1.0
READ_AFTER_S = 0.05  # past the moment a missed renewal must show, against rounding


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
    cancel = subjects.cancel(ns, worker)
    await _no_responders(nc, cancel)
    unrenewed = await _missed_renewal(discovery, taken.holder)
    try:
        await discovery.revoke(taken.holder)
    except DiscoveryError as exc:
        raise NotProven(f"etcd: {exc}") from exc
    log.warning(
        "%s was held by worker %s, which missed its lease renewals for %s and NATS has nobody on %s: "
        "revoked its lease %x rather than wait for it to expire",
        taken.key, worker, unrenewed, cancel, taken.holder,
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


async def _missed_renewal(discovery: Discovery, lease_id: int) -> str:
    """How long etcd has not seen `lease_id` renewed ("over 5s", "it expired"), once that is longer
    than its holder's renewal interval and RENEWAL_MARGIN_S; NotProven when the lease was renewed
    meanwhile. Waits, at most that interval and the margin and a second, for a missed one to show."""
    waited = False
    while True:
        try:
            ttl = await discovery.time_to_live(lease_id)
        except DiscoveryError as exc:
            raise NotProven(f"etcd: {exc}") from exc
        if ttl is None:
            return "its whole TTL (it expired)"
        left, granted = ttl
        interval = renewal_interval(granted)
        # A live holder's lease has at least `bound` s left, so etcd's count (rounded down) at
        # least floor(bound); less is a renewal missed.
        shown = math.floor(granted - interval - RENEWAL_MARGIN_S)
        if left < shown:
            return f"over {granted - left - 1}s (it renews every {interval:.1f}s)"
        if waited:
            raise NotProven(
                f"etcd saw lease {lease_id:x} renewed within the last {granted - left}s (its holder renews every "
                f"{interval:.1f}s): alive"
            )
        # Fewer than left + 1 s are left: unrenewed, it shows less than `shown` by then.
        await asyncio.sleep(left + 1 - shown + READ_AFTER_S)
        waited = True


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
