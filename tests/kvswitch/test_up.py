"""`kvswitch up` as a real process: servers come up healthy and nothing is left after SIGTERM."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from kvswitch.servers import EtcdServer, NatsServer, ServerError, free_port, free_ports


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
    out = subprocess.run([sys.executable, "-m", "kvswitch", "up", "--demo"], capture_output=True, text=True, timeout=60)
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
         "--conditional-disagg", "--eff-isl-threshold", "512"],
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
            "kvswitch up: error: argument --profile: invalid choice: 'nope'",
        ),
        (["--agg", "1", "--model", " "], "kvswitch up: --model must name the served model"),
        (["--agg", "1", "--lora-modules", "sim-llama=/a"], "kvswitch up: invalid --lora-modules"),
        (["--agg", "1", "--lora-modules", "sql"], "kvswitch up: invalid --lora-modules"),
        (["--agg", "1", "--nats-port", "-1"], "kvswitch up: --nats-port must be in 0..65535"),
        (["--agg", "1", "--etcd-port", "70000"], "kvswitch up: --etcd-port must be in 0..65535"),
        (["--agg", "1", "--speedup", "inf"], "kvswitch up: --speedup must be a finite number > 0"),
    ],
)
def test_a_bad_cluster_flag_is_refused_before_anything_starts(argv: list[str], said: str) -> None:
    """Before, each started NATS and etcd and failed in the first child that read the flag."""
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "kvswitch", "up", *argv], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and said in out.stderr, out.stderr
    assert "nats" not in out.stdout and time.monotonic() - started < 20


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


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
