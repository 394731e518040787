"""The endpoint probe's rule on hand-made batches: what proves a stream another engine's, and what
must not (a stream behind the engine, a reset, a probe sent before the subscription was up). The
end-to-end cases (swapped shims, a healthy pair, a refused probe): tests/router/test_swapped_endpoints.py."""

from __future__ import annotations

import asyncio
import logging

import pytest

from worker_shim.adapters import vllm
from worker_shim.adapters.sglang import SglangAdapter
from worker_shim.adapters.trtllm import TrtllmAdapter
from worker_shim.adapters.vllm import VllmAdapter
from worker_shim.endpoint_probe import EndpointProbe
from worker_shim.engine_events import EngineBatch, EngineStored
from worker_shim.event_health import EventHealth, EventProblem

BS = 4
CREATED = 1000


def _probe(health: EventHealth, prompts: list[list[int]], verdicts: list[bool]) -> EndpointProbe:
    async def serve(prompt: list[int], request_id: str) -> int:
        prompts.append(prompt)
        return CREATED

    return EndpointProbe(
        health,
        serve,
        block_size=lambda: BS,
        prefix_caching=lambda: True,
        where=lambda: "--kv-events tcp://x:1",
        on_foreign=verdicts.append,
        engine_url="http://e",
    )


def _stored(tokens: list[int], ts: float) -> EngineBatch:
    return EngineBatch(events=[EngineStored(hashes=[1], parent=None, token_ids=tokens, block_size=BS)], ts=ts)


async def _answered(prompts: list[list[int]], n: int) -> None:
    while len(prompts) < n:  # noqa: ASYNC110
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.01)


async def test_a_stream_behind_its_engine_is_no_evidence_and_the_late_block_confirms() -> None:
    health = EventHealth(timeout_s=0.05)
    prompts: list[list[int]] = []
    verdicts: list[bool] = []
    probe = _probe(health, prompts, verdicts)
    probe.connected()
    probe.batch(_stored([9, 9, 9, 9], ts=CREATED - 5))  # an anchor: the subscription is up
    await _answered(prompts, 1)
    probe.close()  # the session ends: nothing pending survives
    probe.connected()
    probe.batch(_stored([8, 8, 8, 8], ts=CREATED - 5))
    await asyncio.sleep(0.1)  # rate limit: one probe per events timeout
    await _answered(prompts, 2)
    # Batches the engine made before it answered (a loaded host delivers them seconds late).
    for _ in range(3):
        probe.batch(_stored([7, 7, 7, 7], ts=CREATED + 0.5))
    await asyncio.sleep(0.15)
    assert health.ok and verdicts == []
    probe.batch(_stored(prompts[-1][:BS], ts=CREATED + 0.6))
    assert health.ok and probe.confirmed == 1
    probe.close()


async def test_a_batch_made_after_the_answer_without_the_block_is_a_verdict_and_a_reset_voids_it() -> None:
    health = EventHealth(timeout_s=0.05)
    prompts: list[list[int]] = []
    verdicts: list[bool] = []
    probe = _probe(health, prompts, verdicts)
    probe.connected()
    probe.batch(_stored([9, 9, 9, 9], ts=CREATED - 5))
    await _answered(prompts, 1)
    probe.batch(_stored([7, 7, 7, 7], ts=CREATED + 30))
    probe.batch(EngineBatch(reset=True, complete=False))  # the engine restarted: the probe's block may be lost
    await asyncio.sleep(0.04)  # the verdict was due now
    assert health.ok and verdicts == []
    await _answered(prompts, 2)  # probed again, the reset batch its anchor
    probe.batch(_stored([7, 7, 7, 7], ts=CREATED + 30))
    await asyncio.sleep(0.1)
    assert EventProblem.OTHER_ENGINE in health.problems and verdicts == [True]
    probe.batch(_stored(prompts[-1][:BS], ts=CREATED + 31))  # this engine's after all
    assert health.ok and verdicts == [True, False]
    probe.close()


async def test_a_probe_sent_before_any_batch_of_its_connection_is_sent_again_not_judged() -> None:
    """ZMQ drops what the PUB sends before the subscription reaches it; on a stream without replay
    no seq reveals the probe's batch lost so."""
    health = EventHealth(timeout_s=0.05)
    prompts: list[list[int]] = []
    verdicts: list[bool] = []
    probe = _probe(health, prompts, verdicts)
    probe.connected()
    await _answered(prompts, 1)
    probe.batch(_stored([7, 7, 7, 7], ts=CREATED + 30))
    await asyncio.sleep(0.1)
    assert health.ok and verdicts == []
    await _answered(prompts, 2)
    probe.close()


async def test_an_engine_whose_adapter_does_not_probe_gets_no_probe_and_none_is_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # SGLang and TensorRT-LLM shims read 1 probe sent where none was (review of the probe).
    probe = EndpointProbe(
        EventHealth(timeout_s=0.05), None, block_size=lambda: BS, prefix_caching=lambda: True,
        where=lambda: "--kv-events tcp://x:1", on_foreign=lambda _: None, engine_url="http://e",
    )  # fmt: skip
    with caplog.at_level(logging.INFO, logger="worker_shim.endpoint_probe"):
        probe.connected()
        await asyncio.sleep(0.1)
        probe.connected()
    assert (probe.sent, probe.prompt_tokens, probe.output_tokens) == (0, 0, 0) and probe.settled
    assert [r.getMessage() for r in caplog.records] == [
        "KV event endpoints not checked: the shim cannot match a probe request in this engine's events"
    ]
    assert not SglangAdapter.serves_probe and not TrtllmAdapter.serves_probe and VllmAdapter.serves_probe


def test_a_probe_has_no_total_timeout() -> None:
    # A probe queued past 30 s behind a saturated engine was aborted by the shim's own timeout:
    # vLLM aborts a request whose client went, and the engine never did the work counted.
    assert vllm._PROBE_TIMEOUT.total is None
