"""A client that leaves mid-stream: the attempt's booking is freed before release() offers the
room it held to the admission queue, not later, when the dispatcher's generator is collected."""

from __future__ import annotations

import aiohttp
import pytest

from router.dispatch import Job
from router.request_path import RequestPath
from tests.router.conftest import MODEL, Cluster
from tests.router.polling import until


async def test_a_client_that_leaves_frees_its_booking_before_the_queue_is_offered_its_room(
    cluster: Cluster, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    router = await cluster.agg_router(1, disagg="never")
    ledger = router.path.planner.ledger
    seen: list[int] = []
    release = RequestPath.release

    def recording(path: RequestPath, job: Job) -> None:
        if not job.released:
            seen.append(ledger.live)  # bookings still held as the room is offered
        release(path, job)

    monkeypatch.setattr(RequestPath, "release", recording)
    body = {"model": MODEL, "prompt": list(range(60)), "max_tokens": 3000, "stream": True, "ignore_eos": True}
    resp = await http.post(router.url + "/v1/completions", json=body)
    await resp.content.readline()
    resp.close()
    await until(lambda: bool(seen), what="the request released")
    assert seen == [0]
    await until(lambda: ledger.live == 0, what="nothing left booked")
