"""Checks shared by the compose and Kubernetes tests: a kvswitch command parses with the CLI's own
parser, and an engine's KV event endpoints are the ones its shim listens to."""

from __future__ import annotations

import argparse
import json

import pytest

from kvswitch.cli import subcommand_parser


def parse(argv: list[str]) -> tuple[str, argparse.Namespace]:
    """`kvswitch ARGV...` as the CLI parses it; a flag the CLI lacks fails the test, naming it."""
    name, rest = argv[0], argv[1:]
    parser = subcommand_parser(name)
    try:
        return name, parser.parse_args(rest)
    except SystemExit:
        pytest.fail(f"`kvswitch {' '.join(argv)}` does not parse with the CLI's parser")


def kv_endpoints(events_config: str) -> tuple[str, str]:
    """(endpoint, replay_endpoint) of a vLLM `--kv-events-config`, checking it is well formed."""
    config = json.loads(events_config)
    assert config["enable_kv_cache_events"] is True and config["publisher"] == "zmq"
    return str(config["endpoint"]), str(config["replay_endpoint"])


def loopback_only(endpoint: str) -> bool:
    return "://127.0.0.1:" in endpoint
