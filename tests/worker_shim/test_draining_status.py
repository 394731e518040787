"""A draining shim's /health status is not overwritten by its registration: the registration runs
on through the drain (stopped after it), and a lease lost, a try etcd failed or a registration made
anew then said `registering`, `waiting_etcd`, or `serving` with a 200, of a shim that stops (final
read of 2026-12-07)."""

from __future__ import annotations

from discovery import DiscoveryError, KeyTaken
from protocol.config import EtcdSettings, NatsSettings
from worker_shim import ShimStatus
from worker_shim.config import ShimConfig
from worker_shim.shim import WorkerShim


def _shim() -> WorkerShim:
    cfg = ShimConfig(engine="vllm", model="m", engine_url="http://127.0.0.1:1", kv_events="tcp://127.0.0.1:2")
    return WorkerShim(cfg, NatsSettings(servers=["nats://127.0.0.1:1"]), EtcdSettings(endpoints=["http://127.0.0.1:1"]))


def _status(shim: WorkerShim) -> ShimStatus:  # read anew each time (a hook sets it)
    return shim.status


async def test_the_registrations_hooks_leave_a_draining_shims_status() -> None:
    shim = _shim()
    shim._stopping.set()
    shim.status = ShimStatus.DRAINING
    shim._reregister_failed(DiscoveryError("etcd does not answer"), 1.0)
    assert _status(shim) is ShimStatus.DRAINING
    shim._lost_lease_waited(KeyTaken("/k", 0x2A))
    assert _status(shim) is ShimStatus.DRAINING
    await shim._on_lease_lost("old")
    assert _status(shim) is ShimStatus.DRAINING


async def test_a_serving_shims_registration_hooks_say_what_it_waits_for() -> None:
    shim = _shim()
    shim.status = ShimStatus.REGISTERED
    shim._reregister_failed(DiscoveryError("etcd does not answer"), 1.0)
    assert _status(shim) is ShimStatus.WAITING_ETCD
    shim._lost_lease_waited(KeyTaken("/k", 0x2A))
    assert _status(shim) is ShimStatus.REGISTERING
