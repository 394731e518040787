"""A cancel that races its request: right behind it, or ahead of it. The shim reads the gen and
cancel subjects in tasks of their own, so both orders happen; either way the leg ends once, with
its bookkeeping (in-flight legs, queued prefill tokens, heartbeats) back where it was."""

from __future__ import annotations

import asyncio

import pytest

from engine_sim.server import SimServer
from protocol import CancelRequest, encode_msg, subjects
from runtime.nats_flush import flush
from tests.worker_shim.cluster import sim_config, wait_for
from tests.worker_shim.test_request_service import agg_shim, gen
from worker_shim import request_service


async def test_a_cancel_right_behind_its_request_ends_the_leg_and_frees_what_it_held(
    ns: str, nats_url: str, etcd_url: str
) -> None:
    async with SimServer(sim_config(speedup=5.0)) as sim, agg_shim(sim, ns, nats_url, etcd_url) as (shim, col):
        assert shim.worker_id is not None and shim.requests is not None
        service = shim.requests
        for i in range(5):
            rid = f"quick{i}"
            # In one flush, so both reach the shim in one read and its cancel task can run first.
            await col.send(subjects.gen(ns, "agg", shim.worker_id), gen(rid, list(range(1, 200)), 64, heartbeat_s=0.1))
            await col.nc.publish(subjects.cancel(ns, shim.worker_id), encode_msg(CancelRequest(request_id=rid)))
            await flush(col.nc)
            final = await col.final(rid)
            assert final.finish_reason == "abort" and final.error is None
        await wait_for(lambda: not service.inflight, what="no leg left in flight")
        assert service.prefill_tokens_queued == 0
        chunks = sum(len(c) for c in col.chunks.values())
        await asyncio.sleep(0.5)  # five heartbeat periods: a leaked leg's writer would still beat
        assert sum(len(c) for c in col.chunks.values()) == chunks
        assert all([c.final for c in col.chunks[f"quick{i}"]].count(True) == 1 for i in range(5))
        await wait_for(lambda: sim.engine.num_blocks_in_use == 0, what="the engine freed every block")


async def test_a_cancel_ahead_of_its_request_aborts_it_on_arrival(ns: str, nats_url: str, etcd_url: str) -> None:
    async with SimServer(sim_config(speedup=5.0)) as sim, agg_shim(sim, ns, nats_url, etcd_url) as (shim, col):
        assert shim.worker_id is not None and shim.requests is not None
        before = sim.engine.stats.prompt_tokens
        await col.nc.publish(subjects.cancel(ns, shim.worker_id), encode_msg(CancelRequest(request_id="late")))
        await flush(col.nc)
        await asyncio.sleep(0.2)  # the cancel is read first: it names no leg yet
        await col.send(subjects.gen(ns, "agg", shim.worker_id), gen("late", list(range(1, 200)), 5000))
        final = await col.final("late")
        assert final.finish_reason == "abort" and final.error is None and len(col.chunks["late"]) == 1
        assert not shim.requests.inflight and shim.requests.prefill_tokens_queued == 0
        assert sim.engine.stats.prompt_tokens == before  # the engine never saw it
        # Remembered for that one request: the same id sent again runs.
        del col.finals["late"], col.chunks["late"]
        await col.send(subjects.gen(ns, "agg", shim.worker_id), gen("late", [7] * 40, 3))
        assert (await col.final("late")).finish_reason == "length"


async def test_a_late_cancel_or_an_old_one_is_not_held_against_a_new_leg(
    ns: str, nats_url: str, etcd_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cancel for a leg that already ended (a router leaving just as the final chunk came) needs
    no memory, and a remembered one lasts EARLY_CANCEL_S: a later leg of that id (a retry, a
    remote prefill sent here after a fallback) runs."""
    monkeypatch.setattr(request_service, "EARLY_CANCEL_S", 0.3)
    async with SimServer(sim_config(speedup=5.0)) as sim, agg_shim(sim, ns, nats_url, etcd_url) as (shim, col):
        assert shim.worker_id is not None
        subject, cancel = subjects.gen(ns, "agg", shim.worker_id), subjects.cancel(ns, shim.worker_id)
        await col.send(subject, gen("done", [7] * 40, 3))
        assert (await col.final("done")).finish_reason == "length"
        await col.nc.publish(cancel, encode_msg(CancelRequest(request_id="done")))
        await col.nc.publish(cancel, encode_msg(CancelRequest(request_id="old")))
        await flush(col.nc)
        await asyncio.sleep(0.5)  # past EARLY_CANCEL_S for "old"
        for rid in ("done", "old"):
            col.finals.pop(rid, None)
            col.chunks.pop(rid, None)
            await col.send(subject, gen(rid, [8] * 40, 3))
            assert (await col.final(rid)).finish_reason == "length", rid
