"""`kvswitch sim`: configs a fleet or ZMQ would fail on are refused at startup in one line, naming the flag."""

from __future__ import annotations

import argparse
import errno
import json
import os
import socket
from pathlib import Path

import pytest

from engine_sim import KVEventsConfig, SimConfig, SimConfigError, SimFleet, fleet_config
from engine_sim.cli import _listen_refused, add_arguments, config_from_args, run
from protocol import errors


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvswitch sim")
    add_arguments(parser)
    return parser.parse_args(list(argv))


def _events(**keys: object) -> str:
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", **keys})


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (["--port", "65535", "--count", "3"], ["--count = 3", "--port 65537", "[0, 65535]"]),
        (["--port", "0", "--count", "3", "--kv-events-config", _events(endpoint="tcp://*:65534")],
         ["--count = 3", "--kv-events-config endpoint 'tcp://*:65536'"]),
    ],
)  # fmt: skip
def test_a_fleet_whose_last_engine_has_no_port_is_refused(
    argv: list[str], needles: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(parse(*argv)) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert all(n in err for n in needles), err


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        # engine_sim.md's first example, counted: engine 1's events port is engine 0's replay port
        (["--port", "0", "--count", "64", "--kv-events-config",
          _events(endpoint="tcp://*:5557", replay_endpoint="tcp://*:5558")],
         ["--count = 64", "engine 0's --kv-events-config's replay_endpoint",
          "engine 1's --kv-events-config's endpoint", "port 5558", "at least --count (64) apart"]),
        (["--port", "8000", "--count", "3", "--kv-events-config", _events(endpoint="tcp://*:8002")],
         ["engine 2's --port", "engine 0's --kv-events-config's endpoint", "port 8002"]),
    ],
)  # fmt: skip
def test_a_fleet_whose_engines_would_share_a_port_is_refused(
    argv: list[str], needles: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(parse(*argv)) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert all(n in err for n in needles), err


@pytest.mark.parametrize(
    ("argv", "events"),
    [
        (["--port", "8000", "--count", "64"], {"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5621"}),
        # a PUB that connects elsewhere binds nothing here (review of 6e8b7c5)
        (["--port", "0", "--count", "2"], {"endpoint": "tcp://10.0.0.5:5557", "replay_endpoint": "tcp://*:5558"}),
        (["--port", "8000", "--count", "4"], {"endpoint": "tcp://10.0.0.5:8002"}),
        (["--port", "0", "--count", "4"], {"endpoint": "ipc:///tmp/ev", "replay_endpoint": "tcp://*:0"}),
    ],
)
def test_a_fleets_ports_that_no_two_engines_share_are_accepted(argv: list[str], events: dict[str, str]) -> None:
    config = config_from_args(parse(*argv, "--kv-events-config", _events(**events)))
    assert config.kv_events.endpoint == events["endpoint"]


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "0.0.0.0"])
def test_a_fleet_whose_pub_connects_to_a_local_subscriber_on_its_own_ports_is_refused(
    host: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # a subscriber of tcp://0.0.0.0:P binds P here (the shim does), as one of 127.0.0.1:P does
    events = _events(endpoint=f"tcp://{host}:5557", replay_endpoint="tcp://*:5558")
    assert run(parse("--port", "0", "--count", "2", "--kv-events-config", events)) == 2
    assert "both port 5558" in capsys.readouterr().err


async def test_a_fleet_given_zmqs_wildcard_port_gives_each_engine_its_own_free_port() -> None:
    # As port 0 does; engine 1 got 'tcp://127.0.0.1:*-1' and --count 2 was refused (review1 D5).
    wild = _events(endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")
    config = config_from_args(parse("--port", "0", "--count", "2", "--kv-events-config", wild))
    ev = fleet_config(config, 1).kv_events
    assert (ev.endpoint, ev.replay_endpoint) == ("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    async with SimFleet(config, count=2) as fleet:
        bound = [(s.events_endpoint, s.replay_endpoint) for s in fleet.servers]
    ports = {e.rsplit(":", 1)[1] for pair in bound for e in pair if e is not None}
    assert len(ports) == 4 and all(p.isdigit() for p in ports), bound


@pytest.mark.parametrize(
    ("keys", "needle"),
    [
        ({"endpoint": "bogus"}, "endpoint 'bogus': must be tcp://HOST:PORT"),
        ({"endpoint": "tcp://127.0.0.1"}, "endpoint 'tcp://127.0.0.1': a tcp:// endpoint needs HOST:PORT"),
        ({"endpoint": "tcp://127.0.0.1:70000"}, "PORT in [0, 65535]"),
        ({"replay_endpoint": "udp://x:1"}, "replay_endpoint 'udp://x:1'"),
        # The shim refused these, the sim took them: one split of an endpoint, in protocol/.
        ({"replay_endpoint": "tcp://[::1:5558"}, "replay_endpoint 'tcp://[::1:5558': a tcp:// endpoint needs"),
        ({"endpoint": "tcp://[]:5557"}, "endpoint 'tcp://[]:5557': a tcp:// endpoint needs"),
        # vLLM's PUB sets no zmq.IPV6: its bind fails with "No such device" at startup.
        ({"endpoint": "tcp://[::1]:5557"}, "endpoint 'tcp://[::1]:5557': vLLM's publisher opens no IPv6 address"),
        ({"replay_endpoint": "tcp://[::]:0"}, "replay_endpoint 'tcp://[::]:0': vLLM's publisher opens no IPv6"),
        ({"hwm": -1}, "hwm must be >= 0"),
        ({"buffer_steps": -1}, "buffer_steps must be >= 0"),
    ],
)
def test_a_kv_events_config_zmq_would_refuse_exits_2_naming_the_key(
    keys: dict[str, object], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        parse("--port", "0", "--kv-events-config", _events(**keys))
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--kv-events-config" in err and needle in err and "Traceback" not in err


def test_an_inactive_kv_events_config_is_not_checked_as_vllm_never_opens_it() -> None:
    assert not KVEventsConfig.from_json('{"enable_kv_cache_events": false, "endpoint": "bogus"}').active
    bad = KVEventsConfig(enable_kv_cache_events=True, endpoint="bogus")
    with pytest.raises(SimConfigError, match="--kv-events-config"):
        SimConfig(kv_events=bad).validate()


def test_an_events_endpoint_that_cannot_be_bound_is_one_line_not_a_traceback(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # 192.0.2.1 (TEST-NET-1) is no address of this host: the bind fails in ZMQ
    assert run(parse("--port", "0", "--kv-events-config", _events(endpoint="tcp://192.0.2.1:*"))) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "--kv-events-config: cannot bind or connect" in err


@pytest.mark.parametrize("key", ["endpoint", "replay_endpoint"])
def test_an_event_port_another_process_listens_on_is_named_with_its_holder(
    key: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # ZMQ's "Address already in use" named neither the port nor who held it
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        endpoints = {"endpoint": "tcp://*:0", key: f"tcp://*:{port}"}
        assert run(parse("--port", "0", "--kv-events-config", _events(**endpoints))) == 2
    out, err = capsys.readouterr()
    assert err == (
        f"kvswitch sim: invalid --kv-events-config = 'tcp://*:{port}': it binds {key}: cannot bind port {port} "
        f"(Address already in use; port {port} is held by pid {os.getpid()} ({_cmdline()})): give its endpoint and "
        "replay_endpoint other ports\n"
    ), err
    assert not out  # refused before any engine started


def test_a_fleets_event_port_held_is_refused_before_any_engine_starts_naming_that_port_alone(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The ports were looked up after engine 0 had started and been stopped: ZMQ still closed engine
    # 0's in the background, so they were often named too, held by "a process this user cannot see".
    with _listening_after_a_free_port() as holder:
        port = holder.getsockname()[1]
        kv = _events(endpoint="tcp://*:0", replay_endpoint=f"tcp://127.0.0.1:{port - 1}")
        assert run(parse("--port", "0", "--count", "2", "--kv-events-config", kv)) == 2
    out, err = capsys.readouterr()
    assert err == (
        f"kvswitch sim: invalid --kv-events-config = 'tcp://127.0.0.1:{port - 1}': engine 1 of --count 2 binds "
        f"replay_endpoint + 1: cannot bind port {port} (Address already in use; port {port} is held by pid "
        f"{os.getpid()} ({_cmdline()})): give its endpoint and replay_endpoint other ports\n"
    ), err
    assert not out


def _listening_after_a_free_port() -> socket.socket:
    """A socket listening on a loopback port whose port - 1 was free (engine 0's replay port)."""
    for _ in range(20):
        with socket.socket() as free:
            free.bind(("127.0.0.1", 0))
            port = free.getsockname()[1] + 1
        holder = socket.socket()
        try:
            holder.bind(("127.0.0.1", port))
        except OSError:
            holder.close()
            continue
        holder.listen()
        return holder
    raise AssertionError("no two consecutive free loopback ports")


def _cmdline() -> str:
    return Path("/proc/self/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()[:200]


_MODEL = {
    "model": "m",
    "kv_bytes_per_token_bf16": 131072,
    "prefill": [{"new_tokens": n, "cached_tokens": 0, "seconds": n / 1e5} for n in (128, 1024)],
    "decode": [{"batch": b, "context_tokens": 1024, "seconds": 0.01 * b} for b in (1, 8)],
}


@pytest.mark.parametrize(
    ("table", "said"),
    [
        ('{"models": [{"model": "m",\n "prefill": [}', "cannot read it: Expecting value: line 2 column 14"),
        (json.dumps({"models": [{k: v for k, v in _MODEL.items() if k != "decode"}]}), "model 'm': missing `decode`"),
        (json.dumps({"models": [{**_MODEL, "kv_bytes_per_token_bf16": "big"}]}), "`kv_bytes_per_token_bf16` must be"),
        (json.dumps({"model": [_MODEL]}), "not a JSON object with a `models` list of objects"),
    ],
    ids=["json", "missing", "typed", "no-models"],
)  # fmt: skip
def test_a_faulty_operator_profile_exits_2_naming_its_file_and_fault(
    table: str, said: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Until 2026-12-07 every fault of an operator's table was an unknown name: argparse's "invalid
    choice" for a table that does not parse, "allowed values: faulty:m, ..." (the name refused among
    them) for a model in it that does not load."""
    (tmp_path / "faulty.json").write_text(table)
    monkeypatch.setenv("KVSWITCH_PROFILE_DIR", str(tmp_path))
    assert run(parse("--profile", "faulty:m")) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "invalid --profile = 'faulty:m'" in err and str(tmp_path / "faulty.json") in err and said in err, err
    with pytest.raises(SimConfigError) as caught:
        SimConfig(profile="faulty:m").validate()
    assert caught.value.setting == "profile" and said in str(caught.value)


def test_a_sound_operator_profile_is_taken(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "sound.json").write_text(json.dumps({"models": [_MODEL]}))
    monkeypatch.setenv("KVSWITCH_PROFILE_DIR", str(tmp_path))
    assert config_from_args(parse("--profile", "sound:m")).kv_bytes_per_token == 131072


def test_an_unknown_profile_exits_2_naming_the_known_ones(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(parse("--profile", "h100:llama")) == 2
    err = capsys.readouterr().err
    assert "invalid --profile = 'h100:llama': unknown timing profile 'h100:llama'; known: " in err, err
    assert "h200:llama-3.1-8b" in err


_IN_USE = OSError(errno.EADDRINUSE, "Address already in use")
_NOT_HERE = OSError(errno.EADDRNOTAVAIL, "Cannot assign requested address")


@pytest.mark.parametrize(("exc", "looks"), [(_IN_USE, 1), (_NOT_HERE, 0)])
def test_a_failed_listen_looks_for_the_ports_holder_once_and_only_for_a_port_in_use(
    exc: OSError, looks: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The sim built the HTTP server's whole refusal (its /proc search too) only to read which flag it
    # named, then searched again for its own words.
    calls: list[int] = []

    def held_by(port: int) -> str:
        calls.append(port)
        return ""

    monkeypatch.setattr(errors, "held_by", held_by)
    refused = _listen_refused(config_from_args(parse("--port", "9000")), 1, 0, exc)
    assert refused.setting == ("port" if looks else "host") and calls == [9000] * looks
