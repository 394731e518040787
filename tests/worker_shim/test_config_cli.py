"""ShimConfig validation, CLI layering, the flag-versus-engine startup checks (limits, the served
model), and a shim that waits for its engine saying so."""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from engine_sim.server import SimServer
from kvswitch.servers import free_port
from protocol import ConfigError
from tests.worker_shim.cluster import shim_for, sim_config, wait_for
from tests.worker_shim.test_model_config import TINY_LLAMA
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
        ({"engine_url": "http://127.0.0.1:99999"}, "engine_url"),  # it waited for /health forever
        ({"model": ""}, "model"),
        ({"engine": "sglang", "kv_events": None}, "kv_events"),  # vLLM's are read from the engine
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


async def test_a_model_the_engine_does_not_serve_is_a_startup_error_naming_what_it_serves(
    ns: str, nats_url: str, etcd_url: str
) -> None:
    async with SimServer(sim_config()) as sim:
        shim = shim_for(sim, ns, nats_url, etcd_url, model="llama-typo")
        async with shim:
            await shim.done.wait()
            assert shim.status is ShimStatus.FAILED and not shim.registered.is_set()
            assert isinstance(shim.failure, ConfigError) and shim.failure.setting == "model"
            assert f"serves {sim.config.model}: give --model one of them" in str(shim.failure)


async def test_the_engines_max_model_len_is_registered(ns: str, nats_url: str, etcd_url: str) -> None:
    async with SimServer(sim_config(max_model_len=4096)) as sim, shim_for(sim, ns, nats_url, etcd_url) as shim:
        await shim.registered.wait()
        assert shim.limits.max_model_len == 4096


VLLM_EVENTS = (
    '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
    '"replay_endpoint": "tcp://*:5558", "topic": "kv-events", "buffer_steps": 10000, "hwm": 100000, '
    '"max_queue_size": 100000}'
)


def test_vllms_kv_events_config_sets_the_endpoints_and_topic() -> None:
    cfg = ShimConfig(model="m", kv_events_config=VLLM_EVENTS).validate()
    assert (cfg.kv_events, cfg.kv_replay, cfg.kv_events_topic) == ("tcp://*:5557", "tcp://*:5558", "kv-events")
    # vLLM's defaults for what the JSON leaves out; an explicit flag that agrees is fine.
    cfg = ShimConfig(model="m", kv_events="tcp://*:5557", kv_events_config='{"enable_kv_cache_events": true}')
    assert cfg.validate().kv_events == "tcp://*:5557" and cfg.validate().kv_replay is None


def test_sglangs_kv_events_config_needs_the_zmq_publisher() -> None:
    raw = '{"publisher": "zmq", "endpoint": "tcp://10.0.0.7:6000", "topic": "t"}'
    cfg = ShimConfig(engine="sglang", model="m", kv_events_config=raw).validate()
    assert (cfg.kv_events, cfg.kv_events_topic) == ("tcp://10.0.0.7:6000", "t")
    with pytest.raises(ConfigError, match="publisher 'null'"):
        ShimConfig(engine="sglang", model="m", kv_events_config='{"endpoint": "tcp://*:1"}').validate()


@pytest.mark.parametrize(
    ("kw", "setting", "words"),
    [
        ({"kv_events_config": '{"publisher": "zmq"}'}, "kv_events_config", "enable_kv_cache_events"),
        ({"kv_events_config": '{"enable_kv_cache_events": true, "publisher": "null"}'}, "kv_events_config", "null"),
        ({"kv_events_config": '{"enable_kv_cache_events": true, "endpont": "x"}'}, "kv_events_config", "endpont"),
        ({"kv_events_config": "{not json"}, "kv_events_config", "not JSON"),
        ({"kv_events_config": '{"enable_kv_cache_events": true, "hwm": "big"}'}, "kv_events_config", "hwm"),
        ({"kv_events_config": VLLM_EVENTS, "kv_events": "tcp://*:6000"}, "kv_events", "tcp://*:5557"),
        ({"kv_events_config": VLLM_EVENTS, "kv_replay": "tcp://*:6001"}, "kv_replay", "replay_endpoint"),
        ({"kv_events_config": VLLM_EVENTS, "kv_events_topic": "other"}, "kv_events_topic", "kv-events"),
        ({"kv_events_config": VLLM_EVENTS, "engine": "trtllm"}, "kv_events_config", "trtllm"),
        ({"kv_events": "tcp://*:1", "worker_name": "a.b"}, "worker_name", "subject token"),
        ({"kv_events": "tcp://*:1", "load_period_s": 0}, "load_period_s", "must be in [0.05, 60.0]"),
        # faster, a shim sent more reports than routers take from one worker: quarantined as a flood
        # and read silent for 15 s at a time, blamed on an intruder (review of 2026-12-06)
        (
            {"kv_events": "tcp://*:1", "load_period_s": 0.01},
            "load_period_s",
            "PERIOD_S) = 0.01: must be in [0.05, 60.0]",
        ),
        ({"kv_events": "tcp://*:1", "http_port": 70000}, "http_port", "65535"),
    ],
)
def test_events_config_errors_name_the_setting(kw: dict[str, object], setting: str, words: str) -> None:
    with pytest.raises(ConfigError) as err:
        ShimConfig(model="m", **kw).validate()  # type: ignore[arg-type]
    assert err.value.setting == setting and words in str(err.value)


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--kv-events", "tcp://127.0.0.1:5557"),
        ("--kv-replay", "tcp://127.0.0.1:5558"),
        ("--kv-events-topic", "kv-events"),
        ("--kv-events-mode", "bind"),
    ],
)
def test_a_zmq_event_setting_with_engine_trtllm_is_refused_naming_it(flag: str, value: str) -> None:
    """Config review of 2026-12-07, finding 7: TensorRT-LLM's events come over HTTP, so these were
    read by nothing, where --kv-events-config was refused for the same reason."""
    setting = flag.removeprefix("--").replace("-", "_")
    with pytest.raises(ConfigError) as err:
        resolve_settings(parse("--engine", "trtllm", "--model", "m", flag, value))
    assert (err.value.setting, err.value.value) == (setting, value)
    assert "read with --engine vllm or sglang only, not --engine trtllm" in str(err.value), err.value
    shim, _, _ = resolve_settings(parse("--engine", "trtllm", "--model", "m", "--kv-events-mode", "auto"))
    assert (shim.kv_events, shim.kv_replay, shim.kv_events_topic) == (None, None, "")


@pytest.mark.parametrize(
    ("kw", "setting"),
    [
        ({"kv_events": "tcp://x"}, "kv_events"),  # no port: "Invalid argument" each second, never registered
        ({"kv_events": "tcp://127.0.0.1:abc"}, "kv_events"),
        ({"kv_events": "tcp://127.0.0.1:0"}, "kv_events"),  # the shim would bind a port nobody knows
        ({"kv_events": "tcp://127.0.0.1:70000"}, "kv_events"),  # ZMQ binds 4464 (70000 - 65536)
        ({"kv_events": "tcp://:5557"}, "kv_events"),
        ({"kv_events": "tcp://127.0.0.1:5557/x"}, "kv_events"),
        ({"kv_events": "ipc://"}, "kv_events"),
        ({"engine": "sglang", "kv_events": "tcp://*:0"}, "kv_events"),  # only vLLM lists the port it bound
        ({"kv_replay": "tcp://*:abc"}, "kv_replay"),
        ({"kv_replay": "tcp://[::1:5558"}, "kv_replay"),
        ({"kv_events": "tcp://[]:5557"}, "kv_events"),  # "No such device" at each session's bind
        ({"kv_events": "tcp://::1:5557"}, "kv_events"),  # ZMQ reads it only with zmq.IPV6 set
        ({"kv_events": "tcp://[::1]x:5557"}, "kv_events"),
        ({"kv_events": "tcp://[localhost]:5557"}, "kv_events"),
        (
            {"kv_events": None, "kv_events_config": '{"enable_kv_cache_events": true, "endpoint": "tcp://*"}'},
            "kv_events_config",
        ),
    ],
)
def test_an_endpoint_zmq_cannot_open_is_refused_naming_its_flag(kw: dict[str, object], setting: str) -> None:
    base: dict[str, object] = {"model": "m", "kv_events": "tcp://*:5557", **kw}
    with pytest.raises(ConfigError) as err:
        ShimConfig(**base).validate()  # type: ignore[arg-type]
    assert err.value.setting == setting and "tcp://HOST:PORT with PORT in 1..65535" in str(err.value)


@pytest.mark.parametrize(
    "endpoint",
    [
        "tcp://*:5557",
        "tcp://10.0.0.7:5557",
        "tcp://engine-1.local:65535",
        "tcp://[::1]:5557",
        "tcp://[::]:5557",
        "tcp://0.0.0.0:1",
        "tcp://*:0",
        "ipc:///tmp/ev",
        "inproc://cache",
    ],
)
def test_the_endpoints_zmq_opens_are_taken(endpoint: str) -> None:
    cfg = ShimConfig(model="m", kv_events=endpoint, kv_replay=endpoint).validate()
    assert (cfg.kv_events, cfg.kv_replay) == (endpoint, endpoint)


def test_the_shim_command_exits_2_naming_a_bad_endpoints_flag() -> None:
    argv = [sys.executable, "-m", "kvswitch", "shim", "--model", "m", "--kv-events", "tcp://127.0.0.1:abc"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--kv-events" in out.stderr and "tcp://HOST:PORT" in out.stderr, out.stderr


@pytest.mark.parametrize(
    ("kw", "words"),
    [
        ({"load_period_s": 61.0}, "must be in [0.05, 60.0]"),  # routers cap the period at 60 s: silent in between
        ({"load_period_s": float("inf")}, "finite"),
        ({"health_interval_s": float("nan")}, "finite"),
        ({"health_interval_s": float("inf")}, "finite"),
        ({"drain_grace_s": float("nan")}, "finite"),
        ({"drain_grace_s": float("inf")}, "finite"),
        ({"reregister_grace_s": float("nan")}, "finite"),
        ({"reregister_grace_s": float("inf")}, "finite"),
        ({"events_timeout_s": float("inf")}, "finite"),
        ({"busy_limit_s": float("inf")}, "finite"),
        ({"timing_profile": "h100:llama"}, "unknown timing profile 'h100:llama'; known: h200:llama-3.1-8b"),
    ],
)
def test_durations_and_the_timing_profile_are_checked(kw: dict[str, object], words: str) -> None:
    with pytest.raises(ConfigError) as err:
        ShimConfig(model="m", kv_events="tcp://*:1", **kw).validate()  # type: ignore[arg-type]
    assert err.value.setting == next(iter(kw)) and words in str(err.value)


def test_a_refused_timing_profile_at_a_speedup_is_shown_whole() -> None:
    """Review of 3a2a9c4: shown as `= '10x'`, ConfigError cutting all up to the `@` as a URL's userinfo."""
    with pytest.raises(ConfigError) as err:
        ShimConfig(model="m", kv_events="tcp://*:1", timing_profile="h200:nope@10x").validate()
    said = str(err.value)
    assert said.startswith("invalid timing_profile (--timing-profile, KVSWITCH_TIMING_PROFILE) = 'h200:nope@10x': "), (
        said
    )


def test_a_malformed_operator_timing_table_is_refused_at_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Audit 2026-12-04: only the name was checked, so the worker registered a table (here without
    `decode`) that the router's planner then failed on for every request of the model."""
    (tmp_path / "mygpu.json").write_text('{"models": [{"model": "m1", "kv_bytes_per_token_bf16": 1, "prefill": []}]}')
    monkeypatch.setenv("KVSWITCH_PROFILE_DIR", str(tmp_path))
    with pytest.raises(ConfigError) as err:
        ShimConfig(model="m", kv_events="tcp://*:1", timing_profile="mygpu:m1").validate()
    said = str(err.value)
    assert err.value.setting == "timing_profile" and "--timing-profile" in said, said
    assert str(tmp_path / "mygpu.json") in said and "model 'm1'" in said and "`prefill`" in said, said


def test_an_operator_timing_table_that_does_not_parse_is_refused_naming_its_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Until 2026-12-07 it read as an unknown name, "allowed values: h200:llama-3.1-8b, ...": a table
    that does not parse names no profile, and the file and the JSON error went unsaid."""
    (tmp_path / "mygpu.json").write_text('{"models": [{"model": "m1",\n "prefill": [}')
    monkeypatch.setenv("KVSWITCH_PROFILE_DIR", str(tmp_path))
    with pytest.raises(ConfigError) as err:
        ShimConfig(model="m", kv_events="tcp://*:1", timing_profile="mygpu:m1").validate()
    said = str(err.value)
    assert err.value.setting == "timing_profile" and "allowed values" not in said, said
    assert f"timing table {tmp_path / 'mygpu.json'}: cannot read it: Expecting value: line 2 column 14" in said, said


def test_a_profile_dir_that_is_no_directory_is_refused_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Audit 2026-12-07: a missing KVSWITCH_PROFILE_DIR was skipped, so a shim given the operator's
    own h200:llama-3.1-8b registered the built-in table of that name instead."""
    monkeypatch.setenv("KVSWITCH_PROFILE_DIR", str(tmp_path / "tables"))
    with pytest.raises(ConfigError) as err:
        ShimConfig(model="m", kv_events="tcp://*:1", timing_profile="h200:llama-3.1-8b").validate()
    assert err.value.setting == "KVSWITCH_PROFILE_DIR" and "names no directory" in str(err.value), err.value


def test_the_longest_load_period_and_a_known_profile_are_accepted() -> None:
    cfg = ShimConfig(model="m", kv_events="tcp://*:1", load_period_s=60.0, timing_profile="h200:qwen2.5-32b")
    assert cfg.validate().load_period_s == 60.0


def test_new_flags_reach_the_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    args = parse(
        "--model",
        "llama",
        "--kv-events-config",
        VLLM_EVENTS,
        "--load-period-s",
        "0.25",
        "--worker-name",
        "gpu-3",
        "--http-port",
        "9100",
        "--http-host",
        "0.0.0.0",
        "--model-path",
        str(tmp_path),  # a model's directory: another is refused
        "--events-timeout-s",
        "3",
        "--reregister-grace-s",
        "4",
    )
    shim, _, _ = resolve_settings(args)
    assert (shim.kv_events, shim.kv_events_topic, shim.load_period_s, shim.worker_name) == (
        "tcp://*:5557",
        "kv-events",
        0.25,
        "gpu-3",
    )
    assert (shim.http_host, shim.http_port, shim.model_path, shim.events_timeout_s, shim.grace_s) == (
        "0.0.0.0",
        9100,
        str(tmp_path),
        3.0,
        4.0,
    )
    assert shim.timing_profile is None and ShimConfig(model="m", kv_events="tcp://*:1", lease_ttl=7).grace_s == 14.0


async def test_a_shim_waiting_for_its_engine_says_so_and_when_it_came(
    ns: str, nats_url: str, etcd_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    port = free_port()
    async with SimServer(sim_config()) as first:  # only for its event endpoints' shape
        shim = shim_for(first, ns, nats_url, etcd_url, engine_url=f"http://127.0.0.1:{port}")
    with caplog.at_level(logging.INFO, logger="worker_shim.shim"):
        async with shim:
            await wait_for(lambda: "its /health is down" in caplog.text, what="the waiting line")
            assert f"waiting for the vllm engine at http://127.0.0.1:{port}" in caplog.text
            assert "check --engine-url" in caplog.text
            async with SimServer(sim_config(port=port)):
                await wait_for(lambda: f"the engine at http://127.0.0.1:{port} is up after" in caplog.text)


def test_a_config_file_key_no_setting_reads_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "shim.yaml"
    path.write_text("engine: vllm\nengine_url: http://127.0.0.1:8000\nmodle: llama\n")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(ConfigError, match="'modle' is not a setting; did you mean 'model'"):
        resolve_settings(parser.parse_args(["--config", str(path)]))


def test_kvswitch_config_in_the_environment_is_refused_naming_the_flag(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--config is a flag only: the file a KVSWITCH_CONFIG names would not be read, unsaid."""
    path = tmp_path / "shim.yaml"
    path.write_text("role: decode\n")
    monkeypatch.setenv("KVSWITCH_CONFIG", str(path))
    with pytest.raises(ConfigError, match="--config is a flag only"):
        resolve_settings(parse("--model", "m"))


def _json(**keys: str) -> str:
    return json.dumps({"enable_kv_cache_events": True, "endpoint": "tcp://*:5557", **keys})


@pytest.mark.parametrize(
    ("events", "replay", "rank", "expected"),
    [
        ("tcp://*:5557", "tcp://*:5567", 2, ("tcp://*:5559", "tcp://*:5569")),
        ("tcp://10.0.0.7:5557", None, 1, ("tcp://10.0.0.7:5558", None)),
        ("inproc://cache", None, 3, ("inproc://cache_dp3", None)),
        ("tcp://*:0", None, 1, ("tcp://*:0", None)),  # port 0: the OS picks, vLLM leaves it
        ("tcp://*:5557", "tcp://*:5567", 0, ("tcp://*:5557", "tcp://*:5567")),
    ],
)
def test_a_data_parallel_rank_offsets_the_endpoints_as_vllm_does(
    events: str, replay: str | None, rank: int, expected: tuple[str, str | None]
) -> None:
    """Each rank of a vLLM given `endpoint` publishes on port + rank (vllm.distributed.kv_events)."""
    cfg = ShimConfig(model="m", kv_events=events, kv_replay=replay, data_parallel_rank=rank).validate()
    assert (cfg.kv_events, cfg.kv_replay) == expected
    from_json = ShimConfig(model="m", kv_events_config=VLLM_EVENTS, data_parallel_rank=1).validate()
    assert (from_json.kv_events, from_json.kv_replay) == ("tcp://*:5558", "tcp://*:5559")
    assert parse("--data-parallel-rank", "2").data_parallel_rank == 2


@pytest.mark.parametrize(
    ("kw", "setting", "words"),
    [
        ({"data_parallel_rank": -1}, "data_parallel_rank", "must be >= 0"),
        ({"engine": "sglang", "data_parallel_rank": 1}, "data_parallel_rank", "only vLLM"),
        ({"kv_events": "ipc:///tmp/ev", "data_parallel_rank": 1}, "kv_events", "tcp:// or inproc://"),
        ({"kv_events": "tcp://*:65535", "data_parallel_rank": 1}, "kv_events", "tcp://*:65536 (port + rank)"),
        # Given only in the engine's JSON, the error named --kv-events, which the operator never gave.
        (
            {"kv_events": None, "kv_events_config": _json(endpoint="tcp://*:65535"), "data_parallel_rank": 1},
            "kv_events_config",
            "endpoint 'tcp://*:65535': rank 1 publishes at tcp://*:65536",
        ),
        (
            {"kv_events": None, "kv_events_config": _json(replay_endpoint="tcp://*:65535"), "data_parallel_rank": 1},
            "kv_events_config",
            "replay_endpoint 'tcp://*:65535': rank 1 publishes at tcp://*:65536",
        ),
        (
            {"kv_events": None, "kv_events_config": _json(endpoint="ipc:///tmp/ev"), "data_parallel_rank": 1},
            "kv_events_config",
            "endpoint 'ipc:///tmp/ev': vLLM's data-parallel ranks publish on tcp:// or inproc:// only",
        ),
    ],
)
def test_a_data_parallel_rank_vllm_would_not_take_is_refused(kw: dict[str, object], setting: str, words: str) -> None:
    base: dict[str, object] = {"model": "m", "kv_events": "tcp://*:5557", **kw}
    with pytest.raises(ConfigError) as err:
        ShimConfig(**base).validate()  # type: ignore[arg-type]
    assert err.value.setting == setting and words in str(err.value)


@pytest.mark.parametrize("ttl", [0, 1, 9_000_000_001, 2**63])
def test_a_lease_ttl_etcd_would_not_grant_is_refused_at_start(ttl: int) -> None:
    # past etcd's MaxLeaseTTL every grant failed, and the shim retried for ever without naming the flag;
    # 1 etcd raised to 2 s, which the shim's waits and words did not know
    with pytest.raises(ConfigError, match=r"must be in 2\.\.9000000000") as err:
        ShimConfig(model="m", kv_events="tcp://*:5557", lease_ttl=ttl).validate()
    assert err.value.setting == "lease_ttl"
    longest = ShimConfig(model="m", kv_events="tcp://*:5557", lease_ttl=9_000_000_000)
    assert longest.validate().lease_ttl == 9_000_000_000
    assert ShimConfig(model="m", kv_events="tcp://*:5557", lease_ttl=2).validate().lease_ttl == 2


def test_a_file_key_that_would_set_both_nats_and_etcd_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "shim.yaml"
    path.write_text("password: s3cret\n")
    with pytest.raises(ConfigError, match="'password' would set nats_password and etcd_password") as err:
        resolve_settings(parse("--model", "m", "--engine-url", "http://h:9", "--config", str(path)))
    assert "s3cret" not in str(err.value)


def test_no_endpoint_probe_is_a_flag_a_variable_and_a_file_key_and_off_by_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KVSWITCH_NO_ENDPOINT_PROBE", raising=False)
    assert resolve_settings(parse("--model", "m"))[0].no_endpoint_probe is False  # the probe is sent
    assert resolve_settings(parse("--model", "m", "--no-endpoint-probe"))[0].no_endpoint_probe is True
    path = tmp_path / "shim.yaml"
    path.write_text("no_endpoint_probe: true\n")
    assert resolve_settings(parse("--model", "m", "--config", str(path)))[0].no_endpoint_probe is True
    monkeypatch.setenv("KVSWITCH_NO_ENDPOINT_PROBE", "true")
    assert resolve_settings(parse("--model", "m"))[0].no_endpoint_probe is True
