"""ShimConfig validation, CLI layering, and the flag-versus-engine startup check."""

from __future__ import annotations

import argparse

import pytest

from engine_sim.server import SimServer
from protocol import ConfigError
from tests.worker_shim.cluster import shim_for, sim_config
from worker_shim import ShimConfig, ShimStatus
from worker_shim.cli import add_arguments, resolve_settings


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


@pytest.mark.parametrize(
    ("kw", "setting"),
    [
        ({"engine": "tgi"}, "engine"),
        ({"role": "both"}, "role"),
        ({"engine_url": "localhost:8000"}, "engine_url"),
        ({"model": ""}, "model"),
        ({"kv_events": None}, "kv_events"),
        ({"kv_events": "http://x"}, "kv_events"),
        ({"block_size": 0}, "block_size"),
        ({"namespace": "a.b"}, "namespace"),
    ],
)
def test_invalid_settings_name_the_setting(kw: dict[str, object], setting: str) -> None:
    base: dict[str, object] = {"model": "m", "kv_events": "tcp://*:5557"}
    base.update(kw)
    with pytest.raises(ConfigError) as err:
        ShimConfig(**base).validate()  # type: ignore[arg-type]
    assert err.value.setting == setting


def test_cli_flags_env_and_defaults_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSWITCH_ROLE", "decode")
    monkeypatch.setenv("KVSWITCH_NATS_SERVERS", "nats://a:1,nats://b:2")
    args = parse(
        "--engine",
        "trtllm",
        "--model",
        "llama",
        "--engine-url",
        "http://h:9",
        "--block-size",
        "32",
        "--etcd-endpoints",
        "http://e:2379",
    )
    shim, nats, etcd = resolve_settings(args)
    assert (shim.engine, shim.role, shim.model, shim.block_size, shim.lease_ttl) == (
        "trtllm",
        "decode",
        "llama",
        32,
        10,
    )
    assert nats.servers == ["nats://a:1", "nats://b:2"] and etcd.endpoints == ["http://e:2379"]


async def test_a_flag_that_disagrees_with_the_engine_is_a_startup_error(ns: str, nats_url: str, etcd_url: str) -> None:
    async with SimServer(sim_config()) as sim:
        shim = shim_for(sim, ns, nats_url, etcd_url, block_size=32)
        async with shim:
            await shim.done.wait()
            assert shim.status is ShimStatus.FAILED and not shim.registered.is_set()
            assert isinstance(shim.failure, ConfigError) and "16" in str(shim.failure) and "32" in str(shim.failure)
