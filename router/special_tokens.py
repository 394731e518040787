"""A Hugging Face tokenizer's special tokens, read from its files as transformers 5 reads them
(vLLM loads a tokenizer through its AutoTokenizer; matched against transformers 5.24.0 and 5.19.0,
vLLM 0.32 requiring >=5.16.1,<5.20.0): the spellings a chat template sees, and the tokens
transformers adds at load. This reading of the files is `from_pretrained`'s and TokenizersBackend's,
which every tokenizer class shares; the tokenizer they are added to need not be tokenizer.json's as
saved: a class with an `__init__` of its own rebuilds it from the vocabulary with its own pipeline,
with no added tokens, and its own defaults for the special tokens the config does not name
(router.tokenizer_class: LlamaTokenizer's differs from the files that name it).

What transformers adds, in this order, with the flags each has: every `added_tokens_decoder` entry
of tokenizer_config.json, by id; then each named special token (bos, eos, unk, sep, pad, cls,
mask, then a model's own `*_token` ones such as `image_token`) and each `extra_special_tokens`
(formerly `additional_special_tokens`) entry that the tokenizer does not already have as an added
token. A spelling given as a plain string is added as special; a named one is made special. The
backend's `add_tokens` then gives each new spelling the next id past the vocabulary (never the id
the config wrote), makes a spelling the vocabulary already has an added token at its own id, and
takes an entry's lstrip/rstrip/normalized/single_word flags as given. Without this a pad token
named only in the config was tokenized as its characters (the engine's one id), and an eos token
written by the template after every turn too.

Where there is no `added_tokens_decoder` (the legacy layout) special_tokens_map.json is merged over
the config, and added_tokens.json and tokenizer.json's own added tokens stand in for the decoder.
An entry transformers refuses (a decoder entry that is no AddedToken's fields, a special token
that is neither a string nor an AddedToken, a special_tokens_map.json or added_tokens.json that is
not an object, an added_tokens.json id that is not a number) is a SpecialTokensError: vLLM would
not start either.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken

from router.tokenizer_class import Rebuild

__all__ = ["SpecialTokens", "SpecialTokensError", "read_special_tokens"]

# transformers' SPECIAL_TOKENS_ATTRIBUTES, in its order
NAMED = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class SpecialTokensError(ValueError):
    """A special-token entry of a tokenizer's files that transformers cannot read."""

    def __init__(self, what: str, why: str) -> None:
        self.what = what
        self.why = why
        super().__init__(f"{what}: {why}")


@dataclass(frozen=True, slots=True)
class SpecialTokens:
    # what a chat template sees: each named and model-specific special token by its name
    spellings: dict[str, str]
    # what transformers adds to tokenizer.json's tokenizer, in its order (`Tokenizer.add_tokens`)
    to_add: list[AddedToken]


def _read(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SpecialTokensError(str(path), f"unreadable: {exc}") from exc


def _added_token(fields: Mapping[str, Any], where: str, **extra: Any) -> AddedToken:
    try:
        return AddedToken(**fields, **extra)
    except TypeError as exc:
        raise SpecialTokensError(where, f"not an AddedToken's fields ({exc}); transformers refuses it too") from exc


def _convert(value: Any, where: str) -> Any:
    """transformers' `convert_added_tokens`: its saved form, a dict with `"__type": "AddedToken"`,
    to an AddedToken, in lists and dicts too."""
    if isinstance(value, Mapping) and value.get("__type") == "AddedToken":
        return _added_token({k: v for k, v in value.items() if k != "__type"}, where)
    if isinstance(value, list):
        return [_convert(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        return {k: _convert(v, f"{where}.{k}") for k, v in value.items()}
    return value


def _token(value: Any, where: str) -> str | AddedToken:
    if not isinstance(value, (str, AddedToken)):
        raise SpecialTokensError(where, f"{value!r} is neither a string nor an AddedToken; transformers refuses it too")
    return value


def _decoder(entries: Any, where: str) -> dict[float, AddedToken]:
    if not isinstance(entries, Mapping):
        raise SpecialTokensError(where, "not an object of id: AddedToken; transformers refuses it too")
    decoder: dict[float, AddedToken] = {}
    for key, fields in entries.items():
        at = f"{where}[{key!r}]"
        if not isinstance(fields, Mapping):
            raise SpecialTokensError(at, f"{fields!r} is not an AddedToken's fields; transformers refuses it too")
        try:
            index = int(key)
        except ValueError as exc:
            raise SpecialTokensError(at, "the key is not a token id; transformers refuses it too") from exc
        decoder[index] = _added_token(fields, at)
    return decoder


def read_special_tokens(
    folder: Path, config: Mapping[str, Any], added: Mapping[int, AddedToken], own: Rebuild | None = None
) -> SpecialTokens:
    """The special tokens of the tokenizer in `folder`, whose tokenizer_config.json is `config` and
    whose tokenizer.json has the added tokens `added` (id: AddedToken), as transformers reads them
    (`from_pretrained`, then the tokenizer's `__init__`), step for step. `own`: the class that
    rebuilds the tokenizer from the vocabulary (router.tokenizer_class), so it has none of `added`
    as added tokens; its defaults stand for a named token the files do not mention (not one they
    set to null), and its `extras` become the extra special tokens where the files list none
    (CodeLlamaTokenizer's infill tokens)."""
    read = _Read(folder, config, added)
    for key, value in (own.defaults if own is not None else {}).items():
        read.kwargs.setdefault(key, value)
    named, extras = read.special_tokens()
    if own is not None and own.extras and "extra_special_tokens" not in read.kwargs:
        # the `__init__`'s own arguments: its default where the config spells the token (that goes to
        # the named tokens instead), none where the config sets it to null
        extras = [token for key in own.extras if (token := read.kwargs.get(key)) is not None]
    spellings = {k: str(v) for k, v in named.items() if v is not None}
    return SpecialTokens(spellings, _to_add(read.decoder, named, extras, {} if own is not None else added))


class _Read:
    """tokenizer_config.json as `from_pretrained` hands it to the tokenizer's `__init__`: `kwargs`,
    a model's own special tokens (`explicit`), and the added tokens it knows (`decoder`, id: token)."""

    def __init__(self, folder: Path, config: Mapping[str, Any], added: Mapping[int, AddedToken]) -> None:
        self.where = str(folder / "tokenizer_config.json")
        kwargs = {k: v for k, v in config.items() if k != "tokenizer_class"}
        # the file and key each value came from, for errors
        self.origin = {k: f"{self.where}: {k}" for k in kwargs}
        self.kwargs = kwargs
        if "additional_special_tokens" in kwargs and not kwargs.get("extra_special_tokens"):
            self._rename_additional()
        # a model's own `*_token` strings, then a dict `extra_special_tokens`
        explicit = {k: kwargs.pop(k) for k in list(kwargs) if _own(k) and isinstance(kwargs[k], str)}
        if isinstance(kwargs.get("extra_special_tokens"), Mapping):
            explicit |= kwargs.pop("extra_special_tokens")
        if "added_tokens_decoder" in kwargs:
            self.decoder = _decoder(kwargs["added_tokens_decoder"], f"{self.where}: added_tokens_decoder")
        else:
            explicit |= self._merge_map(folder / "special_tokens_map.json")
            self.decoder = _legacy_decoder(folder / "added_tokens.json", kwargs) | dict(added)
        kwargs["added_tokens_decoder"] = self.decoder
        self.kwargs = _convert(kwargs, self.where)
        self.explicit = _convert(explicit, f"{self.where}: extra_special_tokens")
        # a named token the decoder has is that AddedToken, with its flags
        by_spelling = {str(t): t for t in self.decoder.values()}
        for key in NAMED:
            if by_spelling and self.kwargs.get(key) is not None:
                self.kwargs[key] = by_spelling.get(str(self.kwargs[key]), self.kwargs[key])
        if "additional_special_tokens" in self.kwargs and "extra_special_tokens" not in self.kwargs:
            self._rename_additional()

    def _rename_additional(self) -> None:
        # transformers 5's name for `additional_special_tokens`
        self.kwargs["extra_special_tokens"] = self.kwargs.pop("additional_special_tokens")
        self.origin["extra_special_tokens"] = self.origin["additional_special_tokens"]

    def _merge_map(self, path: Path) -> dict[str, Any]:
        """special_tokens_map.json over the config, as the legacy layout has it; a dict
        `extra_special_tokens` is returned, as a model's own tokens."""
        mapping = _read(path) if path.is_file() else {}
        if not isinstance(mapping, Mapping):
            raise SpecialTokensError(str(path), "not an object of name: token; transformers refuses it too")
        for key, value in mapping.items():
            at = f"{path}: {key}"
            if isinstance(value, Mapping) and key != "extra_special_tokens":
                fields = {k: v for k, v in value.items() if k != "special"}
                self.kwargs[key] = _added_token(fields, at, special=True)
            elif key == "extra_special_tokens" and isinstance(value, list):
                merged = list(self.kwargs.get("extra_special_tokens") or [])
                for i, entry in enumerate(value):
                    token = _added_token(entry, f"{at}[{i}]", special=True) if isinstance(entry, Mapping) else entry
                    if token not in merged:
                        merged.append(token)
                self.kwargs[key] = merged
            else:
                self.kwargs[key] = value
            self.origin[key] = at
        extra = self.kwargs.get("extra_special_tokens")
        return dict(self.kwargs.pop("extra_special_tokens")) if isinstance(extra, Mapping) else {}

    def special_tokens(self) -> tuple[dict[str, str | AddedToken | None], list[str | AddedToken]]:
        """PreTrainedTokenizerBase.__init__: the special tokens by name (the seven, then a model's
        own, in transformers' order) and the `extra_special_tokens` list."""
        named: dict[str, str | AddedToken | None] = dict.fromkeys(NAMED)
        extras: list[str | AddedToken] = []
        auto: dict[str, Any] = {}
        for key, value in self.kwargs.items():
            at = self.origin.get(key, f"{self.where}: {key}")
            if value is None:
                continue
            if key in NAMED:
                named[key] = _token(value, at)
            elif key == "extra_special_tokens":
                if isinstance(value, Mapping):
                    named |= {k: _token(v, f"{at}.{k}") for k, v in value.items()}
                elif isinstance(value, list):
                    extras = [_token(v, f"{at}[{i}]") for i, v in enumerate(value)]
                else:
                    raise SpecialTokensError(at, "neither a list nor an object; transformers refuses it too")
            elif _own(key) and isinstance(value, (str, AddedToken)):
                auto[key] = value
        named |= {k: _token(v, f"{self.where}: {k}") for k, v in (auto | self.explicit).items()}
        return named, extras


def _own(key: str) -> bool:
    """A model's own special token's key (`image_token`)."""
    return key.endswith("_token") and key not in NAMED


def _legacy_decoder(path: Path, kwargs: Mapping[str, Any]) -> dict[float, AddedToken]:
    """added_tokens.json's tokens (id: token), special where a special token names them. An id
    may be any JSON number (transformers orders them; each token gets the next id past the
    vocabulary whatever its id, and 9.0 is the same key as 9)."""
    if not path.is_file():
        return {}
    encoder = _read(path)
    if not isinstance(encoder, Mapping):
        raise SpecialTokensError(str(path), "not an object of token: id; transformers refuses it too")
    for token, index in encoder.items():
        if not isinstance(index, (int, float)):
            raise SpecialTokensError(
                f"{path}: {token}",
                f"the id {index!r} is not a number (transformers fails ordering it among tokenizer.json's ids)",
            )
    special = {str(kwargs[k]) for k in NAMED if kwargs.get(k)} | {
        str(t) for t in kwargs.get("extra_special_tokens") or []
    }
    return {i: AddedToken(s, normalized=s not in special, special=s in special) for s, i in encoder.items()}


def _to_add(
    decoder: Mapping[float, AddedToken],
    named: Mapping[str, str | AddedToken | None],
    extras: list[str | AddedToken],
    added: Mapping[int, AddedToken],
) -> list[AddedToken]:
    """TokenizersBackend.__init__: every decoder entry by id (its check against the backend's added
    tokens compares ids with tokens, so none is left out), then each special token neither the
    backend nor those have; a string is added special, a named token made special."""
    to_add: list[str | AddedToken] = [t for _, t in sorted(decoder.items())]
    have = [t.content for t in added.values()] + [str(t) for t in to_add]
    for token in [*named.values(), *extras]:
        if token is not None and str(token) not in have and token not in to_add:
            to_add.append(token)
    named_spellings = [str(t) for t in named.values() if t]
    tokens = []
    for token in to_add:
        if isinstance(token, str):
            tokens.append(AddedToken(token, special=True))
            continue
        if not token.special and str(token) in named_spellings:
            token.special = True
        tokens.append(token)
    return tokens
