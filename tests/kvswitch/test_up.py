"""`kvswitch up` as a real process: servers come up healthy and nothing is left after SIGTERM."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from kvswitch.cluster import ClusterSpec, LocalCluster, _Child
from kvswitch.servers import EtcdServer, NatsServer, ServerError, free_port, free_ports
from kvswitch.up import _AGAIN, _HealthLog, _kill_everything, _spec, add_arguments
from protocol.timing import speed_profile


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True, check=False).stdout
    return [int(p) for p in out.split()]


def test_up_serves_healthy_servers_and_leaves_nothing_after_sigterm() -> None:
    nats_port, etcd_port = free_port(), free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvswitch", "up", "--nats-port", str(nats_port), "--etcd-port", str(etcd_port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        lines = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            lines.append(line)
            if line.startswith("health:") or not line:
                break
        out = "".join(lines)
        hint = proc.stdout.readline()  # bare `up` said nothing of how to add workers (ops audit)
        # An exit before the health line (a port another process took meanwhile) says why.
        said = hint or out + (proc.stderr.read() if proc.poll() is not None else "")  # type: ignore[union-attr]
        assert hint.startswith("kvswitch up: no workers") and "--agg N" in hint and "kvswitch shim" in hint, said
        assert f"nats://127.0.0.1:{nats_port}" in out
        assert f"http://127.0.0.1:{etcd_port}" in out
        assert "health: nats=ok etcd=ok" in out
        monitor = int(re.search(r"monitor http://127.0.0.1:(\d+)", out).group(1))  # type: ignore[union-attr]
        with urllib.request.urlopen(f"http://127.0.0.1:{etcd_port}/health", timeout=2) as r:
            assert json.loads(r.read())["health"] == "true"
        with urllib.request.urlopen(f"http://127.0.0.1:{monitor}/healthz", timeout=2) as r:
            assert json.loads(r.read())["status"] == "ok"
        servers = _children(proc.pid)
        assert len(servers) == 2

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
        assert "stopped" in proc.stderr.read()  # type: ignore[union-attr]
        time.sleep(0.2)
        assert not [p for p in servers if _alive(p)], "servers left behind"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_up_demo_exits_zero_when_healthy() -> None:
    # A free port: 8080, make demo's, may be another cluster's on a shared machine (refused now).
    argv = [sys.executable, "-m", "kvswitch", "up", "--demo", "--http-port", "0"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "health: nats=ok etcd=ok" in out.stdout


def test_servers_stop_by_pid_and_remove_their_store() -> None:
    nats, etcd = NatsServer().start(), EtcdServer().start()
    pids, dirs = [nats.pid, etcd.pid], [nats.workdir, etcd.workdir]
    assert nats.healthy() and etcd.healthy()
    nats.close()
    etcd.close()
    nats.close()  # twice is fine
    assert not any(_alive(p) for p in pids if p is not None)
    assert not any(d.exists() for d in dirs)


def test_port_in_use_is_reported_with_the_log() -> None:
    with NatsServer() as first:
        second = NatsServer(port=first.port)
        with pytest.raises(ServerError, match="nats exited"):
            second.start(timeout=10)
        second.close()


def _descendants(pid: int) -> list[int]:
    out = []
    for child in _children(pid):
        out += [child, *_descendants(child)]
    return out


def test_up_runs_a_whole_cluster_and_leaves_nothing_after_sigterm() -> None:
    http = free_ports(2)
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvswitch", "up", "--prefill", "1", "--decode", "2", "--routers", "2",
         "--speedup", "20", "--http-port", str(http), "--lora-modules", "sql=/adapters/sql",
         "--max-model-len", "4096", "--conditional-disagg", "--eff-isl-threshold", "512"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        out = ""
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and "health:" not in out:
            line = proc.stdout.readline()
            if not line:
                break
            out += line
        if "health:" not in out:
            proc.wait(30)
            pytest.fail(f"kvswitch up exited {proc.returncode}: {out}{proc.stderr.read()}")  # type: ignore[union-attr]
        assert "children=7/7 up" in out, out  # 2 sim fleets, 3 shims, 2 routers (servers counted apart)
        assert out.count("sim      ") == 3
        routers = re.findall(r"router   (http://127.0.0.1:\d+)/v1", out)
        assert routers == [f"http://127.0.0.1:{http}", f"http://127.0.0.1:{http + 1}"]
        for url, model in zip(routers, ("sim-llama", "sql"), strict=True):  # the model, and an adapter
            body = json.dumps({"model": model, "prompt": list(range(300, 400)), "max_tokens": 3}).encode()
            req = urllib.request.Request(
                url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(req, timeout=30) as r:
                reply = json.loads(r.read())
                assert reply["usage"]["completion_tokens"] == 3 and reply["model"] == model
                assert r.headers["x-kvswitch-prefill"] in ("bypass", "remote")
        # the engines run at --max-model-len: a prompt longer than that is vLLM's 400 naming it
        body = json.dumps({"model": "sim-llama", "prompt": [300] * 4097, "max_tokens": 3}).encode()
        req = urllib.request.Request(
            routers[0] + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(req, timeout=30)
        assert refused.value.code == 400 and "4096" in json.loads(refused.value.read())["error"]["message"]
        everything = _descendants(proc.pid)
        assert len(everything) >= 9  # nats, etcd, 2 sim fleets, 3 shims, 2 routers
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        time.sleep(0.3)
        assert not [p for p in everything if _alive(p)], "children left behind"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (
            ["--agg", "1", "--profile", "nope"],
            "kvswitch up: invalid --profile = 'nope': unknown timing profile 'nope'; known: h200:llama-3.1-8b",
        ),
        (["--agg", "1", "--model", " "], "kvswitch up: --model must name the served model"),
        (["--agg", "1", "--lora-modules", "sim-llama=/a"], "kvswitch up: invalid --lora-modules"),
        (["--agg", "1", "--lora-modules", "sql"], "kvswitch up: invalid --lora-modules"),
        (["--agg", "1", "--nats-port", "-1"], "kvswitch up: --nats-port must be in 0..65535"),
        (["--agg", "1", "--etcd-port", "70000"], "kvswitch up: --etcd-port must be in 0..65535"),
        (["--agg", "1", "--speedup", "inf"], "kvswitch up: --speedup must be a number in 0.001..1000000"),
        # review of 3a2a9c4: it came up, every time in the profile it registered infinite
        (["--agg", "1", "--speedup", "1e-320"], "kvswitch up: --speedup must be a number in 0.001..1000000"),
        (["--agg", "1", "--speedup", "2e6"], "(times the profile's speed), got 2000000.0"),
        (
            ["--agg", "1", "--max-model-len", "0"],
            "kvswitch up: invalid --max-model-len = 0: must be a positive integer",
        ),
        (["--agg", "1", "--max-model-len", "1000000"], "--max-model-len 1000000 does not fit one simulated engine's"),
        (["--agg", "1", "--log-dir", "/proc/nope"], "kvswitch up: --log-dir /proc/nope: cannot create it"),
        (["--agg", "1", "--nats-servers", "nats://127.0.0.1:1"], "kvswitch up: --nats-servers is set by kvswitch up"),
        (["--agg", "1", "--etcd-endpoints", "http://127.0.0.1:1"], "--etcd-endpoints is set by kvswitch up"),
        (["--agg", "1", "--http-host", "0.0.0.0"], "kvswitch up: --http-host is set by kvswitch up itself"),
        (["--agg", "1", "--namespace", "a.b"], "kvswitch up: --namespace must match [A-Za-z0-9_-]+, got 'a.b'"),
        (["--agg", "1", "--routers", "3", "--http-port", "65534"], "--http-port 65534 leaves no port for router 2"),
        # NATS started and died "invalid port 65536", exit 1; etcd was "not healthy" after 30 s
        (
            ["--nats-port", "65534", "--nats-nodes", "3"],
            "kvswitch up: --nats-port 65534 leaves no port for NATS node 2 of --nats-nodes 3 (NATS node i listens on "
            "--nats-port + i): at most 65533",
        ),
        (["--etcd-port", "65535", "--etcd-members", "3"], "--etcd-port 65535 leaves no port for etcd member 2"),
        # it started NATS and etcd, then failed drawing the sims' ports, naming no flag
        (
            ["--agg", "8000"],
            "kvswitch up: --agg 8000 --prefill 0 --decode 0 (3 ports per worker) and NATS and etcd (4 for --nats-nodes "
            "1",
        ),
        (["--agg", "1", "--disagg", "never", "--conditional-disagg"], "kvswitch up: invalid conditional_disagg"),
        # it came up healthy and aggregated every request without a word (config review of 2026-12-07, finding 6)
        (
            ["--agg", "1", "--disagg", "always"],
            "kvswitch up: invalid disagg (--disagg, KVSWITCH_DISAGG) = 'always': prefills every request remotely, "
            "and --prefill is 0: add --prefill P beside --decode D",
        ),
        (["--agg", "2", "--conditional-disagg"], "kvswitch up: invalid conditional_disagg (--conditional-disagg, "),
        (["--decode", "1", "--conditional-disagg"], "and --prefill is 0"),
        (
            ["--prefill", "1", "--decode", "1", "--disagg", "never"],
            "kvswitch up: --prefill 1: its prefill workers get no request under disagg=never (--disagg, "
            "KVSWITCH_DISAGG)",
        ),
        (
            ["--agg", "1", "--routers", "0", "--demo"],
            "kvswitch up: --demo sends its requests through a router: drop --routers 0 or --demo",
        ),
        (
            ["--decode-workers", "1"],
            "unrecognized arguments: --decode-workers 1: --decode-workers (did you mean --decode?) is neither",
        ),
        (  # a tie: it named --nats-port alone, by its spelling
            ["--port", "8000"],
            "--port (did you mean --etcd-port, --http-port or --nats-port?) is neither",
        ),
        (
            ["--agg", "1", "--routing", "nope"],
            "kvswitch up: invalid routing (--routing, KVSWITCH_ROUTING) = 'nope': allowed values: kv, round_robin, "
            "random, least_loaded (a router flag: see kvswitch router --help)",
        ),
        # it waited 120 s for /ready's "no decode or agg worker can take requests", then exited 1
        (["--prefill", "2"], "kvswitch up: --prefill 2 needs --decode or --agg: prefill workers serve no request"),
        (["--prefill", "1", "--routers", "2"], "--prefill 1 needs --decode or --agg"),
    ],
)
def test_a_bad_cluster_flag_is_refused_before_anything_starts(argv: list[str], said: str) -> None:
    """Before, each started NATS and etcd and failed in the first child that read the flag. Each is
    exit status 2, as argparse's own refusals (up's own were 1), and a router flag's refusal is one
    line (it printed the router's whole usage, 54 lines, first; ops audit); `--demo --routers 0`
    sent no request and exited 0."""
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "kvswitch", "up", *argv], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and said in out.stderr, out.stderr
    assert "usage: kvswitch up (router flags)" not in out.stderr, out.stderr
    assert "nats" not in out.stdout and time.monotonic() - started < 20
    assert "Traceback" not in out.stderr and "exited while waiting" not in out.stderr, out.stderr


def test_up_help_says_other_flags_go_to_every_router() -> None:
    out = subprocess.run([sys.executable, "-m", "kvswitch", "up", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "router flag, given to every router replica" in out.stdout, out.stdout
    said = " ".join(out.stdout.split())
    assert "kvswitch router --help" in said, out.stdout
    # its example was --agg 2 --conditional-disagg, which has no prefill worker to disaggregate to
    example = re.search(r"e\.g\. (kvswitch up [^)]*)\)", said)
    assert example is not None and example[1] == "kvswitch up --prefill 1 --decode 2 --conditional-disagg", said
    assert isinstance(_spec(_up_args(example[1].split()[2:])), ClusterSpec)


@pytest.mark.parametrize(
    ("env", "said"),
    [
        (
            {"KVSWITCH_LEASE_TTL": "1"},
            "kvswitch up: its agg shims: invalid lease_ttl (--lease-ttl, KVSWITCH_LEASE_TTL) = 1: must be in 2..",
        ),
        ({"KVSWITCH_ETCD_USER": "me"}, "etcd_user and etcd_password go together"),
        ({"KVSWITCH_DISAGG": "always"}, "kvswitch up: invalid disagg (--disagg, KVSWITCH_DISAGG) = 'always'"),
    ],
)
def test_a_child_setting_from_the_environment_is_refused_before_anything_starts(env: dict[str, str], said: str) -> None:
    """Config review of 2026-12-07, finding 2: a shim's setting its environment gave it wrong was
    refused by the shim only once NATS, etcd and the sims ran, and `kvswitch up` exited 1 with the
    shim's words in its log; a router setting in the environment was not checked at all without a
    router flag."""
    started = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "kvswitch", "up", "--agg", "1"],
        capture_output=True, text=True, timeout=60, env={**os.environ, **env},
    )  # fmt: skip
    assert out.returncode == 2 and said in out.stderr, out.stderr
    assert out.stderr.count("\n") == 1 and "nats" not in out.stdout and time.monotonic() - started < 20, out


def test_the_shims_listen_on_loopback_at_a_free_port_whatever_the_environment_says(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """KVSWITCH_HTTP_HOST and KVSWITCH_HTTP_PORT are the router's and the shim's alike: up gave its
    routers theirs as flags, its shims none, so each shim took the variables' (a shim listening on
    0.0.0.0 beside URLs all of 127.0.0.1; the routers' port too, a bind that failed)."""
    from kvswitch.cluster import shim_argv
    from worker_shim.cli import add_arguments as shim_arguments
    from worker_shim.cli import resolve_settings

    monkeypatch.setenv("KVSWITCH_HTTP_HOST", "0.0.0.0")
    monkeypatch.setenv("KVSWITCH_HTTP_PORT", "18181")
    parser = argparse.ArgumentParser()
    shim_arguments(parser)
    argv = shim_argv(ClusterSpec(agg=1), "agg", "http://127.0.0.1:1", "tcp://127.0.0.1:2", "tcp://127.0.0.1:3")
    shim, _, _ = resolve_settings(parser.parse_args(argv[1:]))
    assert (shim.http_host, shim.http_port) == ("127.0.0.1", 0)


@pytest.mark.parametrize("speedup", [1.0, 10.0, 2.5])
def test_the_shims_register_the_sims_profile_at_their_speedup(speedup: float) -> None:
    """Log audit: up's shims registered the profile's own times while the sims ran `--speedup` times
    faster, so every router fitted k_d = 1 / speedup (past its bound at 10x, said at WARNING) and
    predicted at the bound. The profile they register now reads as fast as the sims run."""
    from kvswitch.cluster import shim_argv
    from protocol.timing import TimingModel
    from worker_shim.cli import add_arguments as shim_arguments
    from worker_shim.cli import resolve_settings

    parser = argparse.ArgumentParser()
    shim_arguments(parser)
    spec = ClusterSpec(agg=1, speedup=speedup)
    argv = shim_argv(spec, "agg", "http://127.0.0.1:1", "tcp://127.0.0.1:2", "tcp://127.0.0.1:3")
    shim, _, _ = resolve_settings(parser.parse_args(argv[1:]))
    assert shim.timing_profile is not None
    plain, registered = TimingModel.for_profile(spec.profile), TimingModel.for_profile(shim.timing_profile)
    assert registered.prefill_time(4096, 0, budget=8192) == pytest.approx(
        plain.prefill_time(4096, 0, budget=8192) / speedup
    )
    assert registered.decode(32, 2048) == pytest.approx(plain.decode(32, 2048) / speedup)


def test_up_serves_with_the_http_port_variable_set_for_its_routers_and_shims() -> None:
    """Config review of 2026-12-07, finding 2: with KVSWITCH_HTTP_PORT set, every shim bound it (the
    second "address already in use", exit 2) after NATS, etcd and the sims had started; up exited 1."""
    env = {**os.environ, "KVSWITCH_HTTP_PORT": str(free_port())}
    out = subprocess.run(
        [sys.executable, "-m", "kvswitch", "up", "--agg", "2", "--http-port", "0", "--speedup", "20", "--demo"],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert out.returncode == 0 and "health: nats=ok etcd=ok children=4/4 up" in out.stdout, out.stdout + out.stderr


def test_the_longest_max_model_len_a_refusal_offers_is_accepted() -> None:
    """Review of 2026-12-06: `at most N` counted block 0, vLLM's null block, so N was refused too."""
    from kvswitch.up import UpFlagError, _max_model_len_args

    with pytest.raises(UpFlagError) as refused:
        _max_model_len_args(_up_args(["--agg", "1", "--max-model-len", "1000000"]))
    most = int(str(refused.value).rsplit("at most ", 1)[1])
    assert _max_model_len_args(_up_args(["--agg", "1", "--max-model-len", str(most)])) == ["--max-model-len", str(most)]


def test_a_profile_table_that_does_not_parse_is_refused_naming_its_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Until 2026-12-07 argparse's choices called it an invalid choice: a table that does not parse
    names no profile, and the file and the JSON error went unsaid."""
    from kvswitch.up import UpFlagError

    (tmp_path / "mygpu.json").write_text('{"models": [{"model": "m1",\n "prefill": [}')
    monkeypatch.setenv("KVSWITCH_PROFILE_DIR", str(tmp_path))
    with pytest.raises(UpFlagError) as refused:
        _spec(_up_args(["--agg", "1", "--profile", "mygpu:m1"]))
    said = str(refused.value)
    assert refused.value.code == 2 and said.startswith("kvswitch up: invalid --profile = 'mygpu:m1': "), said
    assert f"timing table {tmp_path / 'mygpu.json'}: cannot read it: Expecting value: line 2 column 14" in said, said


def test_a_profile_with_an_at_sign_in_its_name_runs_at_a_speedup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review of 3a2a9c4: the shims' `lab@h200:llama-3.1-8b@10x` was read as a speed-up of
    `lab@h200:llama-3.1-8b@10` and up refused its own --profile (`after '@' give the engine's speed-up`)."""
    from protocol.timing import TimingModel

    (tmp_path / "lab@h200.json").write_bytes((Path(__file__).parents[2] / "protocol/profiles/h200.json").read_bytes())
    monkeypatch.setenv("KVSWITCH_PROFILE_DIR", str(tmp_path))
    spec = _spec(_up_args(["--agg", "1", "--profile", "lab@h200:llama-3.1-8b", "--speedup", "10"]))
    registered = TimingModel.for_profile(speed_profile(spec.profile, spec.speedup))
    plain = TimingModel.for_profile("h200:llama-3.1-8b")
    assert registered.decode(32, 2048) == pytest.approx(plain.decode(32, 2048) / 10)


def _up_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args, extra = parser.parse_known_args(argv)
    args.extra = extra
    return args


@pytest.mark.parametrize(
    ("env", "secure"),
    [
        ({"KVSWITCH_NATS_SERVERS": "nats-0.prod:4222"}, False),  # left over for another cluster, no scheme
        ({"KVSWITCH_ETCD_ENDPOINTS": "etcd-0.prod:2379"}, False),
        ({"KVSWITCH_ETCD_USER": "me"}, True),  # no password: the routers get both from up
        ({"KVSWITCH_NATS_TLS_CA": "/nope/ca.pem", "KVSWITCH_ETCD_TLS_CA": "/nope/ca.pem"}, True),
        ({"KVSWITCH_NATS_NKEY_FILE": "/nope/seed"}, True),
    ],
)
def test_the_router_flag_check_ignores_connection_env_the_routers_get_as_flags(
    env: dict[str, str], secure: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The routers get the cluster's NATS and etcd as flags (with --secure its CA, an nkey seed and
    an etcd user too), which win over these variables: `up --routing random` was refused, blaming
    --nats-servers, where `up` alone started (review1 D3)."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    spec = _spec(_up_args(["--agg", "1", "--routing", "random", *(["--secure"] if secure else [])]))
    assert spec.router_args == ["--routing", "random"]


def test_the_router_flag_check_still_refuses_connection_env_the_routers_inherit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Without --secure no etcd user is given: the routers would read this one, and fail on it.
    monkeypatch.setenv("KVSWITCH_ETCD_USER", "me")
    with pytest.raises(SystemExit, match=r"kvswitch up: invalid etcd_user .*etcd_user and etcd_password go together"):
        _spec(_up_args(["--agg", "1", "--routing", "random"]))


@pytest.mark.parametrize("given", ["flag", "env", "file"])
def test_secure_refuses_a_router_request_timeout_at_its_response_ttl(
    given: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """--secure writes a worker's reply permission for 900 s: a router deadline at or above it had
    nats-server refuse the replies of a request running that long, the request failing (however
    the router is given its --request-timeout)."""
    argv = ["--agg", "1", "--secure"]
    if given == "flag":
        argv += ["--request-timeout", "900"]
    elif given == "env":
        monkeypatch.setenv("KVSWITCH_REQUEST_TIMEOUT", "900")
    else:
        (tmp_path / "router.toml").write_text("request_timeout = 900.0\n")
        argv += ["--config", str(tmp_path / "router.toml")]
    with pytest.raises(SystemExit) as refused:
        _spec(_up_args(argv))
    assert refused.value.code == 2
    message = str(refused.value)
    assert "request_timeout (--request-timeout, KVSWITCH_REQUEST_TIMEOUT) = 900.0" in message
    assert "< 900 s with --secure" in message and "kvswitch secrets --response-ttl" in message
    # Below the TTL, or without --secure (no reply permission), it is taken.
    monkeypatch.setenv("KVSWITCH_REQUEST_TIMEOUT", "899")
    assert _spec(_up_args(["--agg", "1", "--secure"])).routers == 1
    monkeypatch.setenv("KVSWITCH_REQUEST_TIMEOUT", "900")
    assert _spec(_up_args(["--agg", "1"])).routers == 1


def test_up_hears_sigterm_while_it_starts_and_leaves_nothing() -> None:
    # Starting ran on the event loop's thread, so a SIGTERM then waited for the whole cluster to be
    # up (minutes at worst), and a second one left its directories behind.
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvswitch", "up", "--agg", "2", "--speedup", "20", "--http-port", str(free_port())],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not any("nats-server" in _cmdline(p) for p in _descendants(proc.pid)):
            assert proc.poll() is None and time.monotonic() < deadline, "kvswitch up never started nats"
            time.sleep(0.05)
        everything = _descendants(proc.pid)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert "health:" not in out and "kvswitch up: stopped" in err, (out, err)
        time.sleep(0.3)
        assert not [p for p in everything + _descendants(proc.pid) if _alive(p)], "children left behind"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_stop_of_an_abandoned_start_says_each_tier_with_what_a_second_signal_does(tmp_path: Path) -> None:
    # The start stopped what it had started itself, without up's `again`: a SIGTERM while the sims
    # booted said "stopping 1 sim (draining up to 35s, then killed)", no word of what a second
    # signal does, and a child it killed was counted nowhere (review of 2026-12-07).
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvswitch", "up", "--agg", "2", "--speedup", "20", "--http-port", str(free_port())],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "TMPDIR": str(tmp_path)},
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not any(" kvswitch sim " in _cmdline(p) for p in _descendants(proc.pid)):
            assert proc.poll() is None and time.monotonic() < deadline, "kvswitch up never started its sims"
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0 and "health:" not in out, (out, err)
        tiers = [line for line in err.splitlines() if "kvswitch.cluster: stopping" in line]
        assert any("stopping 1 sim " in line for line in tiers), err
        assert all(line.endswith(f"then killed{_AGAIN})") for line in tiers), err
        assert err.endswith("kvswitch up: stopped\n"), err
        assert list(tmp_path.iterdir()) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _start_up(argv: list[str], env: dict[str, str] | None = None) -> tuple[subprocess.Popen[str], str]:
    """`kvswitch up` in a session of its own (a signal to its process group reaches no test runner),
    and what it printed up to its health line."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvswitch", "up", *argv],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        env={**os.environ, **(env or {})},
    )  # fmt: skip
    assert proc.stdout is not None
    out = ""
    while "health:" not in out:
        line = proc.stdout.readline()
        if not line:
            proc.kill()
            pytest.fail(f"kvswitch up exited: {out}{proc.communicate(timeout=30)[1]}")
        out += line
    return proc, out


def _stream(url: str, max_tokens: int, events: list[bytes]) -> threading.Thread:
    """A streamed completion read on a thread into `events` (its `data:` lines), until it ends or is cut."""
    body = {"model": "sim-llama", "prompt": list(range(500, 600)), "max_tokens": max_tokens, "stream": True}
    req = urllib.request.Request(
        url + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )

    def read() -> None:
        with contextlib.suppress(OSError), urllib.request.urlopen(req, timeout=60) as r:
            events.extend(line.strip() for line in r if line.startswith(b"data:"))

    reading = threading.Thread(target=read)
    reading.start()
    deadline = time.monotonic() + 30
    while len(events) < 5:
        assert time.monotonic() < deadline and reading.is_alive(), events
        time.sleep(0.01)
    return reading


def test_ctrl_c_reaches_up_alone_which_stops_its_children_in_tiers(tmp_path: Path) -> None:
    # A terminal's Ctrl-C is SIGINT to its whole foreground process group. The children were in
    # up's: the sim went at once and cut the stream (no [DONE]), and up's tiered SIGTERM then
    # reached a router and a shim already draining, which exited at once ("second SIGTERM").
    http = free_port()
    proc, _ = _start_up(["--agg", "1", "--http-port", str(http), "--log-dir", str(tmp_path)])
    try:
        everything = _descendants(proc.pid)
        events: list[bytes] = []
        reading = _stream(f"http://127.0.0.1:{http}", 300, events)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        reading.join(30)
        assert proc.returncode == 0 and "SIGINT: draining" in err, err
        assert events[-1] == b"data: [DONE]" and len(events) == 301, events[-3:]
        logs = {p.name: p.read_text(errors="replace") for p in tmp_path.glob("*.log")}
        del logs["nats-0.log"], logs["etcd-0.log"]  # the servers' output is there too
        assert len(logs) == 3  # the sim fleet, the shim, the router
        for name, text in logs.items():
            assert "SIGTERM: draining" in text and "SIGINT" not in text and "exiting now" not in text, (name, text)
        time.sleep(0.3)
        assert not [p for p in everything if _alive(p)], "children left behind"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_second_sigterm_while_up_drains_leaves_nothing(tmp_path: Path) -> None:
    # The second signal exits at once (os._exit), past the cleanup in up's finally: the cluster's,
    # etcd's and nats' directories were left in TMPDIR.
    http = free_port()
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc, _ = _start_up(["--agg", "1", "--http-port", str(http)], env={"TMPDIR": str(tmp)})
    try:
        everything = _descendants(proc.pid)
        assert len(list(tmp.iterdir())) == 3, list(tmp.iterdir())  # kvswitch-{nats,etcd,cluster}-*
        reading = _stream(f"http://127.0.0.1:{http}", 2000, [])  # the router drains it
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        reading.join(30)
        assert proc.returncode == 130 and "second SIGTERM: exiting now" in err, err
        # Each tier is said as its stop starts, and what the second signal does (review of 2026-12-07:
        # 35 s of silence a tier, so an operator pressed Ctrl-C again without knowing what it would cut).
        assert (
            "INFO kvswitch.cluster: stopping 1 router (draining up to 35s, then killed; a second SIGTERM or Ctrl-C "
            "kills everything now)\n" in err
        ), err
        killing = "kvswitch.cluster: killing 3 children, nats and etcd now: requests and streams in flight are cut\n"
        assert killing in err, err
        assert list(tmp.iterdir()) == []
        time.sleep(0.3)
        assert not [p for p in everything if _alive(p)], "children left behind"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_during_the_flag_checks_stops_up_and_leaves_no_secret_behind(
    tmp_path: Path, sig: signal.Signals
) -> None:
    # The checks write a CA and an nkey seed (--secure) into a directory of their own, before
    # run_service handled signals: a SIGTERM then killed up outright (status -15), the directory
    # left in TMPDIR; a Ctrl-C was a traceback (review of 2026-12-07).
    argv = [sys.executable, "-m", "kvswitch", "up", "--secure", "--agg", "1", "--http-port", "0"]
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not any(p.name.startswith("kvswitch-up-check-") for p in tmp_path.iterdir()):
            assert proc.poll() is None and time.monotonic() < deadline, "the checks never made their directory"
            time.sleep(0.002)
        proc.send_signal(sig)
        proc.send_signal(sig)  # a second one while the checks run changes nothing
        out, err = proc.communicate(timeout=60)
        assert (proc.returncode, out, err) == (
            0,
            "",
            f"kvswitch up: {sig.name} during its checks: stopped before anything started\n",
        )
        assert list(tmp_path.iterdir()) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_up_started_with_the_stop_signals_blocked_stops_on_sigterm(tmp_path: Path) -> None:
    """A parent may pass its children a mask with SIGTERM blocked: run_service lets the stop signals
    through once it handles them, and up re-applied its starting mask after that (review of
    5cc64ab): SIGTERM stayed blocked and up ran on."""
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})  # the child inherits it
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvswitch", "up", "--agg", "1", "--routers", "0"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
            env={**os.environ, "TMPDIR": str(tmp_path)},
        )  # fmt: skip
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    try:
        assert proc.stdout is not None
        out = ""
        while "health:" not in out:
            line = proc.stdout.readline()
            assert line, f"kvswitch up exited: {out}{proc.communicate(timeout=30)[1]}"
            out += line
        status = Path(f"/proc/{proc.pid}/status").read_text()
        blocked = int(next(row.split()[1] for row in status.splitlines() if row.startswith("SigBlk:")), 16)
        assert not blocked & (1 << (signal.SIGTERM - 1)), "SIGTERM blocked while up serves"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0 and "kvswitch up: stopped" in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_killed_up_takes_its_children_down(tmp_path: Path) -> None:
    # Its children run in sessions of their own (a Ctrl-C is for up alone): PR_SET_PDEATHSIG, not
    # the process group, is what takes them down when up is killed outright.
    proc, _ = _start_up(["--agg", "1", "--routers", "0"], env={"TMPDIR": str(tmp_path)})
    everything = _descendants(proc.pid)
    assert len(everything) == 4  # nats, etcd, the sim fleet, the shim
    proc.kill()
    proc.communicate(timeout=10)
    deadline = time.monotonic() + 30
    while [p for p in everything if _alive(p)]:
        assert time.monotonic() < deadline, "children left behind"
        time.sleep(0.05)


def test_a_child_that_dies_is_said_once_with_its_status_and_last_words(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The same "unhealthy: ... dead=shim-agg-17338" ERROR came every 5 s, never saying why it died.
    cluster = LocalCluster(ClusterSpec())  # no servers: nats and etcd DOWN, as far as health goes
    log = tmp_path / "shim-agg-1.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", "print('engine gone'); raise SystemExit(3)"], stdout=out)
    proc.wait(30)
    cluster.children.append(_Child("shim-agg-1", "shim", proc, log))
    now = 0.0
    health = _HealthLog(cluster, "health: nats=ok etcd=ok children=1/1 up", clock=lambda: now)
    said: list[str] = []
    with caplog.at_level(logging.INFO, logger="kvswitch.up"):
        for now in range(5, 65, 5):  # every 5 s for a minute
            health.check()
            said += [f"{now}: {r.getMessage()}" for r in caplog.records]
            caplog.clear()
        monkeypatch.setattr(cluster, "health", lambda: ("health: nats=ok etcd=ok children=1/1 up", True))
        health.check()
        said += [r.getMessage() for r in caplog.records]
    line = "health: nats=DOWN etcd=DOWN children=0/1 up dead=shim-agg-1"
    assert said == [
        "5: child exited: shim-agg-1 (status 3; its last output:\n    engine gone)",
        f"5: unhealthy: {line}",
        f"35: still unhealthy (6 checks in 30s): {line}",
        "healthy again: health: nats=ok etcd=ok children=1/1 up",
    ]


def test_secure_with_no_workers_prints_a_router_and_a_shim_line_whose_credentials_work(tmp_path: Path) -> None:
    # `kvswitch up --secure` alone told the operator to start a router and a shim against its NATS and
    # etcd, but gave no credentials: a router started by hand was refused ("invalid etcd_user
    # (--etcd-user ...) = None: etcd ... has authentication on"). Now it prints each one's command
    # line, its etcd password in a --config file, never on the line (audit, 2026-12-07).
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    up = subprocess.Popen(
        [sys.executable, "-m", "kvswitch", "up", "--secure"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, env=env,
    )  # fmt: skip
    router: subprocess.Popen[str] | None = None
    try:
        assert up.stdout is not None
        out = ""
        while "Ctrl-C" not in out:
            line = up.stdout.readline()
            assert line, f"kvswitch up exited: {out}{up.communicate(timeout=30)[1]}"
            out += line
        lines = {
            argv[1]: argv for argv in (shlex.split(row) for row in out.splitlines() if row.startswith("  kvswitch "))
        }
        assert sorted(lines) == ["router", "shim"], out
        shim = lines["shim"]
        assert shim[shim.index("--worker-name") + 1] == "worker-0", shim
        secrets_dir = Path(lines["router"][lines["router"].index("--config") + 1]).parent
        assert secrets_dir.stat().st_mode & 0o777 == 0o700
        for argv in lines.values():
            for flag in ("--config", "--nats-nkey-file"):
                assert Path(argv[argv.index(flag) + 1]).stat().st_mode & 0o777 == 0o600, argv
        for role in ("router", "worker"):
            password = yaml.safe_load((secrets_dir / f"{role}-etcd.yaml").read_text())["etcd_password"]
            assert password not in out
        log = tmp_path / "router.log"
        with log.open("w") as sink:
            router = subprocess.Popen(
                [sys.executable, "-m", "kvswitch", *lines["router"][1:], "--http-port", "0"],
                stdout=sink, stderr=subprocess.STDOUT, text=True, start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + 60
        while " serving http://" not in log.read_text():
            assert router.poll() is None, f"the router exited: {log.read_text()}"
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        router.send_signal(signal.SIGTERM)
        assert router.wait(timeout=60) == 0, log.read_text()
        up.send_signal(signal.SIGTERM)
        _, err = up.communicate(timeout=60)
        assert up.returncode == 0 and "kvswitch up: stopped" in err, err
        assert not secrets_dir.exists()  # removed on stop, as the CA's
    finally:
        for proc in (router, up):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


def test_secure_with_no_workers_carries_the_router_flags_and_a_copy_of_its_config_into_the_router_line(
    tmp_path: Path,
) -> None:
    # The router flags given to up were checked, then dropped from the printed router line: a user's
    # `--config mine.yaml` was silently replaced by the credentials file (review, 2026-12-07).
    mine = tmp_path / "mine.yaml"
    mine.write_text("max_body_bytes: 1048576\n")
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    up = subprocess.Popen(
        [sys.executable, "-m", "kvswitch", "up", "--secure", "--config", str(mine), "--request-timeout", "120"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, env=env,
    )  # fmt: skip
    router: subprocess.Popen[str] | None = None
    try:
        assert up.stdout is not None
        out = ""
        while "Ctrl-C" not in out:
            line = up.stdout.readline()
            assert line, f"kvswitch up exited: {out}{up.communicate(timeout=30)[1]}"
            out += line
        argv = next(shlex.split(row) for row in out.splitlines() if row.startswith("  kvswitch router "))
        assert argv[argv.index("--request-timeout") + 1] == "120", argv
        assert argv.count("--config") == 1 and str(mine) not in argv, argv
        copy = Path(argv[argv.index("--config") + 1])
        assert copy.stat().st_mode & 0o777 == 0o600
        settings = yaml.safe_load(copy.read_text())
        assert settings.pop("etcd_user") == "router" and settings.pop("etcd_password") not in out
        assert settings == {"max_body_bytes": 1048576}
        shim = next(shlex.split(row) for row in out.splitlines() if row.startswith("  kvswitch shim "))
        worker = yaml.safe_load(Path(shim[shim.index("--config") + 1]).read_text())
        assert set(worker) == {"etcd_user", "etcd_password"}, worker  # the router's settings are not the shim's
        log = tmp_path / "router.log"
        with log.open("w") as sink:
            router = subprocess.Popen(
                [sys.executable, "-m", "kvswitch", *argv[1:], "--http-port", "0"],
                stdout=sink, stderr=subprocess.STDOUT, text=True, start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + 60
        while " serving http://" not in log.read_text():
            assert router.poll() is None, f"the router exited: {log.read_text()}"
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        router.send_signal(signal.SIGTERM)
        assert router.wait(timeout=60) == 0, log.read_text()
        up.send_signal(signal.SIGTERM)
        up.communicate(timeout=60)
        assert up.returncode == 0 and not copy.exists()
    finally:
        for proc in (router, up):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


def test_secure_with_no_workers_copies_the_router_config_as_checked_though_the_file_is_gone_by_then(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The router's --config was read again for its copy after NATS and etcd had started: a file removed
    # (or half-saved) meanwhile ended `kvswitch up` in a ConfigError traceback (review, 2026-12-07).
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    mine = tmp_path / "mine.yaml"
    mine.write_text("max_body_bytes: 1048576\n")
    spec = _spec(_up_args(["--secure", "--config", str(mine)]))
    mine.unlink()
    cluster = LocalCluster(spec)
    try:
        cluster.start()
        argv = next(shlex.split(line) for line in cluster.own_commands() if line.startswith("kvswitch router "))
        settings = yaml.safe_load(Path(argv[argv.index("--config") + 1]).read_text())
        assert settings.pop("etcd_user") == "router" and settings.pop("etcd_password")
        assert settings == {"max_body_bytes": 1048576}
    finally:
        cluster.stop()


def test_a_second_signal_removes_the_tls_directory_even_when_the_kill_fails(tmp_path: Path) -> None:
    # up's abort removed the TLS directory (its CA key) only after cluster.kill() returned: a kill
    # that raised (EBADF, racing the stop's cleanup on its thread) left it in $TMPDIR.
    tls = tmp_path / "kvswitch-tls-x"
    tls.mkdir()
    (tls / "ca.key").write_text("secret")

    class Failing(LocalCluster):
        def kill(self) -> None:
            raise OSError(9, "Bad file descriptor")

    with pytest.raises(OSError, match="Bad file descriptor"):
        _kill_everything(Failing(ClusterSpec()), str(tls))
    assert not tls.exists()
