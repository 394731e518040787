"""Tokenisers: the built-in default, a Hugging Face tokenizer.json (a file, a directory or a model in
the local hub cache) with its chat template rendered as transformers does, off-loop tokenization,
and the once-per-worker fingerprint mismatch report."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, pre_tokenizers

from protocol.config import RouterSettings
from protocol.fingerprint import PROBES_SINCE
from protocol.messages import WorkerInfo
from protocol.tokenizer import BuiltinTokenizer, apply_chat_template
from router.api_errors import ApiError
from router.block_index import BlockIndex
from router.fleet_lines import NAMED_AT_MOST
from router.load_view import LoadView
from router.planner import standalone_planner
from router.request_parsing import parse_request, prompt_ids
from router.tokenization import (
    BuiltinPromptTokenizer,
    ChatOptions,
    FingerprintWatch,
    HfPromptTokenizer,
    Tokenization,
    TokenizerError,
    load_tokenizer,
    resolve_tokenizer_path,
    tokenizer_fingerprint,
)

VOCAB = {"[UNK]": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4, "user": 5, "assistant": 6, ":": 7, "|": 8}
TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} | {% endfor %}" + (
    "{% if add_generation_prompt %}assistant :{% endif %}"
)


@pytest.fixture
def hf_dir(tmp_path: Path) -> Path:
    tok = Tokenizer(models.WordLevel(vocab=VOCAB, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>", "</s>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    # bos_token in the saved AddedToken form older transformers wrote (one without `__type` it refuses)
    config = {"bos_token": {"__type": "AddedToken", "content": "<s>"}, "eos_token": "</s>", "chat_template": TEMPLATE}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


def test_default_is_the_builtin_tokenizer_with_chatml() -> None:
    tok = load_tokenizer(None)
    assert isinstance(tok, BuiltinPromptTokenizer)
    messages = [{"role": "user", "content": "hello world"}]
    assert tok.encode_chat(messages) == BuiltinTokenizer().encode(apply_chat_template(messages))
    assert BuiltinTokenizer().decode(tok.encode("the cache")) == "the cache"


def test_builtin_refuses_a_requests_own_template_rather_than_rendering_chatml() -> None:
    # Reached only with --trust-request-chat-template; engine_sim refuses such requests, and
    # ChatML in the template's place would route on a prompt nobody sends.
    messages = [{"role": "user", "content": "hello world"}]
    with pytest.raises(TokenizerError, match=r"chat_template: the built-in tokenizer renders ChatML only.*--tokenizer"):
        BuiltinPromptTokenizer().encode_chat(messages, ChatOptions(chat_template="{{ messages[0].content }}"))


def test_builtin_rejects_a_message_without_role() -> None:
    with pytest.raises(TokenizerError, match="role"):
        BuiltinPromptTokenizer().encode_chat([{"content": "x"}])


@pytest.mark.parametrize("as_file", [False, True])
def test_hf_tokenizer_from_dir_or_file(hf_dir: Path, as_file: bool) -> None:
    tok = load_tokenizer(hf_dir / "tokenizer.json" if as_file else hf_dir)
    assert isinstance(tok, HfPromptTokenizer)
    assert tok.encode("hello world") == [3, 4]


def test_a_files_truncation_and_padding_are_off_as_in_transformers(hf_dir: Path, tmp_path: Path) -> None:
    # save_pretrained writes both sections after a call that truncated or padded; transformers (so
    # vLLM) turns them off for a plain encode, so a text prompt is neither cut nor padded.
    raw = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    raw.enable_truncation(max_length=4)
    raw.enable_padding(pad_id=0, pad_token="[UNK]", pad_to_multiple_of=8)
    both = tmp_path / "both"
    both.mkdir()
    raw.save(str(both / "tokenizer.json"))
    (both / "tokenizer_config.json").write_text((hf_dir / "tokenizer_config.json").read_text())
    assert json.loads((both / "tokenizer.json").read_text())["truncation"]["max_length"] == 4
    plain, loaded = load_tokenizer(hf_dir), load_tokenizer(both)
    text = " ".join(["hello world"] * 5)
    assert loaded.encode(text) == plain.encode(text) == [3, 4] * 5
    assert loaded.encode_large(text, add_special_tokens=True) == plain.encode_large(text, add_special_tokens=True)
    chat = [{"role": "user", "content": text}]
    assert loaded.encode_chat(chat) == plain.encode_chat(chat)
    assert tokenizer_fingerprint(loaded) == tokenizer_fingerprint(plain)


def test_hf_chat_template_is_rendered_with_jinja(hf_dir: Path) -> None:
    tok = load_tokenizer(hf_dir)
    ids = tok.encode_chat([{"role": "user", "content": "hello"}])
    assert ids == [1, 5, 7, 3, 8, 6, 7]  # <s> user : hello | assistant :


def test_hf_without_template_refuses_chat(hf_dir: Path) -> None:
    (hf_dir / "tokenizer_config.json").write_text("{}")
    with pytest.raises(TokenizerError, match="chat_template"):
        load_tokenizer(hf_dir).encode_chat([{"role": "user", "content": "hello"}])


def test_bad_tokenizer_paths_raise_named_errors(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match=r"no tokenizer\.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="not a tokenizers JSON"):
        load_tokenizer(tmp_path)


def _snapshot(root: Path, model: str, sha: str, source: Path) -> Path:
    repo = root / ("models--" + model.replace("/", "--"))
    snap = repo / "snapshots" / sha
    snap.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (snap / name).write_bytes((source / name).read_bytes())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(sha + "\n")
    return snap


def test_a_model_id_resolves_to_its_snapshot_in_the_hub_cache(
    hf_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "hf"
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(home))
    snap = _snapshot(home / "hub", "acme/tiny", "abc123", hf_dir)
    assert resolve_tokenizer_path("acme/tiny") == snap / "tokenizer.json"
    tok = load_tokenizer("acme/tiny")
    assert tok.encode("hello world") == [3, 4]
    # the command fetches every file beside tokenizer.json that the router reads, and no weights
    hint = r"models--acme--other.*hf download MODEL --include '\*\.json' --include '\*\.jinja'"
    with pytest.raises(TokenizerError, match=hint):
        load_tokenizer("acme/other")


@pytest.mark.parametrize(
    ("spec", "missing"),
    [
        ("/nonexistent/tok", "/nonexistent/tok"),
        ("./tokenizer.json", "{cwd}/tokenizer.json"),
        ("../no-such-dir", "{cwd}/../no-such-dir"),
        ("~/no-such-tok", "{home}/no-such-tok"),
        ("tok/tokenizer.json", "{cwd}/tok/tokenizer.json"),
        (Path("no-such-dir"), "{cwd}/no-such-dir"),
    ],
)
def test_a_missing_path_is_missing_not_a_model_id_to_download(
    spec: str | Path, missing: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Walkthrough audit 2026-12-07: `--tokenizer /nonexistent/tok` was looked up as a model id, and
    refused as no model in the Hugging Face cache (`models----nonexistent--tok`), to be downloaded
    with `hf download`. No model id starts so, or ends in .json."""
    cwd, home = tmp_path / "cwd", tmp_path / "home"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(TokenizerError) as refused:
        resolve_tokenizer_path(spec)
    assert refused.value.why == "no such file or directory: " + missing.format(cwd=cwd, home=home)


def test_chat_template_jinja_file_wins_over_the_config(hf_dir: Path) -> None:
    (hf_dir / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert load_tokenizer(hf_dir).encode_chat([{"role": "user", "content": "hello world"}]) == [3, 4]


def test_the_template_renders_as_transformers_does(hf_dir: Path) -> None:
    template = (
        "{% generation %}{{ tools | tojson }}{% endgeneration %}"
        "{% for m in messages %}{{ m['content'] }}|{% endfor %}{% if add_generation_prompt %}G{% endif %}{{ extra }}"
    )
    (hf_dir / "chat_template.jinja").write_text(template)
    tok = load_tokenizer(hf_dir)
    assert isinstance(tok, HfPromptTokenizer)
    tools = [{"b": 1, "a": "<x>"}]
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    text = tok.render_chat(
        [{"role": "user", "content": parts}], ChatOptions(tools=tools, chat_template_kwargs={"extra": "!"})
    )
    # transformers' tojson: no HTML escapes, keys in order; list content joined by newlines (vLLM)
    assert text == '[{"b": 1, "a": "<x>"}]one\ntwo|G!'
    cont = tok.render_chat(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "par"}],
        ChatOptions(continue_final_message=True),
    )
    assert cont == "nullhi|par"  # cut right after the final message, no generation prompt
    with pytest.raises(TokenizerError, match=r"messages\[0\]\.content"):
        tok.render_chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["hello", " world", "\n", "\r\n", "\t", "  ", "é", "東京", "<|im_end|>", "x.y"])))
def test_builtin_line_by_line_encoding_gives_the_same_ids(pieces: list[str]) -> None:
    tok = BuiltinPromptTokenizer()
    text = "".join(pieces) * 700  # long enough to cut into several segments
    assert tok.encode_large(text, True) == tok.encode(text)


async def test_large_prompts_are_tokenized_on_a_thread_with_the_same_ids(hf_dir: Path) -> None:
    for tok in (BuiltinPromptTokenizer(), load_tokenizer(hf_dir)):
        tokenization = Tokenization(tok, offload_chars=100)
        try:
            small, large = "hello world", "hello world\n" * 1000
            assert await tokenization.encode(small) == tok.encode(small)
            assert tokenization.offloaded == 0
            assert await tokenization.encode(large) == tok.encode(large)
            assert tokenization.offloaded == 1
        finally:
            tokenization.close()


async def test_a_batch_of_prompts_each_under_the_bound_but_over_it_together_is_tokenized_on_the_pool(
    hf_dir: Path,
) -> None:
    """Each prompt was sized alone: 40 prompts of 32 KiB were tokenized inline one after another,
    the router's loop held for 2.2 s (loop audit of 2026-12-06)."""
    tok = load_tokenizer(hf_dir)
    tokenization = Tokenization(tok, offload_chars=100)
    try:
        batch = parse_request({"model": "m", "prompt": ["hello world " * 5] * 4}, chat=False)  # 60 chars each
        routed, prompts = await prompt_ids(tokenization, batch)
        assert prompts == [tok.encode("hello world " * 5)] * 4 and routed == prompts[0]
        assert tokenization.offloaded == 4
        small = parse_request({"model": "m", "prompt": ["hello world"] * 4}, chat=False)
        await prompt_ids(tokenization, small)
        assert tokenization.offloaded == 4  # 44 chars in all: inline
    finally:
        tokenization.close()


async def test_a_large_chat_is_tokenized_on_a_thread_that_leaves_the_loop_the_gil(
    hf_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sized by all the template is given (a text part too: old, 1024 whatever its length, so
    never offloaded; and a thinking part, tool call arguments, tools), and encoded with the
    tokenizer's batch call, which lets go of the GIL (old: `encode`, which holds the loop for the
    whole prompt even on the pool)."""
    tok = load_tokenizer(hf_dir)
    large: list[str] = []

    def spy(text: str, add_special_tokens: bool) -> list[int]:
        large.append(text)
        return tok.encode(text, add_special_tokens)

    monkeypatch.setattr(tok, "encode_large", spy)
    t = Tokenization(tok, offload_chars=2000)
    try:
        text = "hello world " * 3000
        for content in (text, [{"type": "text", "text": text}]):
            ids = await t.encode_chat([{"role": "user", "content": content}], ChatOptions())
            assert ids == tok.encode_chat([{"role": "user", "content": text}])
        assert t.offloaded == 2 and len(large) == 4  # two on the pool, and the two direct calls above
        short: list[dict[str, Any]] = [{"role": "user", "content": "hello"}]
        thinking = [{"role": "assistant", "content": [{"type": "thinking", "thinking": text}]}, *short]
        call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": text}}
        tool = {"type": "function", "function": {"name": "f", "description": text, "parameters": {}}}
        await t.encode_chat(thinking, ChatOptions())
        await t.encode_chat([{"role": "assistant", "content": None, "tool_calls": [call]}, *short], ChatOptions())
        await t.encode_chat(short, ChatOptions(tools=[tool]))
        assert t.offloaded == 5  # old: 2, each of these three tokenized on the loop
        await t.encode_chat(short, ChatOptions())
        assert t.offloaded == 5
    finally:
        t.close()


def _recording_thread(encode_chat: Callable[..., list[int]], threads: list[str]) -> Callable[..., list[int]]:
    """`encode_chat` that appends the name of the thread it runs on to `threads`."""

    def recorded(messages: Any, options: ChatOptions) -> list[int]:
        threads.append(threading.current_thread().name)
        return encode_chat(messages, options)

    return recorded


_LARGE = "hello world " * 300


@pytest.mark.parametrize(
    ("defaults", "options"),
    [
        ({"documents": [{"title": "t", "text": _LARGE}]}, ChatOptions()),
        ({"system": _LARGE}, ChatOptions()),
        (None, ChatOptions(chat_template_kwargs={"system": _LARGE})),
    ],
    ids=["default_documents", "default_kwarg", "request_kwarg"],
)
async def test_a_small_chat_given_large_defaults_or_kwargs_renders_on_the_pool(
    hf_dir: Path, monkeypatch: pytest.MonkeyPatch, defaults: dict[str, Any] | None, options: ChatOptions
) -> None:
    """Sized by the request's messages, tools and documents only: a router whose
    --default-chat-template-kwargs held 2.4 MB of documents rendered and tokenized them on the
    event loop for every small chat (5.3 s each, until 2026-12-08); a large value in the
    request's chat_template_kwargs too."""
    config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for d in documents or [] %}{{ d['text'] }} {% endfor %}{{ system or '' }} " + TEMPLATE
    (hf_dir / "tokenizer_config.json").write_text(json.dumps(config))
    small = [{"role": "user", "content": "hello"}]
    tok = HfPromptTokenizer(hf_dir, default_kwargs=defaults)
    threads: list[str] = []
    monkeypatch.setattr(tok, "encode_chat", _recording_thread(tok.encode_chat, threads))
    t = Tokenization(tok, offload_chars=2000)
    try:
        assert len(await t.encode_chat(small, options)) > 600  # the large text was rendered
        assert t.offloaded == 1  # old: 0, rendered on the loop
        assert len(threads) == 1 and threads[0].startswith("kvswitch-tokenize")
        await t.encode_chat(small, ChatOptions(chat_template_kwargs={"system": "hello"}))
        # a small kwarg and no defaults: inline; large defaults: every chat on the pool
        assert t.offloaded == (1 if defaults is None else 2)
    finally:
        t.close()


async def test_tool_choice_none_renders_without_tools_only_under_the_engines_flag(hf_dir: Path) -> None:
    """vLLM 0.32 with --exclude-tools-when-tool-choice-none renders a tool_choice "none" request
    without its `tools` (online_renderer.py: tool_dicts None); the router must route on that prompt."""
    config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    tools_first = "{% for t in tools or [] %}{{ t['function']['name'] }} | {% endfor %}"
    config["chat_template"] = tools_first + TEMPLATE
    (hf_dir / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer(hf_dir)
    messages = [{"role": "user", "content": "weather?"}]
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    bare, with_tools = tok.encode_chat(messages), tok.encode_chat(messages, ChatOptions(tools=[tool]))
    assert bare != with_tools
    for flag, choice, expected in (
        (True, "none", bare),  # old: with_tools, a prompt the engine never renders
        (True, "auto", with_tools),
        (True, None, with_tools),
        (False, "none", with_tools),
    ):
        t = Tokenization(tok, exclude_tools_when_tool_choice_none=flag)
        try:
            assert await t.encode_chat(messages, ChatOptions(tools=[tool], tool_choice=choice)) == expected
            kwargs_tools = ChatOptions(tool_choice=choice, raw_tools=[tool])  # chat_template_kwargs' tools stay
            assert await t.encode_chat(messages, kwargs_tools) == with_tools
        finally:
            t.close()


async def test_a_clients_own_chat_template_is_refused_unless_trusted_and_then_renders_off_the_loop(
    hf_dir: Path,
) -> None:
    messages = [{"role": "user", "content": "hello"}]
    mine = ChatOptions(chat_template="{% for m in messages %}{{ m['content'] }} world{% endfor %}")
    t = Tokenization(load_tokenizer(hf_dir))
    with pytest.raises(TokenizerError, match="--trust-request-chat-template is not set"):
        await t.encode_chat(messages, mine)
    assert await t.encode_chat(messages, ChatOptions()) == [1, 5, 7, 3, 8, 6, 7] and t.offloaded == 0
    trusting = Tokenization(load_tokenizer(hf_dir), trust_request_template=True)
    assert await trusting.encode_chat(messages, mine) == [3, 4] and trusting.offloaded == 1
    # one in chat_template_kwargs is untyped there: refused as any other untrusted, and when trusted,
    # refused naming the kwargs, not compiled (jinja takes only text)
    with pytest.raises(TokenizerError, match="--trust-request-chat-template is not set"):
        await t.encode_chat(messages, ChatOptions(chat_template=5))
    with pytest.raises(TokenizerError, match="must be a string") as err:
        await trusting.encode_chat(messages, ChatOptions(chat_template=5))
    assert err.value.what == "chat_template_kwargs"
    t.close()
    trusting.close()


@pytest.mark.parametrize(
    "template",
    ["{{ 1 / 0 }}", "{% for i in range(10**9) %}{% endfor %}", "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}"],
    ids=["zero-division", "huge-range", "recursion"],
)
def test_a_template_that_raises_anything_is_the_requests_error(hf_dir: Path, template: str) -> None:
    tok = load_tokenizer(hf_dir)
    with pytest.raises(TokenizerError, match="cannot render these messages"):
        tok.encode_chat([{"role": "user", "content": "hello"}], ChatOptions(chat_template=template))


def test_a_fingerprint_mismatch_is_logged_once_per_worker(hf_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    watch = FingerprintWatch(tokenizer_fingerprint(load_tokenizer(hf_dir)))

    def info(worker: str, tokenizer: str, events_ok: bool = True) -> WorkerInfo:
        return WorkerInfo(worker=worker, model="m", role="agg", engine="vllm", block_size=16, tokenizer=tokenizer,
                          events_ok=events_ok)  # fmt: skip

    with caplog.at_level(logging.ERROR, logger="router.tokenization"):
        watch.check(info("w1", "builtin"))
        watch.check(info("w1", "builtin", events_ok=False))  # the same worker's record changes: no new line
        watch.check(info("w2", watch.mine))
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "w1" in errors[0].getMessage() and "gets no text prompts" in errors[0].getMessage()
    assert [w["worker"] for w in watch.report()["text_refused"]] == ["w1"]
    watch.forget("w1")
    assert watch.report()["text_refused"] == []
    builtin = FingerprintWatch(tokenizer_fingerprint(BuiltinPromptTokenizer()))
    assert builtin.mine == "builtin"
    builtin.check(info("w3", "tok-0123456789abcdef"))
    assert "--tokenizer" in builtin.report()["text_refused"][0]["why"]


def test_a_worker_without_a_fingerprint_is_told_to_look_at_its_shim_not_at_the_routers_tokenizer(
    hf_dir: Path,
) -> None:
    # Its shim's probe of the engine failed (a busy vLLM's 503, an SGLang engine): the router's
    # tokenizer may well be right, and its advice to change it was wrong (audit, 2026-12-07).
    watch = FingerprintWatch(tokenizer_fingerprint(load_tokenizer(hf_dir)))
    watch.check(WorkerInfo(worker="w1", model="m", role="agg", engine="vllm", block_size=16, tokenizer=""))
    (why,) = [w["why"] for w in watch.report()["text_refused"]]
    assert why.startswith("its shim registered no tokenizer fingerprint: it could not probe its vllm engine's")
    assert "the shim's log says why" in why and "give the router the tokenizer" not in why
    planner = standalone_planner(
        RouterSettings(), lambda: [], index=BlockIndex(), view=LoadView(), tokenizer=watch.mine
    )
    unprobed = WorkerInfo(worker="w1", model="m", role="agg", engine="sglang", block_size=16)
    assert planner._tokenizer_why(unprobed).startswith("its shim registered no tokenizer fingerprint")
    assert "--tokenizer" not in planner._tokenizer_why(unprobed)


def test_ready_names_the_first_workers_refused_text_and_counts_them_all() -> None:
    """/ready's `tokenizer`: a fleet of another tokenizer made it as long as the fleet (259 KB of the
    360 KB at 1,000 workers); /debug/workers (`report`) still lists every one."""
    watch = FingerprintWatch("builtin")
    for i in range(20):
        watch.check(WorkerInfo(worker=f"w{i:02d}", model="m", role="agg", engine="vllm", block_size=16))
    summary = watch.summary()
    assert [w["worker"] for w in summary["text_refused"]] == [f"w{i:02d}" for i in range(8)]
    assert summary["text_refused_total"] == 20 and summary["router"] == "builtin"
    assert "--tokenizer" in summary["text_refused"][0]["why"]
    assert len(watch.report()["text_refused"]) == 20


def test_the_fleet_summary_counts_each_kind_of_reason_not_one_tokenizer_cause(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The summary of the workers past the first named said "their tokenizers differ" whatever their
    reasons: a fleet of shims that only predate the probes, or registered no fingerprint, was
    pointed at --tokenizer at ERROR (audit of 2026-12-08)."""
    watch = FingerprintWatch("tok-new", legacy="tok-old")

    def info(worker: str, tokenizer: str) -> WorkerInfo:
        return WorkerInfo(worker=worker, model="m", role="agg", engine="vllm", block_size=16, tokenizer=tokenizer)

    with caplog.at_level(logging.ERROR, logger="router.tokenization"):
        for i in range(NAMED_AT_MOST + 3):  # the first named, then three held: the old probes' fingerprint
            watch.check(info(f"w{i:02d}", "tok-old"))
        watch.check(info("x0", ""))
        watch.check(info("x1", ""))
        watch.check(info("y0", "tok-other"))
        watch._lines.flush()
        # the window goes on: the next summary counts only the workers held since the last
        watch.check(info("z0", "tok-old"))
        for i in range(NAMED_AT_MOST):
            watch.check(info(f"z{i + 1}", "tok-other"))
        watch._lines.flush()
    said = [r.getMessage() for r in caplog.records]
    assert all("predate" in line for line in said[:NAMED_AT_MOST])
    tail = " (/ready counts them; /debug/workers gives each one's reason and its fix)"
    assert said[NAMED_AT_MOST:] == [
        "and 6 more workers: get no text prompts from this router: their shims predate the "
        f"{PROBES_SINCE} tokenizer probe set (upgrade them) (3); their shims registered no tokenizer "
        f"fingerprint (the shims' logs say why) (2); their tokenizers differ from its tok-new (1){tail}",
        "and 9 more workers: get no text prompts from this router: their tokenizers differ from its tok-new (8); "
        f"their shims predate the {PROBES_SINCE} tokenizer probe set (upgrade them) (1){tail}",
    ]


def test_a_tool_call_vllm_would_refuse_is_a_named_error(hf_dir: Path) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": None, "tool_calls": [{"type": "retrieval", "retrieval": {}}]},
    ]
    with pytest.raises(TokenizerError) as err:
        load_tokenizer(hf_dir).encode_chat(messages)
    assert err.value.what == "messages[1].tool_calls" and "type 'function'" in err.value.why


def test_special_tokens_come_from_special_tokens_map_too(hf_dir: Path) -> None:
    # transformers (so vLLM) reads special_tokens_map.json as well: an eos_token declared only
    # there closes assistant turns (the Llama-2/Mistral style), and the engine's ids have it.
    config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    del config["eos_token"]
    config["chat_template"] = (
        "{% for m in messages %}{{ m['content'] }} "
        "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
    )
    (hf_dir / "tokenizer_config.json").write_text(json.dumps(config))
    (hf_dir / "special_tokens_map.json").write_text(json.dumps({"eos_token": {"content": "</s>", "lstrip": False}}))
    chat = [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "world"},
        {"role": "user", "content": "hello"},
    ]
    assert load_tokenizer(hf_dir).encode_chat(chat) == [3, 4, VOCAB["</s>"], 3]


def test_templates_that_differ_only_in_assistant_turns_differ_in_fingerprint(hf_dir: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    (other / "tokenizer.json").write_bytes((hf_dir / "tokenizer.json").read_bytes())
    config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE.replace(
        "{{ m['content'] }} |", "{{ m['content'] }} {% if m['role'] != 'assistant' %}|{% endif %}"
    )
    (other / "tokenizer_config.json").write_text(json.dumps(config))
    assert tokenizer_fingerprint(load_tokenizer(other)) != tokenizer_fingerprint(load_tokenizer(hf_dir))


async def test_a_chat_template_that_renders_nothing_is_refused_as_vllm_does(hf_dir: Path) -> None:
    """Before: the empty prompt was routed (and crashed the ledger on a sliding-window worker: a 500)."""
    tok = Tokenization(load_tokenizer(hf_dir), trust_request_template=True)
    try:
        body = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "chat_template": "{{ '' }}"}
        with pytest.raises(ApiError) as err:
            await prompt_ids(tok, parse_request(body, chat=True))
        assert (err.value.code, err.value.message, err.value.param) == (400, "The decoder prompt cannot be empty", None)
    finally:
        tok.close()
