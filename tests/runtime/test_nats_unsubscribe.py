"""runtime.nats_unsubscribe against a real nats-server: a responder that leaves in the middle of a
burst of requests answers every one the server gave it, and the others get "no responders"."""

from __future__ import annotations

import asyncio

import nats
import nats.errors
from nats.aio.msg import Msg

from kvswitch.servers import NatsServer
from runtime.nats_flush import flush
from runtime.nats_unsubscribe import unsubscribe
from tests.worker_shim.cluster import wait_for

REQUESTS = 200


class _Answering:
    """A responder that answers "ok" after `delay` s, counting the requests it handled."""

    def __init__(self, delay: float) -> None:
        self.delay, self.handled = delay, 0

    async def answer(self, msg: Msg) -> None:  # a method: nats-py takes coroutine functions only
        self.handled += 1
        if self.delay:
            await asyncio.sleep(self.delay)
        await msg.respond(b"ok")


async def _outcomes(requests: list[asyncio.Task[Msg]]) -> tuple[int, int, list[str]]:
    """How many were answered "ok", refused with no responders, and what became of the rest."""
    outcomes = await asyncio.gather(*requests, return_exceptions=True)
    answered = sum(isinstance(o, Msg) and o.data == b"ok" for o in outcomes)
    refused = sum(isinstance(o, nats.errors.NoRespondersError) for o in outcomes)
    return answered, refused, [repr(o) for o in outcomes if not isinstance(o, Msg | nats.errors.NoRespondersError)]


async def test_a_responder_leaving_mid_burst_leaves_no_request_unanswered() -> None:
    # A slow callback keeps the burst queued at the responder (read, not yet handled) and on its
    # socket when it leaves: nats-py's unsubscribe() dropped all of those, each requester timing out.
    with NatsServer() as server:
        responder, requester = await nats.connect(server.url), await nats.connect(server.url)
        try:
            responding = _Answering(delay=0.005)
            sub = await responder.subscribe("svc", cb=responding.answer)
            await flush(responder)
            burst = [asyncio.create_task(requester.request("svc", b"q", timeout=5)) for _ in range(REQUESTS)]
            await wait_for(lambda: responding.handled >= 5, 5, "the responder busy with the burst")
            await unsubscribe([sub])
            answered, refused, other = await _outcomes(burst)
            assert other == [], f"{len(other)} of {REQUESTS} neither answered nor refused: {other[:3]}"
            assert answered == responding.handled and answered + refused == REQUESTS
            assert sub not in responder._subs.values()  # forgotten: a reconnect would not subscribe it again
        finally:
            await requester.close()
            await responder.close()


async def test_requests_still_arriving_as_a_fast_responder_leaves_are_answered_or_refused() -> None:
    # A handler that answers at once leaves nothing queued: what the barrier keeps is what the server
    # sent before it had the UNSUB, still on the socket when the queue is empty. Without the flush
    # those MSGs came for a forgotten subscription and were dropped (the test above passed without it).
    with NatsServer() as server:
        responder, requester = await nats.connect(server.url), await nats.connect(server.url)
        try:
            responding = _Answering(delay=0.0)
            sub = await responder.subscribe("svc", cb=responding.answer)
            await flush(responder)
            sent: list[asyncio.Task[Msg]] = []
            leaving = asyncio.Event()

            async def keep_requesting() -> None:
                while not leaving.is_set():
                    sent.extend(asyncio.create_task(requester.request("svc", b"q", timeout=3)) for _ in range(50))
                    await asyncio.sleep(0)

            sending = asyncio.create_task(keep_requesting())
            await wait_for(lambda: responding.handled >= 50, 5, "the responder answering the stream")
            await unsubscribe([sub])
            await asyncio.sleep(0.05)  # more requests after it, each refused
            leaving.set()
            await sending
            answered, refused, other = await _outcomes(sent)
            assert other == [], f"{len(other)} of {len(sent)} neither answered nor refused: {other[:3]}"
            assert answered == responding.handled and refused > 0 and answered + refused == len(sent)
        finally:
            await requester.close()
            await responder.close()


async def test_the_private_names_the_unsubscribe_relies_on_are_still_nats_pys() -> None:
    with NatsServer() as server:
        nc = await nats.connect(server.url)
        try:

            async def ignore(msg: Msg) -> None:
                pass

            sub = await nc.subscribe("names", cb=ignore)
            assert callable(getattr(nc, "_send_unsubscribe", None)) and sub._conn is nc
            assert isinstance(sub._id, int) and isinstance(sub._pending_queue, asyncio.Queue)
        finally:
            await nc.close()
