"""vLLM's /tokenize and /detokenize (vllm/entrypoints/serve/tokenize: request and response fields),
with the built-in tokenizer and chat template."""

from __future__ import annotations

from engine_sim import SimServer
from protocol.tokenizer import BuiltinTokenizer, apply_chat_template
from router.tokenization import BuiltinPromptTokenizer
from tests.engine_sim.test_http_api import post

TOK = BuiltinTokenizer()
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]


async def test_tokenize_a_prompt(sim: SimServer) -> None:
    status, out, _ = await post(sim, "/tokenize", {"model": "sim-llama", "prompt": "hello world, again"})
    ids = TOK.encode("hello world, again")
    assert status == 200
    assert out == {"count": len(ids), "max_model_len": sim.config.max_model_len, "tokens": ids, "token_strs": None}
    assert list(out) == ["count", "max_model_len", "tokens", "token_strs"]
    _, strs, _ = await post(sim, "/tokenize", {"prompt": "hello world", "return_token_strs": True})
    assert "".join(strs["token_strs"]) == "hello world" and len(strs["token_strs"]) == strs["count"]
    # The built-in tokenizer adds no special tokens (no BOS, like GPT-2's): both settings agree.
    _, plain, _ = await post(sim, "/tokenize", {"prompt": "hello world", "add_special_tokens": False})
    assert plain["tokens"] == strs["tokens"]


async def test_tokenize_chat_messages_through_the_template(sim: SimServer) -> None:
    _, out, _ = await post(sim, "/tokenize", {"messages": MESSAGES})
    assert out["tokens"] == TOK.encode(apply_chat_template(MESSAGES, add_generation_prompt=True))
    assert out["tokens"] == BuiltinPromptTokenizer().encode_chat(MESSAGES)  # what the router computes
    _, bare, _ = await post(sim, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False})
    assert bare["tokens"] == TOK.encode(apply_chat_template(MESSAGES, add_generation_prompt=False))
    assert out["tokens"][: bare["count"]] == bare["tokens"] and out["count"] > bare["count"]
    # A chat's prompt is the tokenized template: the same ids the chat endpoint counts.
    _, chat, _ = await post(sim, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1})
    assert chat["usage"]["prompt_tokens"] == out["count"]
    _, cont, _ = await post(
        sim, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False, "continue_final_message": True}
    )
    assert TOK.decode(cont["tokens"], skip_special=False).endswith("hello world")
    status, err, _ = await post(sim, "/tokenize", {"messages": MESSAGES, "continue_final_message": True})
    assert status == 400 and "continue_final_message" in err["error"]["message"]


async def test_detokenize_round_trips(sim: SimServer) -> None:
    ids = TOK.encode("the quick brown fox")
    status, out, _ = await post(sim, "/detokenize", {"model": "sim-llama", "tokens": ids})
    assert (status, out) == (200, {"prompt": "the quick brown fox"})
    status, out, _ = await post(sim, "/detokenize", {"tokens": [1, 10**6]})
    assert (status, out) == (200, {"prompt": TOK.decode([1])})  # vLLM's tokenizer skips an unknown id


async def test_tokenize_errors(sim: SimServer) -> None:
    status, err, _ = await post(sim, "/tokenize", {"model": "nope", "prompt": "x"})
    assert status == 404 and err["error"]["type"] == "NotFoundError"
    status, _, _ = await post(sim, "/detokenize", {"tokens": "abc"})
    assert status == 400
    status, _, _ = await post(sim, "/tokenize", {"max_tokens": 3})
    assert status == 400


UNTRUSTED = (
    "Chat template is passed with request, but --trust-request-chat-template is not set. "
    "Refused request with untrusted chat template."
)


async def test_a_requests_own_chat_template_is_refused_as_vllm_refuses_it(sim: SimServer) -> None:
    # vLLM 0.32 without --trust-request-chat-template (its default; the sim has no such flag):
    # 400 BadRequestError with no param, for /tokenize and for chat, given either way.
    for extra in ({"chat_template": "{{ 1 }}"}, {"chat_template_kwargs": {"chat_template": "{{ 1 }}"}}):
        for path, body in (("/tokenize", {"messages": MESSAGES}), ("/v1/chat/completions", {"messages": MESSAGES})):
            status, err, _ = await post(sim, path, {**body, **extra})
            assert status == 400, (path, extra)
            assert err["error"] == {"message": UNTRUSTED, "type": "BadRequestError", "param": None, "code": 400}
    # Other template kwargs are the template's to read, not a template: accepted.
    status, _, _ = await post(
        sim, "/tokenize", {"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": False}}
    )
    assert status == 200
