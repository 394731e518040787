"""Profiles: collapsed stacks parsed, samples charged to the right category, and a recording that
stops its samplers with SIGINT (a stand-in for py-spy that writes its file on SIGINT, as py-spy does)."""

from __future__ import annotations

import os
import signal
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.flame import IDLE, ROUTER_RULES, SHIM_RULES, Recording, Rules, breakdown, format_breakdown, read_stacks

ROOT = "run (router/cli.py:141);run_service (runtime/__init__.py:84);run (uvloop/__init__.py:92)"
HANDLER = (
    f"{ROOT};RequestHandler._handle_request (aiohttp/web_protocol.py:577);_Handlers._generate (router/http_api.py:366)"
)


def test_collapsed_stacks_parse_root_first_with_their_counts() -> None:
    lines = ["a (x.py:1);b (y.py:2) 12\n", "\n", " 3\n"]
    assert list(read_stacks(lines)) == [(["a (x.py:1)", "b (y.py:2)"], 12), ([], 3)]
    with pytest.raises(ValueError, match="not a collapsed stack line"):
        list(read_stacks(["a;b twelve"]))


def test_named_work_wins_over_the_package_it_runs_in() -> None:
    stacks = [
        # tokenising a prompt inside the HTTP handler is tokenization, not HTTP
        (f"{HANDLER};encode (router/tokenization.py:40);encode (protocol/tokenizer.py:110)".split(";"), 5),
        # the digest check of a load report, wherever it is called from
        (f"{ROOT};_on_load (router/service.py:436);check_digest (router/kv_ingest.py:307)".split(";"), 7),
        # detokenization is named before tokenization: the same module holds both
        (f"{HANDLER};IncrementalDetokenizer.push (router/tokenization.py:150)".split(";"), 2),
    ]
    counts = breakdown(stacks, ROUTER_RULES)
    assert counts["tokenization (prompt text -> ids)"] == 5
    assert counts["KV digest check (index scan per load report)"] == 7
    assert counts["detokenization (ids -> text)"] == 2


def test_otherwise_the_innermost_package_is_charged_not_the_entry_point() -> None:
    nats_send = f"{ROOT};Client._flusher (nats/aio/client.py:2200);StreamWriter.writelines (asyncio/streams.py:346)"
    idle_loop = f"{ROOT};Runner.run (asyncio/runners.py:118)"
    glue = f"{HANDLER};Counter (collections:1)"
    stacks = [(nats_send.split(";"), 4), (idle_loop.split(";"), 3), (glue.split(";"), 1)]
    counts = breakdown(stacks, ROUTER_RULES)
    assert counts["NATS client (nats-py: parse, flush, send)"] == 4  # a socket write, not the loop
    assert counts["event loop (asyncio/uvloop: I/O, callbacks, task switches)"] == 3
    assert counts["kvswitch request path (handler, dispatch, stream glue)"] == 1


def test_unmatched_and_frameless_samples_are_other() -> None:
    assert breakdown([([], 2), (["main (elsewhere.py:1)"], 1)], SHIM_RULES) == {"other": 3}


def test_format_breakdown_spreads_measured_cpu_over_the_busy_shares() -> None:
    rules = Rules(specific=[("a", ("a.py",)), ("b", ("b.py",))], generic=[])
    counts = breakdown([(["x (a.py:1)"], 3), (["y (b.py:1)"], 1)], rules)
    assert format_breakdown(counts, cpu_us_per_request=400.0).splitlines() == [
        " 75.0%      300 us/req  a",
        " 25.0%      100 us/req  b",
    ]


def test_samples_caught_in_epoll_are_idle_and_take_no_share_of_the_cpu() -> None:
    waiting, formatting = f"{ROOT};epoll_wait (libc.so.6)", f"{HANDLER};_sse (router/http_api.py:182)"
    stacks = [(waiting.split(";"), 5), (formatting.split(";"), 2)]
    lines = format_breakdown(breakdown(stacks, ROUTER_RULES), cpu_us_per_request=50.0).splitlines()
    assert lines == ["  idle  5 samples  " + IDLE, "100.0%       50 us/req  SSE / OpenAI chunk formatting"]


@pytest.fixture(params=["inherited", "ignored"])
def sigint(request: pytest.FixtureRequest) -> Iterator[None]:
    """The test process's SIGINT as it is, or ignored as in a background job (`cmd &` in a script),
    which children inherit across exec."""
    if request.param == "inherited":
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.usefixtures("sigint")
def test_a_recording_stops_both_samplers_and_keeps_their_files(tmp_path: Path) -> None:
    fake = tmp_path / "py-spy"
    fake.write_text(
        "#!/bin/sh\n"
        'out=""; fmt=""\n'
        'while [ $# -gt 0 ]; do case "$1" in\n'
        '  --output) out="$2"; shift;; --format) fmt="$2"; shift;;\n'
        "esac; shift; done\n"
        'trap \'echo "$fmt" > "$out"; exit 0\' INT\n'
        'touch "$out.ready"\n'
        "while :; do sleep 0.05; done\n"
    )
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    with Recording(str(fake), os.getpid(), tmp_path / "out" / "router-x") as rec:
        deadline = time.monotonic() + 10
        while not all(Path(f"{p}.ready").exists() for p in (rec.svg, rec.stacks)):  # both trap SIGINT now
            assert time.monotonic() < deadline, "the stand-in samplers never started"
            time.sleep(0.01)
    assert rec.svg.read_text() == "flamegraph\n"
    assert rec.stacks.read_text() == "raw\n"


def test_a_sampler_that_fails_is_an_error(tmp_path: Path) -> None:
    failing = Recording("/bin/false", 1, tmp_path / "x")
    with pytest.raises(RuntimeError, match=r"py-spy failed: .*wrote no x\.svg"), failing:
        pass
