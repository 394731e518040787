"""One split of a ZMQ endpoint for the sim's config and the shim's (config and sockets)."""

from __future__ import annotations

import pytest

from protocol.zmq_endpoint import ZmqEndpoint, split_endpoint


@pytest.mark.parametrize(
    ("endpoint", "split"),
    [
        ("tcp://*:5557", ZmqEndpoint("tcp", host="*", port=5557)),
        ("tcp://127.0.0.1:*", ZmqEndpoint("tcp", host="127.0.0.1", port=None)),
        ("tcp://engine-0.ns.svc:0", ZmqEndpoint("tcp", host="engine-0.ns.svc", port=0)),
        ("tcp://[::1]:65535", ZmqEndpoint("tcp", host="::1", port=65535)),
        ("tcp://[fe80::1%eth0]:5557", ZmqEndpoint("tcp", host="fe80::1%eth0", port=5557)),
        ("ipc:///tmp/ev", ZmqEndpoint("ipc", path="/tmp/ev")),
        ("inproc://cache", ZmqEndpoint("inproc", path="cache")),
    ],
)
def test_an_endpoint_zmq_opens_splits_into_its_parts(endpoint: str, split: ZmqEndpoint) -> None:
    assert split_endpoint(endpoint) == split


@pytest.mark.parametrize(
    "endpoint",
    [
        "tcp://[::1:5558",  # the sim took it; ZMQ refuses it at bind
        "tcp://[]:5557",  # the sim took it; "No such device" at bind
        "tcp://::1:5557",  # ZMQ reads it only with zmq.IPV6 set, which no engine sets
        "tcp://[::1]x:5557",
        "tcp://[localhost]:5557",
        "tcp://[fe80::1%]:5557",
        "tcp://:5557",
        "tcp://x",
        "tcp://x:70000",
        "tcp://x:+1",
        "tcp://x:\uff15",  # a fullwidth digit 5: str.isdigit takes it, ZMQ does not
        "tcp://a b:1",
        "tcp://x/y:1",
        "TCP://x:1",
        "udp://x:1",
        "ipc://",
        "bogus",
    ],
)
def test_an_endpoint_zmq_cannot_open_as_one_address_splits_into_nothing(endpoint: str) -> None:
    assert split_endpoint(endpoint) is None


@pytest.mark.parametrize(
    ("endpoint", "ipv6", "mapped", "wildcard"),
    [
        ("tcp://*:1", False, False, True),
        ("tcp://0.0.0.0:1", False, False, True),
        ("tcp://[::]:1", True, False, True),
        ("tcp://[::1]:1", True, False, False),
        ("tcp://[::ffff:127.0.0.1]:1", True, True, False),
        ("tcp://10.0.0.7:1", False, False, False),
        ("ipc:///tmp/*", False, False, False),
    ],
)
def test_the_host_says_whether_it_is_ipv6_and_binds_every_address(
    endpoint: str, ipv6: bool, mapped: bool, wildcard: bool
) -> None:
    split = split_endpoint(endpoint)
    assert split is not None and (split.ipv6, split.ipv4_mapped, split.wildcard) == (ipv6, mapped, wildcard)


@pytest.mark.parametrize(("host", "out"), [("10.0.0.5", "tcp://10.0.0.5:5557"), ("fd00::5", "tcp://[fd00::5]:5557")])
def test_another_host_is_bracketed_when_ipv6(host: str, out: str) -> None:
    split = split_endpoint("tcp://[::]:5557")
    assert split is not None and split.on_host(host) == out
