"""Open-loop replay: each item is sent at its arrival time divided by `speed`, whatever the state of
earlier requests (an overloaded server sees its queue grow, as in production), round-robin over the
given URLs (router replicas).

Arrival fidelity: a request is never sent before it is due; how late it went out (`sent_s - due_s`)
is recorded per request and summarised, so a client that could not keep up shows in the results
rather than silently flattening the load. Prompts are expanded to token ids just before their turn,
while the loop waits for the due time.
"""

from __future__ import annotations

import asyncio
import importlib
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import aiohttp
import msgspec

from bench.trace import TokenSynth
from bench.workloads import WorkItem
from kvswitch.client import Completion, CompletionClient, discover_model

__all__ = ["ReplayRun", "RequestResult", "read_results", "replay", "write_results"]


class RequestResult(Completion, kw_only=True):
    """A completion plus where and when it was sent: `due_s` and `sent_s` are seconds from the start
    of the replay (wall clock, after `speed`)."""

    index: int
    tag: str
    url: str
    due_s: float
    sent_s: float


@dataclass
class ReplayRun:
    results: list[RequestResult]
    wall_s: float
    speed: float


class _Progress(Protocol):
    def advance(self, done: int, errors: int, in_flight: int) -> None: ...
    def close(self) -> None: ...


class _TqdmProgress:
    def __init__(self, total: int) -> None:
        # Imported by name: tqdm is optional and ships no type stubs.
        tqdm = importlib.import_module("tqdm").tqdm
        self._bar = tqdm(total=total, unit="req", file=sys.stderr, dynamic_ncols=True)
        self._done = 0

    def advance(self, done: int, errors: int, in_flight: int) -> None:
        self._bar.set_postfix(errors=errors, in_flight=in_flight, refresh=False)
        self._bar.update(done - self._done)
        self._done = done

    def close(self) -> None:
        self._bar.close()


class _LineProgress:
    """One status line, rewritten at most twice a second (tqdm is optional)."""

    def __init__(self, total: int) -> None:
        self._total, self._last = total, 0.0

    def advance(self, done: int, errors: int, in_flight: int) -> None:
        now = time.monotonic()
        if now - self._last >= 0.5 or done == self._total:
            self._last = now
            print(f"\r  {done}/{self._total} done, {in_flight} in flight, {errors} errors", end="", file=sys.stderr)

    def close(self) -> None:
        print(file=sys.stderr)


class _NoProgress:
    def advance(self, done: int, errors: int, in_flight: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, enabled: bool) -> _Progress:
    if not enabled:
        return _NoProgress()
    try:
        return _TqdmProgress(total)
    except ImportError:
        return _LineProgress(total)


async def replay(
    items: Sequence[WorkItem],
    urls: Sequence[str],
    *,
    speed: float = 1.0,
    model: str | None = None,
    synth: TokenSynth | None = None,
    timeout_s: float = 600.0,
    progress: bool = True,
    text_prompts: bool = False,
) -> ReplayRun:
    """Send every item at `arrival_s / speed` and wait for all to finish."""
    if not urls:
        raise ValueError("replay needs at least one URL")
    if not speed > 0:
        raise ValueError(f"--speed must be > 0, got {speed}")
    synth = synth or TokenSynth()
    ordered = sorted(enumerate(items), key=lambda pair: pair[1].arrival_s)
    bar = _progress(len(ordered), progress)
    counts = {"done": 0, "errors": 0, "sent": 0}
    # No connection cap: an open-loop replay must not queue requests in the client's pool.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        model = model or await discover_model(session, urls[0])
        client = CompletionClient(session, model, timeout_s=timeout_s, text_prompts=text_prompts)
        t0 = time.monotonic()

        async def send(index: int, item: WorkItem, prompt: list[int], url: str, due: float) -> RequestResult:
            sent = time.monotonic() - t0
            done = await client.complete(url, prompt, item.output_len, request_id=f"bench-{index}")
            counts["done"] += 1
            counts["errors"] += not done.ok
            bar.advance(counts["done"], counts["errors"], counts["sent"] - counts["done"])
            fields: dict[str, Any] = msgspec.structs.asdict(done)
            return RequestResult(**fields, index=index, tag=item.tag, url=url, due_s=due, sent_s=sent)

        tasks: list[asyncio.Task[RequestResult]] = []
        try:
            for n, (index, item) in enumerate(ordered):
                prompt = synth.expand(item.segments)
                due = item.arrival_s / speed
                # Loop until due: asyncio may wake a timer a clock tick early.
                while (delay := t0 + due - time.monotonic()) > 0:  # noqa: ASYNC110 (a time, not an event)
                    await asyncio.sleep(delay)
                url = urls[n % len(urls)]
                tasks.append(asyncio.create_task(send(index, item, prompt, url, due)))
                counts["sent"] += 1
            results = await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        finally:
            bar.close()
        wall = time.monotonic() - t0
    return ReplayRun(sorted(results, key=lambda r: r.index), wall, speed)


_encoder = msgspec.json.Encoder()


def write_results(path: str | Path, results: Sequence[RequestResult]) -> None:
    """One JSON object per request (RequestResult's fields)."""
    with Path(path).open("wb") as fh:
        for result in results:
            fh.write(_encoder.encode(result) + b"\n")


def read_results(path: str | Path) -> list[RequestResult]:
    decoder = msgspec.json.Decoder(RequestResult)
    results = []
    with Path(path).open("rb") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                results.append(decoder.decode(line))
            except msgspec.DecodeError as exc:
                raise ValueError(
                    f"{path}:{lineno}: not a per-request result of `bench replay` (a results JSONL) ({exc})"
                ) from None
    return results
