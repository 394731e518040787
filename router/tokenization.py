"""Prompt text to token ids, exactly as the served model's engine tokenizes it, or not at all.

`--tokenizer` names the served model's tokenizer: a `tokenizer.json`, a directory holding one, or
a Hugging Face model id found in the local hub cache (`$HF_HUB_CACHE`, `$HF_HOME/hub`,
`~/.cache/huggingface/hub`: the snapshot `refs/main` points at; nothing is downloaded). The chat
template comes from beside it (`chat_template.jinja` and `additional_chat_templates/NAME.jinja`,
else `tokenizer_config.json`'s `chat_template`, else `chat_template.json`); of named templates,
`tool_use` renders a request with tools and `default` the rest, as transformers picks them. It is
rendered with jinja2 in a sandbox the way
transformers renders it (its `tojson`, `raise_exception`, `strftime_now`, the `generation` tag,
`continue_final_message`). The special tokens the tokenizer's config names and tokenizer.json lacks
are added at load, as transformers adds them (router.special_tokens); where transformers builds a
class with a pipeline of its own (LlamaTokenizer, CodeLlamaTokenizer, Qwen2Tokenizer, GemmaTokenizer)
that pipeline is built over tokenizer.json's vocabulary, and a WARNING is said where it builds one
the router cannot (router.tokenizer_class). Without `--tokenizer` the
router has the built-in tokenizer, which only engine_sim speaks.

Whether the router's tokenizer is a worker's is decided by fingerprints (protocol.fingerprint):
the planner sends text prompts only to workers whose fingerprint equals the router's, and
`FingerprintWatch` says once per worker, at ERROR, which workers will get no text prompt and why: a
worker whose shim predates the present probe set (protocol.fingerprint.PROBES_SINCE) is told apart
from one with another tokenizer by the fingerprint the old probes give this router's tokenizer.
That fingerprint follows the clock, as the engine's does: a template may write today's date
(Llama 3.2's "Today Date:", from `strftime_now`), and vLLM's `/tokenize` renders the probes with its
own, so the router takes its tokenizer's fingerprint on each of several days (`fingerprints_on`,
router.fingerprint_days). The rendering digest replicas compare (router.peer_settings) is of `rendering_fingerprint`,
the template's clock pinned to RENDERING_NOW, so equal files give an equal digest on any day.
A chat prompt's ids serve routing only: the engine renders the messages itself.

Large prompts are tokenized off the event loop (`Tokenization`): Hugging Face's `encode_batch`
releases the GIL; the built-in tokenizer is run line by line (every line break is a piece of its
own, so the ids are the same) so the loop gets the GIL between lines.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import datetime
import functools
import heapq
import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple, Protocol, cast

import jinja2
import msgspec
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HfRawTokenizer

from protocol.fingerprint import BUILTIN, PROBES, PROBES_SINCE, ChatProbe, Probe, fingerprint, legacy_fingerprint
from protocol.messages import WorkerInfo
from protocol.tokenizer import BuiltinTokenizer, apply_chat_template
from router.content_format import CONTENT_FORMATS, ContentFormat, detect_content_format
from router.conversation import ConversationError, conversation, tool_definitions
from router.eligibility import NAMED_AT_MOST, few_ids
from router.fingerprint_days import FingerprintDays
from router.fleet_lines import FleetLines, FleetLog, LastSaid
from router.special_tokens import SpecialTokensError, read_special_tokens
from router.tokenizer_class import AS_IS, REBUILT, TokenizerClassError, bos_post_processor, class_for, rebuild

__all__ = [
    "OFFLOAD_CHARS",
    "RENDERING_NOW",
    "BuiltinPromptTokenizer",
    "ChatOptions",
    "FingerprintWatch",
    "Fingerprints",
    "HfPromptTokenizer",
    "PromptTokenizer",
    "Tokenization",
    "TokenizerError",
    "fingerprints_on",
    "load_tokenizer",
    "probe_ids",
    "rendering_fingerprint",
    "resolve_tokenizer_path",
    "shim_predates_probes",
    "tokenizer_fingerprint",
    "tokenizer_fingerprints",
    "unprobed",
]

log = logging.getLogger(__name__)
Messages = Sequence[Mapping[str, Any]]
OFFLOAD_CHARS = 32 * 1024  # texts longer than this are tokenized on a worker thread
_SEGMENT_CHARS = 64 * 1024
# What a template's `strftime_now` gives while `rendering_fingerprint` probes it: any fixed time
# (this is Llama 3.1's own fallback date); otherwise the date the router started on.
RENDERING_NOW = datetime.datetime(2024, 7, 26)
_pinned_now: contextvars.ContextVar[datetime.datetime | None] = contextvars.ContextVar("pinned_now", default=None)


class TokenizerError(ValueError):
    """A tokenizer could not be loaded, or a chat could not be rendered."""

    def __init__(self, what: str, why: str) -> None:
        self.what = what
        self.why = why
        super().__init__(f"{what}: {why}")


@dataclass(frozen=True, slots=True)
class ChatOptions:
    """What a chat request says about rendering its messages (vLLM's names and defaults)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[Any] | None = None
    tool_choice: Any = None
    # `tools` from chat_template_kwargs: vLLM renders these as sent, in place of `tools`
    raw_tools: Any = None
    documents: Any = None
    # the client's own: a string, or whatever chat_template_kwargs held (refused as vLLM refuses it)
    chat_template: Any = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    add_special_tokens: bool = False


class PromptTokenizer(Protocol):
    name: str
    # why its ids may differ from the engine's, where it knows (FingerprintWatch says it); else None
    caveat: str | None
    # the JSON size of what its template is given on every chat besides the request's own (the
    # --default-chat-template-kwargs): Tokenization counts it in a chat's size
    template_defaults_size: int

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def encode_chat(self, messages: Messages, options: ChatOptions = ...) -> list[int]: ...
    def encode_large(self, text: str, add_special_tokens: bool) -> list[int]:
        """`encode`, written to leave the GIL to other threads while it runs."""
        ...


class BuiltinPromptTokenizer:
    """protocol.tokenizer's vocabulary (engine_sim's): it adds no special tokens, and its chat
    template is ChatML (`continue_final_message` leaves the last message open, as the sim does)."""

    name = BuiltinTokenizer.name
    caveat: str | None = None
    template_defaults_size = 0  # its ChatML takes no defaults

    def __init__(self) -> None:
        self._tok = BuiltinTokenizer()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text)

    def encode_large(self, text: str, add_special_tokens: bool) -> list[int]:
        # Every line break is a piece of its own in the built-in split, so encoding line by line
        # gives the same ids, and the GIL can pass to the event loop between segments.
        ids: list[int] = []
        segment: list[str] = []
        size = 0
        for line in text.splitlines(keepends=True):
            segment.append(line)
            size += len(line)
            if size >= _SEGMENT_CHARS:
                ids += self._tok.encode("".join(segment))
                segment, size = [], 0
        if segment:
            ids += self._tok.encode("".join(segment))
        return ids

    def encode_chat(self, messages: Messages, options: ChatOptions = ChatOptions()) -> list[int]:
        if options.chat_template is not None:
            # ChatML in its place would route on a prompt the engine never sees.
            raise TokenizerError(
                "chat_template",
                "the built-in tokenizer renders ChatML only, and engine_sim refuses a request's own template "
                "(as vLLM does without --trust-request-chat-template); give the router the served model's "
                "--tokenizer to route such requests",
            )
        try:
            text = apply_chat_template(
                messages, add_generation_prompt=options.add_generation_prompt and not options.continue_final_message
            )
        except (ValueError, AttributeError) as exc:
            raise TokenizerError("messages", str(exc)) from exc
        if options.continue_final_message:
            text = text.removesuffix("<|im_end|>\n")
        return self._tok.encode(text)


def _raise(message: str) -> None:
    raise TokenizerError("chat_template", message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:  # fmt: skip
    # transformers' filter: jinja2's own escapes HTML characters and sorts keys.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return (_pinned_now.get() or datetime.datetime.now()).strftime(fmt)


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` (transformers marks assistant tokens with it):
    renders its body."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _GenerationTag])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = _strftime_now
    return env


class HfPromptTokenizer:
    """A Hugging Face `tokenizers` tokenizer plus its chat template."""

    def __init__(
        self, path: str | Path, content_format: str = "auto", default_kwargs: Mapping[str, Any] | None = None
    ) -> None:
        if content_format not in CONTENT_FORMATS:
            raise TokenizerError("chat_template_content_format", f"one of {', '.join(CONTENT_FORMATS)}")
        # None: detected per template, as vLLM's `auto` does
        self.content_format = None if content_format == "auto" else cast(ContentFormat, content_format)
        file = resolve_tokenizer_path(path)
        try:
            self._tok = HfRawTokenizer.from_file(str(file))
        except Exception as exc:  # the Rust side raises plain Exception for a bad file
            raise TokenizerError(str(file), f"not a tokenizers JSON: {exc}") from exc
        config = _read_json(file.parent / "tokenizer_config.json")
        self.caveat: str | None = None
        try:
            specials = self._as_transformers_builds(str(path), file, config)
        except (TokenizerClassError, SpecialTokensError) as exc:
            raise TokenizerError(exc.what, exc.why) from exc
        self.name = str(path)
        self._specials = specials
        self._specials.setdefault("bos_token", "")
        self._specials.setdefault("eos_token", "")
        self._env = _environment()
        templates = _chat_templates(file.parent, config)
        # one template, or transformers' named ones (`default`, `tool_use`, ...)
        self._source = templates if isinstance(templates, str) else None
        self._named = templates if isinstance(templates, dict) else {}
        self._templates = {s: self._compile(s) for s in [*self._named.values(), self._source] if s is not None}
        # vLLM's --default-chat-template-kwargs: under a request's own, over the special tokens;
        # its tools and documents count where the request gives none
        defaults = dict(default_kwargs or {})
        self.template_defaults_size = len(msgspec.json.encode(defaults))
        self._default_tools = defaults.pop("tools", None)
        self._default_documents = defaults.pop("documents", None)
        self._defaults = defaults

    def _as_transformers_builds(self, name: str, file: Path, config: Mapping[str, Any]) -> dict[str, str]:
        """Make `_tok`, loaded from `file` as saved, the tokenizer transformers 5 builds for `name`
        (whose tokenizer_config.json is `config`): its class's pipeline, its special tokens added;
        their spellings, what the template sees."""
        folder = file.parent
        built = class_for(name, config, folder)
        own = REBUILT.get(built)
        specials = read_special_tokens(folder, config, self._tok.get_added_tokens_decoder(), own)
        if own is not None:
            # transformers 5 builds the class from the vocabulary with its own pipeline
            self._tok = rebuild(built, file, self._tok, config, specials.spellings)
            log.info(
                "%s names %s: its tokenizer is built from %s's vocabulary and merges with %s's own pipeline, as "
                "transformers 5 (so vLLM) builds it (router.tokenizer_class)",
                folder / "tokenizer_config.json",
                config["tokenizer_class"],
                file,
                built,
            )
        elif built != AS_IS:
            named = config["tokenizer_class"]
            by_type = (
                f" and {folder / 'config.json'} the model type of {built}"
                if named.removesuffix("Fast") != built
                else ""
            )
            self.caveat = (
                f"{folder / 'tokenizer_config.json'} names {named}{by_type}, which transformers 5 (so vLLM) builds "
                f"with that class's own pipeline (over {file}'s vocabulary, or from files of its own), where this "
                "router takes the file's as saved; ids may differ. Where they do, every worker serving this "
                "tokenizer is refused text prompts by fingerprint (token-id prompts still route), and no other "
                "--tokenizer mends it: save the tokenizer as the engine loads it (transformers' "
                "AutoTokenizer.from_pretrained, then save_pretrained) and give the router that"
            )
            log.warning("%s", self.caveat)
        # The file's `truncation` and `padding` sections (save_pretrained writes them after a call
        # that truncated or padded) would cut or pad every prompt; transformers, so vLLM, turns
        # both off for a plain encode.
        self._tok.no_truncation()
        self._tok.no_padding()
        # transformers' flag: special tokens' spellings in a text are encoded as plain text
        self._tok.encode_special_tokens = config.get("split_special_tokens") is True
        # transformers adds the special tokens the config names and tokenizer.json lacks (vLLM's ids
        # have them); their spellings are what the template sees
        self._tok.add_tokens(specials.to_add)
        if own is not None and own.bos_only:
            self._tok.post_processor = bos_post_processor(self._tok, specials.spellings.get("bos_token"))
        return specials.spellings

    def _compile(self, source: str) -> jinja2.Template:
        try:
            return self._env.from_string(source)
        except jinja2.TemplateError as exc:
            raise TokenizerError("chat_template", f"does not compile: {exc}") from exc

    @functools.lru_cache(maxsize=16)  # noqa: B019 (one tokenizer per router, kept for its life)
    def _request_template(self, source: str) -> jinja2.Template:
        return self._compile(source)

    def _resolve_template(self, requested: str | None, tools: Any) -> str:
        """The template source vLLM renders with (transformers' `get_chat_template`): a request's
        template, or the name of one of the named ones; else `tool_use` where tools are given and
        there is one, else `default`."""
        if requested:
            return self._named.get(requested, requested)
        if self._named:
            name = "tool_use" if tools is not None and "tool_use" in self._named else "default"
            if name in self._named:
                return self._named[name]
            raise TokenizerError(
                "chat_template",
                f"tokenizer {self.name} has named chat templates ({', '.join(sorted(self._named))}) and none is "
                "`default`, which renders a chat that names none",
            )
        if self._source is not None:
            return self._source
        raise TokenizerError("chat_template", f"tokenizer {self.name} has none; use /v1/completions")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def encode_large(self, text: str, add_special_tokens: bool) -> list[int]:
        # encode_batch lets go of the GIL while it runs; encode does not.
        return list(self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)

    def render_chat(self, messages: Messages, options: ChatOptions = ChatOptions()) -> str:
        tools = tool_definitions(options.tools) if options.raw_tools is None else options.raw_tools
        if tools is None:
            tools = self._default_tools
        documents = self._default_documents if options.documents is None else options.documents
        source = self._resolve_template(options.chat_template, tools)
        template = self._templates[source] if source in self._templates else self._request_template(source)
        fmt = self.content_format or detect_content_format(self._env, source)
        try:
            msgs = conversation(messages, source, fmt)
        except ConversationError as exc:
            raise TokenizerError(exc.where, exc.why) from exc
        final = _mark_final(msgs, source) if options.continue_final_message else None
        # transformers' checks on what a client may pass unvalidated through chat_template_kwargs
        if options.raw_tools is not None and not _all_dicts(options.raw_tools):
            raise TokenizerError(
                "tools",
                "Tools should either be a JSON schema, or a callable function with type hints and a docstring "
                "suitable for auto-conversion to a schema.",
            )
        if documents is not None and not _all_dicts(documents):
            raise TokenizerError("documents", "Documents should be a list of dicts with 'title' and 'text' keys!")
        try:
            text = template.render(
                messages=msgs,
                tools=tools,
                documents=documents,
                add_generation_prompt=options.add_generation_prompt and not options.continue_final_message,
                # transformers' order: the request's kwargs override the special tokens
                **{**self._specials, **self._defaults, **options.chat_template_kwargs},
            )
        except Exception as exc:  # a template is code: 1/0, range(10**9) or recursion too are the request's fault
            raise TokenizerError("chat_template", f"cannot render these messages: {type(exc).__name__}: {exc}") from exc
        return text if final is None else _cut_at_mark(text, final)

    def encode_chat(self, messages: Messages, options: ChatOptions = ChatOptions()) -> list[int]:
        # The template writes the special tokens itself (add_special_tokens False, vLLM's default).
        text = self.render_chat(messages, options)
        # A long text comes of a chat given much (the defaults too), which Tokenization.encode_chat
        # sends to the pool: there, leave the loop the GIL.
        if len(text) > OFFLOAD_CHARS:
            return self.encode_large(text, options.add_special_tokens)
        return self.encode(text, options.add_special_tokens)


def _all_dicts(value: Any) -> bool:
    try:
        return all(isinstance(x, dict) for x in value)
    except TypeError:  # not iterable
        return False


# transformers' (5.x) way to continue the final message: render it with a mark after its text,
# then cut the chat at the mark, keeping the message's own trailing space where the template does.
_FINAL_MARK = "CONTINUE_FINAL_MESSAGE_TAG "


def _mark_final(msgs: list[dict[str, Any]], template: str) -> str:
    """Append the mark to the final message's text (the last text part of a list); that text."""
    content = msgs[-1].get("content") if msgs else None
    if content is None:
        raise TokenizerError("continue_final_message", "the final message has no content to continue")
    if "content" not in template:
        raise TokenizerError("continue_final_message", "the chat template does not render message content")
    if isinstance(content, list):
        for part in reversed(content):
            if isinstance(part, dict) and "text" in part:
                final = part["text"]
                part["text"] = final + _FINAL_MARK
                return str(final)
        raise TokenizerError("continue_final_message", "the final message has no text to continue")
    if not isinstance(content, str):
        raise TokenizerError("continue_final_message", "the final message's content is neither text nor parts")
    msgs[-1]["content"] = content + _FINAL_MARK
    return content


def _cut_at_mark(text: str, final: str) -> str:
    if final.strip() not in text or _FINAL_MARK.strip() not in text:
        raise TokenizerError("continue_final_message", "the final message is not in the rendered chat")
    at = text.rindex(_FINAL_MARK.strip())
    return text[:at] if text[at : at + len(_FINAL_MARK)] == _FINAL_MARK else text[:at].rstrip()


def _chat_templates(folder: Path, config: Mapping[str, Any]) -> str | dict[str, str] | None:
    # As transformers loads them: template files win over the config's; `chat_template.jinja` is
    # `default`, each additional_chat_templates/NAME.jinja (its save_pretrained's layout for named
    # templates) the template NAME.
    files = {"default": folder / "chat_template.jinja"} if (folder / "chat_template.jinja").is_file() else {}
    extra = folder / "additional_chat_templates"
    if extra.is_dir():
        files |= {f.name.removesuffix(".jinja"): f for f in sorted(extra.glob("*.jinja"))}
    if files:
        named = {name: f.read_text() for name, f in files.items()}
        return named["default"] if list(named) == ["default"] else named
    template = config.get("chat_template")
    if template is None:
        template = _read_json(folder / "chat_template.json").get("chat_template")
    if isinstance(template, list):  # the named-template form, [{"name": ..., "template": ...}]
        return {
            t["name"]: t["template"]
            for t in template
            if isinstance(t, Mapping) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)
        }
    return template if isinstance(template, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise TokenizerError(str(path), f"unreadable: {exc}") from exc
    return data if isinstance(data, dict) else {}


def _hub_caches() -> list[Path]:
    env = os.environ
    out = [Path(env[k]) for k in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE") if env.get(k)]
    home = env.get("HF_HOME")
    out.append(Path(home) / "hub" if home else Path.home() / ".cache" / "huggingface" / "hub")
    return out


# How a path no model id can be is written: a Hugging Face id is `org/name` or `name`
_PATH_PREFIXES = ("/", "./", "../", "~")


def resolve_tokenizer_path(spec: str | Path) -> Path:
    """The tokenizer.json that `spec` names: the file, a directory holding one, or a model id's
    snapshot in the local Hugging Face hub cache. TokenizerError naming where it looked; a missing
    path (a Path, or text that starts as a path does or ends in .json) is missing, not a model id
    to look up and download."""
    p = Path(spec).expanduser()
    if p.is_file():
        return p
    if p.is_dir():
        if (p / "tokenizer.json").is_file():
            return p / "tokenizer.json"
        raise TokenizerError(str(spec), "no tokenizer.json there")
    if isinstance(spec, Path) or spec.startswith(_PATH_PREFIXES) or spec.endswith(".json"):
        raise TokenizerError(str(spec), f"no such file or directory: {p.absolute()}")
    looked = []
    for cache in _hub_caches():
        repo = cache / ("models--" + str(spec).replace("/", "--"))
        looked.append(str(repo))
        if not repo.is_dir():
            continue
        ref = repo / "refs" / "main"
        snapshots = repo / "snapshots"
        if ref.is_file():
            snap = snapshots / ref.read_text().strip()
        else:
            found = sorted(snapshots.iterdir()) if snapshots.is_dir() else []
            if len(found) != 1:
                raise TokenizerError(str(spec), f"{repo} has {len(found)} snapshots and no refs/main: give the path")
            snap = found[0]
        if (snap / "tokenizer.json").is_file():
            return snap / "tokenizer.json"
        raise TokenizerError(str(spec), f"the cached snapshot {snap} has no tokenizer.json")
    raise TokenizerError(
        str(spec),
        "not a file, a directory or a model in the local Hugging Face cache (looked in "
        + ", ".join(looked)
        + "): download it first with every file beside tokenizer.json that decides its ids or chat template "
        + "(tokenizer_config.json, special_tokens_map.json, added_tokens.json, config.json, chat_template.jinja or "
        + ".json, additional_chat_templates/): `hf download MODEL --include '*.json' --include '*.jinja'`",
    )


class Fingerprints(NamedTuple):
    """A tokenizer's fingerprint (`current`), and the one a shim older than the probe set of
    protocol.fingerprint.PROBES_SINCE advertises for the same tokenizer (`legacy`; None for the
    built-in vocabulary, which such shims advertised as `builtin` too)."""

    current: str
    legacy: str | None


def tokenizer_fingerprints(tok: PromptTokenizer) -> Fingerprints:
    """The router's tokenizer's fingerprints, both from one run of the probes."""
    if isinstance(tok, BuiltinPromptTokenizer):
        return Fingerprints(BUILTIN, None)
    results = [probe_ids(tok, probe) for probe in PROBES]
    return Fingerprints(fingerprint(results), legacy_fingerprint(results))


def fingerprints_on(tok: PromptTokenizer, day: datetime.date) -> Fingerprints:
    """`tokenizer_fingerprints` with the template's clock at noon on `day`: what an engine probed on
    that day in its own time zone advertises (router.fingerprint_days). Safe on a thread: the pin is
    the calling context's alone."""
    token = _pinned_now.set(datetime.datetime(day.year, day.month, day.day, 12))
    try:
        return tokenizer_fingerprints(tok)
    finally:
        _pinned_now.reset(token)


def rendering_fingerprint(tok: PromptTokenizer) -> str:
    """`tokenizer_fingerprint` with the template's clock at RENDERING_NOW: what replicas compare
    (router.peer_settings.rendering_digest), equal for equal files on any day and in any time zone.
    Not a worker's: the engine renders the probes at its own time."""
    token = _pinned_now.set(RENDERING_NOW)
    try:
        return tokenizer_fingerprint(tok)
    finally:
        _pinned_now.reset(token)


def tokenizer_fingerprint(tok: PromptTokenizer) -> str:
    """What the router's tokenizer must equal in a worker's record for text prompts to go there
    (protocol.fingerprint): `builtin` for the built-in vocabulary, else the probes' fingerprint."""
    return tokenizer_fingerprints(tok).current


def shim_predates_probes(workers: Sequence[str]) -> str:
    """Why `workers` get no text prompts when each advertises this router's tokenizer under the
    probes of before PROBES_SINCE: their shims are older, not their tokenizer another. Not taken for
    a match: the old probes cannot tell apart tokenizers the new ones do."""
    one = len(workers) == 1
    named = f"worker{'' if one else 's'} {few_ids(workers)}"
    return (
        f"the shim{'' if one else 's'} of {named} predate{'s' if one else ''} the {PROBES_SINCE} tokenizer "
        f"probe set, and the fingerprint {'it advertises' if one else 'they advertise'} is this router's "
        "tokenizer's under the old probes, which cannot tell apart tokenizers the new ones do: upgrade the "
        f"shim{'' if one else 's'} of {named} (docs/deployment.md, Upgrades); text prompts resume as each "
        "registers again (token-id prompts still route)"
    )


def unprobed(info: WorkerInfo) -> str:
    """Why a worker that registered no tokenizer fingerprint ("") gets no text prompts: its shim,
    not this router's tokenizer, is where to look (a vLLM shim probes again an engine that failed
    the probe for now, worker_shim.tokenizer_probe)."""
    return (
        f"its shim registered no tokenizer fingerprint: it could not probe its {info.engine} engine's tokenizer "
        "(the shim's log says why; a shim probes again an engine that failed the probe for now, and the worker "
        "takes text prompts once one succeeds; SGLang and TensorRT-LLM engines cannot be probed), so no router "
        "tokenizes for it (token-id prompts still route)"
    )


def probe_ids(tok: PromptTokenizer, probe: Probe) -> list[int] | None:
    """`probe`'s ids as the engine's `/tokenize` gives them for `probe.body()`; None where the
    engine refuses it (a chat the template cannot render, or no template)."""
    if not isinstance(probe, ChatProbe):
        return tok.encode(probe.prompt, probe.add_special_tokens)
    tools = None if probe.tools is None else list(probe.tools)
    try:
        return tok.encode_chat(
            probe.messages, ChatOptions(add_generation_prompt=probe.add_generation_prompt, tools=tools)
        )
    except TokenizerError:
        return None


def load_tokenizer(
    path: str | Path | None, content_format: str = "auto", default_kwargs: Mapping[str, Any] | None = None
) -> PromptTokenizer:
    """The tokenizer at `path` (the built-in one for None); `content_format` and `default_kwargs`
    are vLLM's `--chat-template-content-format` (auto, string or openai) and
    `--default-chat-template-kwargs` (the built-in tokenizer's ChatML takes none)."""
    if path is None:
        if default_kwargs:
            raise TokenizerError("default_chat_template_kwargs", "the built-in tokenizer's ChatML takes none")
        return BuiltinPromptTokenizer()
    return HfPromptTokenizer(path, content_format, default_kwargs)


class UntrustedTemplate(TokenizerError):
    """A client sent a chat template of its own, and the router does not trust request templates."""

    def __init__(self) -> None:
        super().__init__(
            "chat_template",
            "Chat template is passed with request, but --trust-request-chat-template is not set. Refused request "
            "with untrusted chat template.",  # vLLM's words (docs/router.md says what to start with the flag)
        )


class Tokenization:
    """The router's tokenizer behind the event loop: small texts inline, large ones on a thread
    of its own pool. `close()` shuts the pool down.

    A client's own chat template is refused unless `trust_request_template` (vLLM's
    `--trust-request-chat-template`, off by default there too): a template is code the router
    would run, and one of a few bytes can loop for minutes. A trusted one renders on the pool, so
    the event loop keeps its turns. `exclude_tools_when_tool_choice_none`: vLLM's flag of that
    name, which the engines' must match."""

    def __init__(
        self,
        tokenizer: PromptTokenizer,
        *,
        offload_chars: int = OFFLOAD_CHARS,
        threads: int = 2,
        trust_request_template: bool = False,
        exclude_tools_when_tool_choice_none: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.offload_chars = offload_chars
        self.trust_request_template = trust_request_template
        self.exclude_tools_when_tool_choice_none = exclude_tools_when_tool_choice_none
        self.offloaded = 0
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvswitch-tokenize")

    async def encode(self, text: str, add_special_tokens: bool = True, *, offload: bool = False) -> list[int]:
        """`offload`: on the pool whatever its length (a batch of prompts each under the bound
        whose sum is over it: inline, they held the loop one after another)."""
        if not offload and len(text) <= self.offload_chars:
            return self.tokenizer.encode(text, add_special_tokens)
        self.offloaded += 1
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self.tokenizer.encode_large, text, add_special_tokens)

    async def encode_chat(self, messages: Messages, options: ChatOptions) -> list[int]:
        if options.chat_template is not None and not self.trust_request_template:
            raise UntrustedTemplate
        if not isinstance(options.chat_template, str | None):  # one in chat_template_kwargs, not typed there
            raise TokenizerError("chat_template_kwargs", "its chat_template must be a string")
        if self.exclude_tools_when_tool_choice_none and options.tool_choice == "none":
            # vLLM renders such a request without its `tools` (chat_template_kwargs' tools stay)
            options = replace(options, tools=None)
        # All the template is given (a part's text under its own key, tool calls, tools, documents,
        # the request's kwargs and the tokenizer's defaults: more than it renders where the request's
        # tools or documents replace the defaults'), as JSON: bytes, not characters, but its order of size.
        given = (messages, options.tools, options.raw_tools, options.documents, options.chat_template_kwargs)
        size = len(msgspec.json.encode(given)) + self.tokenizer.template_defaults_size
        if size <= self.offload_chars and options.chat_template is None:
            return self.tokenizer.encode_chat(messages, options)
        self.offloaded += 1
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self.tokenizer.encode_chat, messages, options)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class FingerprintWatch:
    """Compares each registered worker's tokenizer fingerprint with the router's; says once per
    worker, at ERROR, that it gets no text prompts and how to fix it, and reports the mismatches
    (the first on /ready, every one on /debug/workers). The fix is the router's, so a fleet of
    another tokenizer is said as /ready says it: the first NAMED_AT_MOST workers by name, the rest
    counted by kind of reason (router.fleet_lines); a worker back under its name (a fleet restart)
    with the same mismatch is not said again. Its workers refused are looked at again as days are added
    (`recheck`): one whose engine probed on a day after the router's last takes text prompts from
    midnight on, and /ready and /debug/workers must stop listing it then."""

    def __init__(
        self,
        mine: str | FingerprintDays,
        legacy: str | None = None,
        fleet_log: FleetLog | None = None,
        caveat: str | None = None,
    ) -> None:
        """`mine`: this router's tokenizer's fingerprints by day (router.fingerprint_days), or its one
        fingerprint. `legacy`, with one: its fingerprint under the old probes (`Fingerprints.legacy`); a
        worker that advertises it is refused still, as a shim to upgrade. `fleet_log`: its router's
        (router.fleet_lines). `caveat`: why this router's tokenizer cannot be the engine's
        (`HfPromptTokenizer.caveat`), said to a mismatched worker in place of advice no
        --tokenizer can follow."""
        self.days = mine if isinstance(mine, FingerprintDays) else FingerprintDays.fixed(mine, legacy)
        self.days.on_added(self.recheck)
        self.mine = self.days.current
        self.caveat = caveat
        self._mismatched: dict[str, tuple[WorkerInfo, str]] = {}  # worker -> (its record, why)
        self._said = LastSaid()
        # Each held worker's kind of reason, for its window's summary (one cause said of all sent
        # the operator of old or unprobed shims to --tokenizer)
        self._held: dict[str, str] = {}
        self._lines = FleetLines(log, logging.ERROR, self._summary_cause, fleet_log=fleet_log)

    def check(self, info: WorkerInfo) -> None:
        if self.days.accepts(info.tokenizer):
            self._mismatched.pop(info.worker, None)
            self._said.clear(info.worker)
            return
        why = self._why(info)
        if self._said.news(info.worker, why) and not self._lines.say(
            info.worker,
            "worker %s (model %s) gets no text prompts from this router: %s",
            info.worker,
            info.model,
            why,
        ):
            self._held[info.worker] = self._kind(info)
        self._mismatched[info.worker] = (info, why)

    def forget(self, worker: str) -> None:
        self._mismatched.pop(worker, None)

    def recheck(self) -> None:
        """Days were added: a worker refused may advertise one of them; the others' reasons name the
        new days (said again only when the worker registers anew with it). Until 2026-12-07 a worker was
        judged only as its record came, so one routed text from midnight on stayed listed refused."""
        taken = []
        for worker, (info, _) in list(self._mismatched.items()):
            if self.days.accepts(info.tokenizer):
                del self._mismatched[worker]
                self._said.clear(worker)
                taken.append(worker)
            else:
                self._mismatched[worker] = (info, self._why(info))
        if taken:
            log.info(
                "worker(s) %s take text prompts from this router now: their tokenizer's fingerprint is its on a day "
                "just added",
                few_ids(sorted(taken)),
            )

    def _kind(self, info: WorkerInfo) -> str:
        """`_why`'s kind of reason, as the summary counts it."""
        if self.days.is_legacy(info.tokenizer):
            return f"their shims predate the {PROBES_SINCE} tokenizer probe set (upgrade them)"
        if not info.tokenizer:
            return "their shims registered no tokenizer fingerprint (the shims' logs say why)"
        return f"their tokenizers differ from its {self.mine}"

    def _summary_cause(self, workers: int) -> str:
        kinds = collections.Counter(self._held.values())
        self._held.clear()
        return (
            "get no text prompts from this router: "
            + "; ".join(f"{kind} ({n})" for kind, n in kinds.most_common())
            + " (/ready counts them; /debug/workers gives each one's reason and its fix)"
        )

    def _why(self, info: WorkerInfo) -> str:
        if self.days.is_legacy(info.tokenizer):
            return shim_predates_probes([info.worker])
        if not info.tokenizer:
            if self.mine != BUILTIN:
                return unprobed(info)
            return (
                f"{unprobed(info)}; and this router has only the built-in tokenizer (engine_sim's): unless "
                f"{info.model} is served by engine_sim, start the router with --tokenizer naming its tokenizer"
            )
        theirs = info.tokenizer
        if self.mine == BUILTIN:
            return (
                f"its engine's tokenizer is {theirs} and this router has only the built-in one (engine_sim's): "
                f"start the router with --tokenizer naming {info.model}'s tokenizer (token-id prompts still route)"
            )
        other = self.caveat or (
            f"give the router the tokenizer {info.model} is served with, and the engine's "
            f"--default-chat-template-kwargs if it has any, or, when this router's other models need its tokenizer, "
            f"run {info.model} a router of its own (--model {info.model} --tokenizer ...; token-id prompts still route)"
        )
        if note := self.days.note():
            return f"its tokenizer is {theirs}, the router's is {self.mine}; {note}. Else it is another: {other}"
        return f"its tokenizer is {theirs}, the router's is {self.mine}: {other}"

    def report(self) -> dict[str, Any]:
        return {
            "router": self.mine,
            "text_refused": [{"worker": w, "why": why} for w, (_, why) in sorted(self._mismatched.items())],
        }

    def summary(self) -> dict[str, Any]:
        """`report` as /ready gives it: the first NAMED_AT_MOST workers by name and how many in all,
        so that a fleet of another tokenizer does not make every probe as long as the fleet."""
        named = heapq.nsmallest(NAMED_AT_MOST, self._mismatched)
        return {
            "router": self.mine,
            "text_refused": [{"worker": w, "why": self._mismatched[w][1]} for w in named],
            "text_refused_total": len(self._mismatched),
        }
