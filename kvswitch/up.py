"""`kvswitch up`: the embedded default, a whole cluster on one machine."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from kvswitch.cluster import ClusterSpec, LocalCluster

__all__ = ["add_arguments", "run"]

log = logging.getLogger("kvswitch.up")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nats-port", type=int, default=0, help="NATS client port (0: a free one)")
    parser.add_argument("--etcd-port", type=int, default=0, help="etcd client port (0: a free one)")
    parser.add_argument(
        "--demo", action="store_true", help="bring the cluster up, show it healthy, and take it down again"
    )


def run(args: argparse.Namespace) -> int:
    spec = ClusterSpec(nats_port=args.nats_port, etcd_port=args.etcd_port)
    from kvswitch.runtime import run_service

    async def main(stop: asyncio.Event) -> int:
        cluster = LocalCluster(spec)
        try:
            cluster.start()
            print(cluster.describe(), flush=True)
            print(cluster.health_line(), flush=True)
            if args.demo:
                return 0 if cluster.healthy() else 1
            print("kvswitch up: Ctrl-C or SIGTERM to stop", flush=True)
            while not stop.is_set():
                try:
                    await asyncio.wait_for(stop.wait(), timeout=5.0)
                except TimeoutError:
                    if not cluster.healthy():
                        log.error("unhealthy: %s", cluster.health_line())
            return 0
        finally:
            cluster.stop()
            print("kvswitch up: stopped", file=sys.stderr, flush=True)

    return run_service(main)
