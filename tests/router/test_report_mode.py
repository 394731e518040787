"""`vllm_xargs.kv_cache_report_mode`: vLLM 0.32 reads it from a request's extra args (v1/request.py),
and under "full" a prefix-cache hit re-announces its blocks as BlockStored with no BlockRemoved to
match (v1/core/kv_cache_manager.py get_computed_blocks). The shim counts each announcement as one
more copy, so evicted blocks would stay in every router's index: the router refuses the mode."""

from __future__ import annotations

from typing import Any

import pytest

from router.api_errors import ApiError
from router.request_parsing import parse_request

USER_X = [{"role": "user", "content": "x"}]


def _body(chat: bool, **extra: Any) -> dict[str, Any]:
    return {"model": "m", **({"messages": USER_X} if chat else {"prompt": [1, 2, 3]}), **extra}


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("mode", ["full", "FULL", 1])
def test_a_report_mode_other_than_incremental_is_a_400_naming_vllm_xargs(chat: bool, mode: Any) -> None:
    with pytest.raises(ApiError) as caught:
        parse_request(_body(chat, vllm_xargs={"kv_cache_report_mode": mode, "other": 1}), chat=chat)
    err = caught.value.body()["error"]
    assert caught.value.code == 400 and err["type"] == "BadRequestError" and err["param"] == "vllm_xargs"
    assert "'vllm_xargs.kv_cache_report_mode' must be \"incremental\"" in err["message"]
    assert "after eviction" in err["message"]


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize(
    "xargs", [{"kv_cache_report_mode": "incremental", "k": "v"}, {"k": "v", "n": [1, 2.5]}, {}, None]
)
def test_other_vllm_xargs_go_to_the_engine_unread(chat: bool, xargs: dict[str, Any] | None) -> None:
    parsed = parse_request(_body(chat, vllm_xargs=xargs), chat=chat)
    assert parsed.params["vllm_xargs"] == xargs


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("name", ["kv_transfer_params", "ec_transfer_params"])
def test_a_transfer_handle_in_vllm_xargs_is_the_routers_alone(chat: bool, name: str) -> None:
    # vLLM 0.32 reads both from extra_args: a client's would make the engine pull KV (or encoder
    # cache) from a host the client names, past the refusal of the top-level fields
    handle = {"remote_host": "10.0.0.9", "remote_port": 5600, "do_remote_prefill": True}
    for body in (_body(chat, vllm_xargs={name: handle}), _body(chat, **{name: handle})):
        with pytest.raises(ApiError) as caught:
            parse_request(body, chat=chat)
        assert caught.value.code == 400 and name in caught.value.body()["error"]["message"]


_ROUTERS_FIELDS = [
    "kv_transfer_params",
    "ec_transfer_params",
    "disaggregated_params",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
]


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("name", _ROUTERS_FIELDS)
def test_a_null_transfer_handle_is_none_taken_and_passed_to_no_engine(chat: bool, name: str) -> None:
    # vLLM 0.32 reads a null as unset (to_sampling_params passes on only a truthy one), as TRT-LLM's
    # and SGLang's defaults are null: it names no host, so the router's refusal has nothing to guard
    parsed = parse_request(_body(chat, **{name: None}), chat=chat)
    assert name not in parsed.params and parsed.params["model"] == "m"
    empty: Any = {} if name.endswith("params") else ""
    if name in ("kv_transfer_params", "ec_transfer_params"):  # vLLM passes on only a truthy handle: {} is unset
        parsed = parse_request(_body(chat, **{name: empty}), chat=chat)
        assert name not in parsed.params and parsed.params["model"] == "m"
        empty = {"remote_host": "10.0.0.1"}
    with pytest.raises(ApiError) as caught:  # any other value, even an empty one, is still the router's alone
        parse_request(_body(chat, **{name: empty}), chat=chat)
    assert caught.value.code == 400 and caught.value.body()["error"]["param"] == name


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("name", ["kv_transfer_params", "ec_transfer_params"])
def test_a_null_transfer_handle_in_vllm_xargs_goes_to_the_engine_as_sent(chat: bool, name: str) -> None:
    # vLLM 0.32 refuses it there itself (vllm_xargs values are strings, numbers or lists): its 400
    parsed = parse_request(_body(chat, vllm_xargs={name: None, "k": "v"}), chat=chat)
    assert parsed.params["vllm_xargs"] == {name: None, "k": "v"}
