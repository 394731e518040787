"""Is `subscribe(); flush()` a barrier? Counts messages lost when another connection publishes the
moment the flush returns, with nats-py's flush and with `runtime.nats_flush.flush`.

    .venv/bin/python -m bench.nats_flush_race [--rounds 500] [--busy 3]

`--busy N` runs N spinning processes meanwhile: the race needs a busy CPU to show.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
from collections.abc import Awaitable, Callable

import nats
from nats.aio.client import Client

from kvswitch.servers import NatsServer
from runtime.nats_flush import flush

Flush = Callable[[Client], Awaitable[None]]


async def _plain(nc: Client) -> None:
    await nc.flush()


async def _lost(url: str, publisher: Client, how: Flush, rounds: int) -> int:
    lost = 0
    for i in range(rounds):
        nc = await nats.connect(url)
        sub = await nc.subscribe(f"race.{i}")
        await how(nc)
        await publisher.publish(f"race.{i}", b"x")
        try:
            await sub.next_msg(timeout=0.5)
        except nats.errors.TimeoutError:
            lost += 1
        await nc.close()
    return lost


async def main(rounds: int) -> None:
    with NatsServer() as server:
        publisher = await nats.connect(server.url)
        try:
            for name, how in (("nats-py flush()", _plain), ("runtime.nats_flush.flush", flush)):
                lost = await _lost(server.url, publisher, how, rounds)
                print(f"{name:26} {lost:4d} of {rounds} messages lost")
        finally:
            await publisher.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=500)
    parser.add_argument("--busy", type=int, default=3, help="spinning processes to run meanwhile")
    args = parser.parse_args()
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    try:
        asyncio.run(main(args.rounds))
    finally:
        for p in spinners:
            p.kill()
            p.wait()
