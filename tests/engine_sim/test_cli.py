"""`kvswitch sim`: flags, errors, fleet mode, clean SIGTERM."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import aiohttp
import msgspec
import pytest

import runtime
from engine_sim import KVEventsConfig, SimConfig, SimConfigError, SimFleet, SimServer, fleet_config
from engine_sim.cli import add_arguments, config_from_args, run
from engine_sim.lora import LoraModule
from kvswitch.servers import free_ports

ROOT = Path(__file__).resolve().parents[2]


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvswitch sim")
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_flags_build_the_config() -> None:
    events = '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:6000", "topic": "t"}'
    cfg = config_from_args(
        parse("--port", "9000", "--model", "m", "--block-size", "32", "--num-gpu-blocks", "100",
              "--max-model-len", "2048", "--kv-events-config", events, "--profile", "h200:qwen2.5-32b",
              "--speedup", "10", "--role", "decode", "--event-form", "array", "--crash-after", "3", "--slowdown", "2")
    )  # fmt: skip
    assert (cfg.port, cfg.model, cfg.block_size, cfg.num_gpu_blocks) == (9000, "m", 32, 100)
    assert cfg.kv_events.active and cfg.kv_events.endpoint == "tcp://*:6000" and cfg.kv_events.topic == "t"
    assert (cfg.profile, cfg.speedup, cfg.role, cfg.event_form) == ("h200:qwen2.5-32b", 10.0, "decode", "array")
    assert (cfg.crash_after, cfg.slowdown) == (3, 2.0)
    assert not config_from_args(parse()).kv_events.active  # events off by default, as vLLM


def test_the_kv_lease_is_vllms_kv_lease_duration() -> None:
    """vLLM 0.32's kv_transfer_config.kv_connector_extra_config.kv_lease_duration, 30 s by default."""
    assert config_from_args(parse()).kv_lease_duration == 30.0
    assert config_from_args(parse("--kv-lease-duration", "12.5")).kv_lease_duration == 12.5


def test_served_model_names_are_vllms() -> None:
    """`--model` is then the path (the cards' root), the first name the one answers carry."""
    cfg = config_from_args(parse("--model", "/models/llama", "--served-model-name", "llama", "llama-8b"))
    assert (cfg.model, cfg.aliases, cfg.root) == ("llama", ("llama-8b",), "/models/llama")
    assert (config_from_args(parse("--model", "m")).model, config_from_args(parse("--model", "m")).aliases) == ("m", ())


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--role", "router"], "--role"),
        (["--event-form", "json"], "--event-form"),
        (["--speedup", "0"], "--speedup"),
        (["--kv-lease-duration", "0"], "--kv-lease-duration"),
        (["--drop-event-fraction", "2"], "--drop-event-fraction"),
        (["--kv-events-config", "{nope"], "--kv-events-config"),
        (["--kv-events-config", '{"enable_kv_cache_events": true, "bogus": 1}'], "bogus"),
        (["--lora-modules", "no-path"], "name=path"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse(*argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert needle in err
    if argv[0] in ("--role", "--event-form"):
        assert "choose from" in err


@pytest.mark.parametrize(
    "argv",
    [["--restart-after-crash", "nan"], ["--restart-after-crash", "inf"], ["--slowdown", "inf"], ["--speedup", "nan"]],
)
def test_non_finite_durations_and_factors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse(*argv)
    assert exc.value.code == 2 and argv[0] in capsys.readouterr().err
    with pytest.raises(SimConfigError, match="restart-after-crash"):
        SimConfig(restart_after_crash_s=float("inf")).validate()


def _not_run(*args: object, **kwargs: object) -> int:
    raise AssertionError("the sims started before their flags were checked")


@pytest.mark.parametrize("speedup", ["0.0001", "2000000"])
def test_a_speedup_past_the_profile_bounds_is_refused_naming_the_flag(
    speedup: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A shim registers the sim's profile at its speed-up (`@{S}x`), which protocol.timing.check_speedup
    bounds: outside them the sim ran, and its shim's profile name was a ValueError."""
    monkeypatch.setattr(runtime, "run_service", _not_run)
    assert run(parse("--port", "0", "--speedup", speedup)) == 2
    err = capsys.readouterr().err
    want = f"--speedup must be a number in 0.001..1000000 (times the profile's speed), got {float(speedup)!r}"
    assert err == f"kvswitch sim: {want}\n", err


def test_a_max_model_len_the_kv_cache_cannot_hold_is_refused_as_vllm_does(capsys: pytest.CaptureFixture[str]) -> None:
    # 65 blocks: 64 hold KV, block 0 is vLLM's null block
    argv = ("--num-gpu-blocks", "65", "--block-size", "16", "--max-model-len", "1025")
    assert run(parse(*argv)) == 2
    err = capsys.readouterr().err
    assert "--max-model-len = 1025: To serve at least one request with the model's max seq len (1025)" in err
    assert "65 KV cache blocks are needed" in err and "estimated maximum model length is 1024" in err
    assert config_from_args(parse(*argv[:-1], "1024")).max_model_len == 1024


async def test_prefix_caching_is_on_unless_turned_off_as_vllm_does() -> None:
    assert config_from_args(parse()).enable_prefix_caching
    cfg = config_from_args(parse("--no-enable-prefix-caching"))
    assert not cfg.enable_prefix_caching
    body = {"model": "sim-llama", "prompt": list(range(100)), "max_tokens": 1}
    async with SimServer(msgspec.structs.replace(cfg, port=0, num_gpu_blocks=64)) as sim, aiohttp.ClientSession() as s:
        for _ in range(2):
            async with s.post(sim.url + "/v1/completions", json=body) as r:
                assert r.status == 200
        async with s.get(sim.url + "/metrics") as r:
            assert 'enable_prefix_caching="False"' in await r.text()
    assert sim.engine.stats.prefix_cache_hits == 0 and not sim.engine.pool.cached_blocks()


def test_lora_modules_as_vllm_takes_them() -> None:
    cfg = config_from_args(parse("--enable-lora", "--lora-modules", "sql=/a/sql", '{"name": "chat", "path": "/a/c"}'))
    assert cfg.lora_modules == (LoraModule("sql", "/a/sql"), LoraModule("chat", "/a/c"))
    assert config_from_args(parse()).lora_modules == ()


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--enable-lora", "--lora-modules", "sim-llama=/p"], "served model"),
        (["--enable-lora", "--lora-modules", "a=/p", "a=/q"], "twice"),
        (["--enable-lora", "--lora-modules", "=/p"], "a name and a path"),
        (["--lora-modules", "a=/p"], "--enable-lora"),
    ],
)
def test_bad_lora_modules_exit_2_naming_the_flag(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(parse(*argv)) == 2
    err = capsys.readouterr().err
    assert "--lora-modules" in err and needle in err


def test_fleet_ports_are_consecutive() -> None:
    base = SimConfig(port=8100, kv_events=KVEventsConfig(enable_kv_cache_events=True,
                     endpoint="tcp://*:5557", replay_endpoint="tcp://*:6557"))  # fmt: skip
    cfgs = [fleet_config(base, i) for i in range(3)]
    assert [c.port for c in cfgs] == [8100, 8101, 8102]
    assert [c.kv_events.endpoint for c in cfgs] == ["tcp://*:5557", "tcp://*:5558", "tcp://*:5559"]
    assert [c.kv_events.replay_endpoint for c in cfgs] == ["tcp://*:6557", "tcp://*:6558", "tcp://*:6559"]
    zero = SimConfig()
    assert {fleet_config(zero, i).port for i in range(3)} == {0}
    assert fleet_config(zero, 2).kv_events.endpoint == "tcp://[::ffff:127.0.0.1]:0"  # port 0 stays 0


async def test_fleet_in_process_runs_independent_engines() -> None:
    async with SimFleet(SimConfig(speedup=100, num_gpu_blocks=64), count=3) as fleet:
        info = fleet.describe()
        assert len({i["url"] for i in info}) == 3 and len({i["events_endpoint"] for i in info}) == 3
        assert len({s.engine.engine_id for s in fleet.servers}) == 3


def test_cli_fleet_serves_and_stops_on_sigterm() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    events = '{"enable_kv_cache_events": true, "endpoint": "tcp://[::ffff:127.0.0.1]:0", "replay_endpoint": "tcp://127.0.0.1:0"}'
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvswitch", "sim", "--count", "2", "--port", "0", "--speedup", "100",
         "--num-gpu-blocks", "65", "--max-model-len", "1024", "--kv-events-config", events],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        lines = [json.loads(proc.stdout.readline()) for _ in range(2)]
        assert [line["index"] for line in lines] == [0, 1]
        for line in lines:
            assert line["events_endpoint"].startswith("tcp://127.0.0.1:")
            req = urllib.request.Request(
                line["url"] + "/v1/completions",
                data=json.dumps({"prompt": "hello", "max_tokens": 2}).encode(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(req, timeout=10) as r:
                assert json.loads(r.read())["usage"]["completion_tokens"] == 2
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cli_rejects_bad_flag_with_exit_2() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-m", "kvswitch", "sim", "--role", "nope"], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=60)  # fmt: skip
    assert res.returncode == 2 and "--role" in res.stderr and "prefill" in res.stderr


@pytest.mark.parametrize(
    ("argv", "held", "said"),
    [
        (["--port", "{p}"], 0, "invalid --port = {p}: cannot listen on 127.0.0.1:{p} (Address already in use; port {p} "
         "is held by pid {pid} ("),
        (["--port", "{p}", "--count", "3"], 2, "invalid --port = {p}: engine 2 of --count 3 listens on --port + 2: "
         "cannot listen on 127.0.0.1:{h} (Address already in use; port {h} is held by pid {pid} ("),
        (["--host", "10.99.99.99", "--port", "{p}"], None, "invalid --host = '10.99.99.99': cannot listen there: "),
    ],
)  # fmt: skip
def test_an_address_it_cannot_listen_on_exits_2_naming_the_flag(
    argv: list[str], held: int | None, said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """It was "cannot listen: [Errno 98] ... address already in use", exit 1, naming no flag (ops
    audit); a fleet is refused before any of its engines starts."""
    port = free_ports(3)
    with socket.socket() as holder:
        if held is not None:
            holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            holder.bind(("127.0.0.1", port + held))
            holder.listen()
        assert run(parse(*(a.format(p=port) for a in argv))) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvswitch sim: " + said.format(p=port, h=port + (held or 0), pid=os.getpid())), err
    if held is not None:  # who holds it, then what to change: it was "(Address already in use)" alone
        assert re.search(r"\): choose another --port, or --port 0 for (a )?free ones?\n$", err), err


def test_single_engine_exits_1_when_it_crashes() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvswitch", "sim", "--port", "0", "--speedup", "100", "--num-gpu-blocks", "65",
         "--max-model-len", "1024", "--crash-after", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        url = json.loads(proc.stdout.readline())["url"]
        req = urllib.request.Request(url + "/v1/completions", data=b'{"prompt": "x"}',
                                     headers={"Content-Type": "application/json"})  # fmt: skip
        with pytest.raises(OSError):
            urllib.request.urlopen(req, timeout=10)
        assert proc.wait(timeout=15) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
