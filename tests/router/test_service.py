"""RouterService wiring: live config, tracing, admission, and the CLI's settings."""

from __future__ import annotations

import argparse
import gc
from pathlib import Path

import aiohttp
import nats
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from discovery import Discovery, put_config
from protocol import ConfigError, GenerateRequest, decode_msg, subjects
from protocol.config import EtcdSettings
from router import cli
from router.api_errors import ApiError
from runtime.nats_flush import flush
from tests.router.conftest import MODEL, Cluster, complete
from tests.router.polling import until


async def test_live_config_valid_is_applied_and_invalid_is_refused(cluster: Cluster, etcd_url: str) -> None:
    await cluster.add_worker("agg")
    router = await cluster.add_ready_router(conditional_disagg=True)
    async with Discovery(EtcdSettings(endpoints=[etcd_url]), cluster.ns) as d:
        await put_config(d, {"eff_isl_threshold": 1024, "conditional_disagg_policy": "ttft_model"})
        await until(lambda: router.settings.conditional.eff_isl_threshold == 1024, what="applied")
        assert router.disagg.policy.name == "ttft_model"
        await put_config(d, {"eff_isl_ratio_threshold": 5.0})
        await until(lambda: router.config_rejected == 1, what="refused")
        assert router.settings.conditional.eff_isl_threshold == 1024
        assert router.disagg.policy.name == "ttft_model"
        await put_config(d, {"conditional_disagg_policy": "prefill_load"})  # needs a threshold: refused
        await until(lambda: router.config_rejected == 2, what="refused again")
        assert router.disagg.policy.name == "ttft_model"
        # refused at startup past --request-timeout (router.cli), so live too: else a hung prefill
        # worker's legs run into the client's deadline and never fall back to a local prefill
        timeout = router.config.request_timeout_s
        await put_config(d, {"prefill_timeout_s": timeout})
        await until(lambda: router.config_rejected == 3, what="a prefill timeout past the request's refused")
        assert router.settings.prefill_timeout_s < timeout
        # The same refused value stored again is judged, logged and counted again (it had passed for
        # current, unseen), and /ready warns, while it stays, that the last good settings serve.
        await put_config(d, {"prefill_timeout_s": timeout})
        await until(lambda: router.config_rejected == 4, what="the same refused value refused again")
        body = router.readiness()[1]
        assert any("live config" in w and "refused" in w for w in body["warnings"]), body["warnings"]
        assert "kvswitch_router_config_rejected_total 4.0" in router.metrics.render().decode()
        await d.put_raw(subjects.config_key(cluster.ns), b'{"temperature": 0.1, "temperature": 0.9}')
        await until(lambda: router.config_rejected == 5, what="a key given twice refused")
        await put_config(d, {"prefill_timeout_s": timeout / 2})
        await until(lambda: router.settings.prefill_timeout_s == timeout / 2, what="one within it applied")
        assert not [w for w in router.readiness()[1]["warnings"] if "live config" in w]


async def test_span_per_request_with_decision_and_context_to_the_shim(
    cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    worker = await cluster.add_worker("agg")
    router = await cluster.add_router(tracer_provider=provider, disagg="never")
    await cluster.ready(router)
    nc = await nats.connect(cluster.nats_url)
    seen: list[GenerateRequest] = []

    async def collect(msg: object) -> None:
        seen.append(decode_msg(msg.data, GenerateRequest))  # type: ignore[attr-defined]

    await nc.subscribe(subjects.gen(router.ns, "agg", worker.id), cb=collect)
    await flush(nc)
    status, _, _ = await complete(http, router, list(range(64)))
    assert status == 200
    await until(lambda: bool(seen), what="the leg on NATS")  # our copy may trail the shim's answer
    await nc.close()
    spans = exporter.get_finished_spans()
    (span,) = [s for s in spans if s.name.startswith("POST")]
    (leg,) = [s for s in spans if s.name == "kvswitch leg agg"]
    assert span.attributes is not None and leg.attributes is not None
    assert span.attributes["kvswitch.decode_worker"] == worker.id
    assert span.attributes["kvswitch.outcome"] == "aggregated"
    ids = (span.attributes["kvswitch.request_id"], span.attributes["kvswitch.engine_request_id"])
    assert ids == (seen[0].request_id, seen[0].engine_request_id) == (seen[0].request_id, seen[0].request_id)
    assert leg.parent is not None and leg.parent.span_id == span.context.span_id
    assert leg.attributes["kvswitch.worker"] == worker.id and leg.attributes["kvswitch.role"] == "agg"
    _, trace_id, parent_id, _ = seen[0].trace["traceparent"].split("-")
    assert trace_id == f"{span.context.trace_id:032x}" and parent_id == f"{leg.context.span_id:016x}"


def test_queue_full_maps_to_429_with_retry_after() -> None:
    resp = ApiError(429, "busy", retry_after_s=2).response()
    assert resp.status == 429 and resp.headers["Retry-After"] == "2"


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_cli_flags_become_settings_overrides() -> None:
    config = cli.build_config(
        _args(
            "--conditional-disagg",
            "--conditional-disagg-policy",
            "isl_or_load",
            "--queue-threshold",
            "1.5",
            "--eff-isl-threshold",
            "512",
            "--nats-servers",
            "nats://a:1,nats://b:2",
            "--etcd-endpoints",
            "http://e:3",
            "--namespace",
            "prod",
        )
    )
    assert config.overrides == {
        "conditional_disagg": True,
        "conditional_disagg_policy": "isl_or_load",
        "queue_threshold": 1.5,
        "eff_isl_threshold": 512,
    }
    assert config.nats.servers == ["nats://a:1", "nats://b:2"] and config.etcd.endpoints == ["http://e:3"]
    assert config.ns == "prod"


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--eff-isl-ratio-threshold", "1.5"], "--eff-isl-ratio-threshold"),
        (["--conditional-disagg-policy", "prefill_load"], "--prefill-busy-threshold"),
        (["--nats-servers", "http://x"], "--nats-servers"),
        (["--namespace", "a.b"], "--namespace"),
        (["--http-port", "99999"], "--http-port"),
        (["--spill-to-prefill"], "--spill-to-prefill"),  # the policy does not decide: nothing to spill
        (["--request-timeout", "0"], "--request-timeout"),  # every request would time out
        (["--request-timeout", "nan"], "--request-timeout"),
        (["--namespace", ""], "--namespace"),  # not the default namespace in silence
        (["--model", ""], "--model"),  # every request would be a 404
        (["--body-timeout-s", "inf"], "--body-timeout-s"),
        (["--stream-heartbeat-s", "0.002"], "--stream-heartbeat-s"),  # every request a worker_silent 503
        (["--conditional-disagg", "--disagg", "never"], "--conditional-disagg"),  # the policy is never asked
        (["--prefill-timeout-s", "600"], "--request-timeout"),  # the fallback would never fire
        (["--prefill-timeout-s", "20", "--request-timeout", "10"], "--prefill-timeout-s"),
    ],
)
def test_cli_rejects_bad_settings_at_startup(argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError, match=flag):
        cli.build_config(_args(*argv))
    assert cli.run(_args(*argv)) == 2
    assert flag in capsys.readouterr().err


def test_process_settings_layer_cli_over_env_over_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "router.yaml"
    path.write_text("namespace: fromfile\nhttp_port: 7000\nrequest_timeout: 50\nmodel: file-model\n")
    env = {
        "KVSWITCH_NAMESPACE": "fromenv", "KVSWITCH_HTTP_PORT": "9001", "KVSWITCH_REQUEST_TIMEOUT": "120",
        "KVSWITCH_MODEL": "llama", "KVSWITCH_TOKENIZER": "/models/llama", "KVSWITCH_BODY_TIMEOUT_S": "5",
        "KVSWITCH_MAX_BODY_BYTES": "2048", "KVSWITCH_NO_CALIBRATION": "true",
        "KVSWITCH_CHAT_TEMPLATE_CONTENT_FORMAT": "openai",
    }  # fmt: skip
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    config = cli.build_config(_args("--config", str(path), "--http-port", "9002"))
    assert (config.ns, config.http_port, config.request_timeout_s, config.model, config.tokenizer) == (
        "fromenv", 9002, 120.0, "llama", "/models/llama"
    )  # fmt: skip
    limits = config.http_limits
    assert (limits.body_timeout_s, limits.max_body_bytes, config.calibrate) == (5.0, 2048, False)
    assert config.chat_template_content_format == "openai"
    flag = cli.build_config(_args("--chat-template-content-format", "string"))
    assert flag.chat_template_content_format == "string"
    for name in env:
        monkeypatch.delenv(name)
    config = cli.build_config(_args("--config", str(path)))
    assert (config.ns, config.http_port, config.request_timeout_s) == ("fromfile", 7000, 50.0)
    assert config.model == "file-model" and config.chat_template_content_format == "auto"


@pytest.mark.parametrize(
    ("name", "value", "flag"),
    [
        ("KVSWITCH_NAMESPACE", "", "--namespace"),
        ("KVSWITCH_HTTP_PORT", "http", "--http-port"),
        ("KVSWITCH_MODEL", "", "--model"),
        ("KVSWITCH_REQUEST_TIMEOUT", "0", "--request-timeout"),
        ("KVSWITCH_CHAT_TEMPLATE_CONTENT_FORMAT", "parts", "--chat-template-content-format"),
    ],
)
def test_a_bad_process_setting_from_the_environment_is_refused_naming_it(
    name: str, value: str, flag: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=f"{flag}, {name}"):
        cli.build_config(_args())


@pytest.mark.parametrize(
    ("argv", "why"),
    [
        (["--tokenizer", "/t", "--default-chat-template-kwargs", "{enable_thinking: false}"], "a JSON object"),
        (["--tokenizer", "/t", "--default-chat-template-kwargs", "[1]"], "a JSON object"),
        (["--default-chat-template-kwargs", '{"enable_thinking": false}'], "needs --tokenizer"),
        (["--tokenizer", "/t", "--default-chat-template-kwargs", '{"add_generation_prompt": false}'], "must not set"),
        (["--tokenizer", "/t", "--default-chat-template-kwargs", '{"messages": []}'], "must not set 'messages'"),
        (["--tokenizer", "/t", "--default-chat-template-kwargs", '{"chat_template": "x"}'], "chat_template.jinja"),
        (["--tokenizer", "/t", "--default-chat-template-kwargs", '{"tools": "get_time"}'], "'tools' must be a list"),
    ],
)
def test_default_chat_template_kwargs_that_cannot_be_vllms_are_refused(argv: list[str], why: str) -> None:
    with pytest.raises(ConfigError, match="--default-chat-template-kwargs") as err:
        cli.build_config(_args(*argv))
    assert why in str(err.value)


def test_default_chat_template_kwargs_from_the_flag_the_environment_or_a_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    flag = cli.build_config(_args("--tokenizer", "/t", "--default-chat-template-kwargs", '{"enable_thinking": false}'))
    assert flag.default_chat_template_kwargs == {"enable_thinking": False}
    path = tmp_path / "router.yaml"
    path.write_text("tokenizer: /t\ndefault_chat_template_kwargs:\n  date_string: 01 Jan 2030\n")
    assert cli.build_config(_args("--config", str(path))).default_chat_template_kwargs == {"date_string": "01 Jan 2030"}
    monkeypatch.setenv("KVSWITCH_DEFAULT_CHAT_TEMPLATE_KWARGS", '{"bos_token": ""}')
    assert cli.build_config(_args("--config", str(path))).default_chat_template_kwargs == {"bos_token": ""}
    monkeypatch.delenv("KVSWITCH_DEFAULT_CHAT_TEMPLATE_KWARGS")
    assert cli.build_config(_args()).default_chat_template_kwargs is None


def test_excluding_tools_when_tool_choice_is_none_is_a_setting_off_by_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert cli.build_config(_args()).exclude_tools_when_tool_choice_none is False
    flag = _args("--exclude-tools-when-tool-choice-none")
    assert cli.build_config(flag).exclude_tools_when_tool_choice_none is True
    path = tmp_path / "router.yaml"
    path.write_text("exclude_tools_when_tool_choice_none: true\n")
    assert cli.build_config(_args("--config", str(path))).exclude_tools_when_tool_choice_none is True
    monkeypatch.setenv("KVSWITCH_EXCLUDE_TOOLS_WHEN_TOOL_CHOICE_NONE", "true")
    assert cli.build_config(_args()).exclude_tools_when_tool_choice_none is True


def test_trusting_request_chat_templates_is_a_flag_off_by_default() -> None:
    assert cli.build_config(_args()).trust_request_chat_template is False
    assert cli.build_config(_args("--trust-request-chat-template")).trust_request_chat_template is True


def test_a_config_file_key_no_setting_reads_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "router.yaml"
    path.write_text("namespace: prod\nqueue_threshod: 2\n")
    assert cli.run(_args("--config", str(path))) == 2
    assert "'queue_threshod' is not a setting; did you mean 'queue_threshold'?" in capsys.readouterr().err


def test_the_index_limit_per_worker_is_a_process_setting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The floor of every worker's KV index bound: an honest worker whose CPU or disk KV tier holds
    # more was refused (and dumped again and again) with no way out.
    assert cli.build_config(_args()).index_limit_per_worker == 1 << 22
    path = tmp_path / "router.yaml"
    path.write_text("index_limit_per_worker: 8192\n")
    assert cli.build_config(_args("--config", str(path))).index_limit_per_worker == 8192
    monkeypatch.setenv("KVSWITCH_INDEX_LIMIT_PER_WORKER", "16384")
    assert cli.build_config(_args("--config", str(path))).index_limit_per_worker == 16384
    flag = cli.build_config(_args("--config", str(path), "--index-limit-per-worker", str(1 << 24)))
    assert flag.index_limit_per_worker == 1 << 24
    monkeypatch.setenv("KVSWITCH_INDEX_LIMIT_PER_WORKER", "4095")
    with pytest.raises(ConfigError, match="--index-limit-per-worker, KVSWITCH_INDEX_LIMIT_PER_WORKER"):
        cli.build_config(_args())
    monkeypatch.delenv("KVSWITCH_INDEX_LIMIT_PER_WORKER")
    with pytest.raises(ConfigError, match="--index-limit-per-worker"):
        cli.build_config(_args("--index-limit-per-worker", "0"))


async def test_the_router_bounds_each_workers_index_by_its_setting(cluster: Cluster) -> None:
    router = await cluster.add_router(config={"index_limit_per_worker": 1 << 24})
    assert router.ingest.min_entry_limit == 1 << 24


async def test_a_routers_own_stop_is_no_kv_connection_cut(cluster: Cluster, caplog: pytest.LogCaptureFixture) -> None:
    """Its stop drains the KV event connection itself: that is no slow consumer cut to warn of."""
    await cluster.add_worker("agg")
    router = await cluster.add_ready_router()
    await router.stop()
    assert router.kv_disconnects == 0
    assert not [r for r in caplog.records if "KV event connection" in r.getMessage()]


async def test_a_streamed_requests_leg_ends_with_it_and_is_no_failure(
    cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    """The handler stops reading at the final chunk and closes the dispatcher's generator: the
    generators nested in it were left suspended, their leg open until collected, and its span then
    ended after the request's, marked failed with GeneratorExit."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    await cluster.add_worker("agg")
    router = await cluster.add_router(tracer_provider=provider, disagg="never")
    await cluster.ready(router)
    body = {"model": MODEL, "prompt": list(range(64)), "max_tokens": 4, "stream": True}
    gc.disable()  # the collector must not be what ends the leg
    try:
        async with http.post(router.url + "/v1/completions", json=body) as resp:
            assert resp.status == 200 and (await resp.read()).endswith(b"data: [DONE]\n\n")
        await until(lambda: any(s.name.startswith("POST") for s in exporter.get_finished_spans()), what="the span")
        assert router.dispatcher.inflight_legs == 0
    finally:
        gc.enable()
    spans = exporter.get_finished_spans()
    (span,) = [s for s in spans if s.name.startswith("POST")]
    (leg,) = [s for s in spans if s.name == "kvswitch leg agg"]
    assert leg.status.status_code is not StatusCode.ERROR, leg.status.description
    assert leg.end_time is not None and span.end_time is not None and leg.end_time <= span.end_time
