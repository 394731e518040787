"""Prompt text to token ids and back: the built-in tokenizer by default, a Hugging Face one with
`--tokenizer PATH`.

PATH is a `tokenizer.json` or a directory holding one; the chat template comes from the
`tokenizer_config.json` beside it (`chat_template`, rendered with jinja2 in a sandbox, as
transformers does). The built-in tokenizer (protocol.tokenizer) is what engine_sim speaks, so
the router and simulated engines agree on ids without any download.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HfRawTokenizer

from protocol.fingerprint import BUILTIN, PROBE_MESSAGES, PROBE_TEXT, fingerprint
from protocol.tokenizer import BuiltinTokenizer, apply_chat_template

__all__ = [
    "BuiltinPromptTokenizer",
    "HfPromptTokenizer",
    "IncrementalDetokenizer",
    "PromptTokenizer",
    "TokenizerError",
    "load_tokenizer",
    "tokenizer_fingerprint",
]

Messages = Sequence[Mapping[str, Any]]


class TokenizerError(ValueError):
    """A tokenizer could not be loaded, or a chat could not be rendered."""

    def __init__(self, what: str, why: str) -> None:
        self.what = what
        self.why = why
        super().__init__(f"{what}: {why}")


class PromptTokenizer(Protocol):
    name: str

    def encode(self, text: str) -> list[int]: ...
    def encode_chat(self, messages: Messages) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...


class BuiltinPromptTokenizer:
    name = BuiltinTokenizer.name

    def __init__(self) -> None:
        self._tok = BuiltinTokenizer()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text)

    def encode_chat(self, messages: Messages) -> list[int]:
        try:
            return self._tok.encode(apply_chat_template(messages))
        except ValueError as exc:
            raise TokenizerError("messages", str(exc)) from exc

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([i for i in ids if 0 <= i < self._tok.vocab_size])


def _special(value: object) -> str:
    if isinstance(value, Mapping):
        return str(value.get("content", ""))
    return value if isinstance(value, str) else ""


def _raise(message: str) -> None:
    raise TokenizerError("chat_template", message)


class HfPromptTokenizer:
    """A Hugging Face `tokenizers` tokenizer plus its chat template."""

    def __init__(self, path: str | Path) -> None:
        p = Path(path)
        file = p / "tokenizer.json" if p.is_dir() else p
        if not file.is_file():
            raise TokenizerError(str(path), "no tokenizer.json there")
        try:
            self._tok = HfRawTokenizer.from_file(str(file))
        except Exception as exc:  # the Rust side raises plain Exception for a bad file
            raise TokenizerError(str(file), f"not a tokenizers JSON: {exc}") from exc
        self.name = str(file.parent.name or file.name)
        config = _read_config(file.parent / "tokenizer_config.json")
        self._bos = _special(config.get("bos_token"))
        self._eos = _special(config.get("eos_token"))
        template = config.get("chat_template")
        if isinstance(template, list):  # the named-template form: take "default"
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        self._template: jinja2.Template | None = None
        if isinstance(template, str):
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            try:
                self._template = env.from_string(template)
            except jinja2.TemplateError as exc:
                raise TokenizerError("chat_template", f"does not compile: {exc}") from exc

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=True).ids)

    def encode_chat(self, messages: Messages) -> list[int]:
        if self._template is None:
            raise TokenizerError("chat_template", f"tokenizer {self.name} has none; use /v1/completions")
        try:
            text = self._template.render(
                messages=list(messages), add_generation_prompt=True, bos_token=self._bos, eos_token=self._eos
            )
        except jinja2.TemplateError as exc:
            raise TokenizerError("chat_template", f"cannot render these messages: {exc}") from exc
        # The template writes the special tokens itself, as transformers' apply_chat_template does.
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=True))


def _read_config(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise TokenizerError(str(path), f"unreadable: {exc}") from exc
    return data if isinstance(data, dict) else {}


def tokenizer_fingerprint(tok: PromptTokenizer) -> str:
    """What the router's tokenizer must equal in a worker's record for text prompts to go there
    (protocol.fingerprint): `builtin` for the built-in vocabulary, else the probes' fingerprint."""
    if isinstance(tok, BuiltinPromptTokenizer):
        return BUILTIN
    try:
        chat: list[int] | None = tok.encode_chat(PROBE_MESSAGES)
    except TokenizerError:
        chat = None
    return fingerprint(tok.encode(PROBE_TEXT), chat)


def load_tokenizer(path: str | Path | None) -> PromptTokenizer:
    return BuiltinPromptTokenizer() if path is None else HfPromptTokenizer(path)


class IncrementalDetokenizer:
    """Turns a growing list of ids into text deltas, as vLLM's detokenizer does: each step decodes
    only a window from the last emitted boundary, so long outputs cost O(n). A trailing partial
    UTF-8 character (decoded as U+FFFD) is held back until the tokens that complete it arrive."""

    def __init__(self, tokenizer: PromptTokenizer) -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # window start: context for tokenizers whose pieces depend on neighbours
        self._read = 0  # ids[:_read] are already emitted

    def push(self, ids: Sequence[int], *, final: bool = False) -> str:
        self._ids.extend(ids)
        window = self._ids[self._prefix :]
        emitted = self._tok.decode(self._ids[self._prefix : self._read])
        text = self._tok.decode(window)
        if not final and text.endswith("\ufffd"):
            return ""
        delta = text[len(emitted) :] if text.startswith(emitted) else text
        self._prefix, self._read = self._read, len(self._ids)
        return delta
