"""Replicas that route alike: each puts digests of its routing settings and of how it renders and
tokenizes prompts in its RouterInfo and compares its peers' with its own.

Replicas of one namespace split the same clients, so one with other settings (`--routing
round_robin` beside `kv`, another policy, thresholds from a forgotten environment variable,
`--no-calibration`) makes
the fleet's routing depend on which replica a request reached, and nothing said so. The digest is
of the effective settings, live config (/{ns}/config/router) included, and is put again whenever
they change. The rendering digest is of the tokenizer (its probe fingerprint, the template's clock
pinned so a template that writes today's date digests alike on every day: the same files under
another path render alike) and vLLM's chat flags the router renders with: a replica with another
`--exclude-tools-when-tool-choice-none` routes `tool_choice: "none"` chats on other ids, and no
engine probe can show that flag, so a peer is the only one that can. A peer whose digests or
version differ from ours for `settle_s` is a WARNING once (naming the peer, which digest or the
version, and both values; and each setting that differs, by its flag, with both values, where the
peer publishes what its digests are of: RouterInfo.settings and .rendering, since 2026-12-07), a
/ready warning and a gauge, until it agrees again (an INFO). The
wait keeps a live config change, which every replica applies and re-publishes within milliseconds
of the others, from reading as a difference. A peer that publishes no digest (older than this) is
compared by version only; one with no rendering digest (before 2026-12-07), by its settings
digest and version.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import msgspec

from protocol import RouterInfo, subjects
from protocol.config import RouterSettings

__all__ = ["SETTLE_S", "PeerSettings", "rendering_digest", "rendering_fields", "settings_digest", "settings_fields"]

log = logging.getLogger(__name__)

SETTLE_S = 2.0
"""How long a peer must differ before it counts: replicas apply a live change within milliseconds."""


def settings_fields(settings: RouterSettings, *, calibrated: bool = True) -> dict[str, str]:
    """The settings a replica routes with, each by its flag's name (nested Structs flattened, as
    protocol.config.add_flags names them: `conditional`'s fields are --eff-isl-threshold and the
    rest, no --conditional) and as its JSON text: what RouterInfo.settings carries, for a peer to
    name the ones that differ. `calibrated` as in `settings_digest`."""
    fields = _flat(settings)
    if not calibrated:
        fields["calibration"] = False
    return _texts(fields)


def settings_digest(settings: RouterSettings, *, calibrated: bool = True) -> str:
    """12 hex digits of a SHA-256 over the settings' JSON, nested, keys sorted: equal settings give
    equal digests in every process. `calibrated`: the process flag `--no-calibration` off; a
    replica that prices workers by their profiles alone admits and chooses paths otherwise than one
    that fits them (a forgotten KVSWITCH_NO_CALIBRATION was no difference a peer saw). Counted only
    when off, so a calibrating replica's digest is what it was before."""
    fields = msgspec.to_builtins(settings)
    if not calibrated:
        fields["calibration"] = False
    return _digest(fields)


def _flat(settings: msgspec.Struct) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in settings.__struct_fields__:
        value = getattr(settings, name)
        out.update(_flat(value) if isinstance(value, msgspec.Struct) else {name: msgspec.to_builtins(value)})
    return out


def rendering_fields(
    tokenizer: str,
    *,
    content_format: str = "auto",
    default_chat_template_kwargs: Mapping[str, Any] | None = None,
    exclude_tools_when_tool_choice_none: bool = False,
    trust_request_chat_template: bool = False,
) -> dict[str, str]:
    """What turns a request into the ids it routes on, each as its JSON text (RouterInfo.rendering):
    `tokenizer` is the router's tokenizer's fingerprint with the template's clock pinned
    (router.tokenization.rendering_fingerprint), the rest vLLM's flags of those names as the router
    was given them. No kwargs and `{}` render alike."""
    return _texts(
        {
            "tokenizer": tokenizer,
            "chat_template_content_format": content_format,
            "default_chat_template_kwargs": dict(default_chat_template_kwargs or {}),
            "exclude_tools_when_tool_choice_none": exclude_tools_when_tool_choice_none,
            "trust_request_chat_template": trust_request_chat_template,
        }
    )


def rendering_digest(tokenizer: str, **flags: Any) -> str:
    """12 hex digits of a SHA-256 over `rendering_fields`' values, as `settings_digest`."""
    return _digest({name: msgspec.json.decode(text) for name, text in rendering_fields(tokenizer, **flags).items()})


def _texts(fields: Mapping[str, Any]) -> dict[str, str]:
    return {name: msgspec.json.encode(value, order="sorted").decode() for name, value in fields.items()}


def _digest(values: Mapping[str, Any]) -> str:
    return hashlib.sha256(msgspec.json.encode(values, order="sorted")).hexdigest()[:12]


class _Diff(msgspec.Struct, frozen=True):
    settings: bool  # the settings digests differ
    rendering: bool  # the rendering digests differ
    version: bool
    text: str


class PeerSettings:
    def __init__(
        self,
        ns: str,
        digest: str,
        version: str,
        *,
        rendering: str = "",
        settings: Mapping[str, str] | None = None,
        rendering_flags: Mapping[str, str] | None = None,
        settle_s: float = SETTLE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._config_key = subjects.config_key(ns)
        self.digest = digest
        self.rendering = rendering  # fixed for the process: no live config changes it
        # what the digests are of (settings_fields, rendering_fields), published for peers to name
        self.settings = dict(settings or {})
        self.rendering_flags = dict(rendering_flags or {})
        self.version = version
        self.settle_s = settle_s
        self._clock = clock
        self._peers: dict[str, RouterInfo] = {}
        self._diffs: dict[str, tuple[_Diff, float]] = {}  # peer -> how it differs, since when
        self._warned: dict[str, _Diff] = {}  # what each peer was warned about, while it lasts

    # --- what changes ----------------------------------------------------------------------------

    def mine(self, digest: str, settings: Mapping[str, str]) -> None:
        """Our own settings changed (live config): their digest, and what it is of."""
        if digest != self.digest:
            self.digest = digest
            self.settings = dict(settings)
            for peer in list(self._peers):
                self._review(peer)

    def replace(self, peers: Mapping[str, RouterInfo]) -> None:
        """The peers now registered (a watch's snapshot), ourselves left out."""
        for peer in self._peers.keys() - peers.keys():
            self.gone(peer)
        for peer, info in peers.items():
            self.seen(peer, info)

    def seen(self, peer: str, info: RouterInfo) -> None:
        self._peers[peer] = info
        self._review(peer)

    def gone(self, peer: str) -> None:
        self._peers.pop(peer, None)
        self._diffs.pop(peer, None)
        self._warned.pop(peer, None)

    # --- what is read ------------------------------------------------------------------------------

    def differing(self) -> dict[str, _Diff]:
        """The peers that have differed for `settle_s`, with how."""
        now = self._clock()
        return {peer: diff for peer, (diff, since) in sorted(self._diffs.items()) if now - since >= self.settle_s}

    def settings_mismatch(self) -> list[str]:
        """Peers whose routing settings or rendering differ: either routes a request otherwise."""
        return [peer for peer, diff in self.differing().items() if diff.settings or diff.rendering]

    def version_mismatch(self) -> list[str]:
        return [peer for peer, diff in self.differing().items() if diff.version]

    def warnings(self) -> list[str]:
        return [diff.text for diff in self.differing().values()]

    def check(self) -> None:
        """Log each difference that has lasted `settle_s`, once (run when it may have), and look
        again when the first of those not yet settled will have: a timer may fire a little early
        (uvloop's run to the millisecond), and one that found nothing settled left its WARNING
        unsaid for good."""
        now = self._clock()
        left = [since + self.settle_s - now for _, since in self._diffs.values()]
        for peer, diff in self.differing().items():
            if self._warned.get(peer) != diff:
                self._warned[peer] = diff
                log.warning("%s", diff.text)
        if waits := [s for s in left if s > 0]:
            self._check_in(min(waits))

    # --- internals ---------------------------------------------------------------------------------

    def _review(self, peer: str) -> None:
        diff = self._diff(peer, self._peers[peer])
        if diff is None:
            self._diffs.pop(peer, None)
            if self._warned.pop(peer, None) is not None:
                log.info("peer router %s routes with the same settings and version as this one again", peer)
            return
        held = self._diffs.get(peer)
        if held is not None and held[0] == diff:
            return
        # A peer that differed already keeps its time: it does not agree now either.
        self._diffs[peer] = (diff, self._clock() if held is None else held[1])
        self._check_in(self.settle_s)

    def _check_in(self, delay: float) -> None:
        with contextlib.suppress(RuntimeError):  # no loop (a clock driven by hand): check() when asked
            asyncio.get_running_loop().call_later(delay, self.check)

    def _diff(self, peer: str, info: RouterInfo) -> _Diff | None:
        settings = bool(info.settings_digest) and info.settings_digest != self.digest
        rendering = bool(info.rendering_digest) and info.rendering_digest != self.rendering
        version = info.version != self.version
        if not settings and not rendering and not version:
            return None
        said = []
        if settings:
            said.append(
                f"routing settings digest {info.settings_digest} (this router's {self.digest})"
                + _named(info.settings, self.settings)
            )
        if rendering:
            # what the digest covers, where the peer does not say which of it differs
            covers = (
                ": its tokenizer's fingerprint, --chat-template-content-format, --default-chat-template-kwargs, "
                "--exclude-tools-when-tool-choice-none and --trust-request-chat-template"
            )
            named = _named(info.rendering, self.rendering_flags)
            mine = f"{self.rendering}{'' if named else covers}"
            said.append(f"chat rendering digest {info.rendering_digest} (this router's {mine}){named}")
        if version:
            said.append(f"version {info.version or 'unknown'} (this router's {self.version})")
        text = (
            f"peer router {peer} runs with {' and '.join(said)}: the replicas may route the same request differently; "
            "give every replica the same flags, KVSWITCH_* environment and config file (live config at "
            f"{self._config_key} applies to all), {'the same tokenizer files, ' if rendering else ''}"
            "and the same release"
        )
        return _Diff(settings, rendering, version, text)


def _named(theirs: Mapping[str, str], ours: Mapping[str, str]) -> str:
    """The settings a peer's differ in, each with its flag and both values ("" from a peer that
    publishes none, older than RouterInfo.settings, or when we publish none)."""
    if not theirs or not ours:
        return ""
    differ = [
        f"{_flag(name)} {theirs.get(name, 'unset')} (this router's {ours.get(name, 'unset')})"
        for name in sorted(theirs.keys() | ours.keys())
        if theirs.get(name) != ours.get(name)
    ]
    return f", set otherwise: {', '.join(differ)}" if differ else ""


def _flag(name: str) -> str:
    """A setting's flag (router.cli: each flat RouterSettings name, `settings_fields`', is one of its name)."""
    if name == "calibration":
        return "--no-calibration (calibration)"
    if name == "tokenizer":
        return "the tokenizer's fingerprint"
    return "--" + name.replace("_", "-")
