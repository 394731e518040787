"""Config schemas and their validation, shared by every process.

Layering for every setting: CLI flag > environment variable (`KVSWITCH_<NAME>`) > config file (YAML
or TOML) > default, and for the router's, the live config over them all (discovery.live_config).
`resolve()` applies that order to one schema; `validate()` on each schema raises ConfigError naming
the setting and what it allows. NATS credentials are layered kind against kind as well: one sets
aside those of other kinds below it (`NatsSettings.across_layers`).
"""

from __future__ import annotations

import argparse
import difflib
import ipaddress
import logging
import math
import os
import re
import ssl
import tomllib
import types
from collections.abc import Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin
from urllib.parse import urlsplit

import msgspec
import yaml

from protocol.errors import FLAG_ONLY, ConfigError, VariableError, setting_names, without_userinfo

__all__ = [
    "DISAGG_MODES",
    "MAX_LOAD_PERIOD_S",
    "MAX_RESPONSE_TTL_S",
    "MIN_LOAD_PERIOD_S",
    "MIN_STREAM_HEARTBEAT_S",
    "PINGS_UNANSWERED",
    "PING_INTERVAL_S",
    "POLICY_NAMES",
    "ROUTING_MODES",
    "ConditionalDisaggConfig",
    "EtcdSettings",
    "NatsSettings",
    "RouterSettings",
    "add_flags",
    "check_env_names",
    "check_file_keys",
    "check_flag_only_env",
    "check_shared_keys",
    "env_names",
    "file_keys",
    "flat_names",
    "load_file",
    "resolve",
    "url_problem",
]

log = logging.getLogger("kvswitch.config")

PolicyName = Literal["isl_bounding", "prefill_load", "isl_or_load", "ttft_model", "slo_aware"]
POLICY_NAMES: tuple[str, ...] = get_args(PolicyName)
LOAD_POLICIES = frozenset({"prefill_load", "isl_or_load"})
RoutingMode = Literal["kv", "round_robin", "random", "least_loaded"]
ROUTING_MODES: tuple[str, ...] = get_args(RoutingMode)
DisaggMode = Literal["conditional", "always", "never"]
DISAGG_MODES: tuple[str, ...] = get_args(DisaggMode)
# A router ends a leg after 3 heartbeats of silence. Below 50 ms that window (150 ms) is within a
# NATS round trip plus one event-loop stall of a busy shim or router, and every leg would end as
# worker_silent (a 2 ms heartbeat 503s every request).
MIN_STREAM_HEARTBEAT_S = 0.05
# The longest reply leave `kvswitch secrets --response-ttl` writes for a worker (kvswitch.nats_auth),
# a day: nats-server keeps each request's leave until it expires (or its 1,000,000 replies), so a
# longer one is memory for nothing. The leave must outlive every request it answers, so a router's
# --request-timeout is refused at this or more: the two bounds are this one number.
MAX_RESPONSE_TTL_S = 86_400
# The longest LoadReport period a router honours (router.load_view clamps to it): a shim reporting
# less often would be taken as silent between its reports, so a longer --load-period-s is refused.
MAX_LOAD_PERIOD_S = 60.0
# The shortest: a shim sends a report at most this often, on its period and on a change alike
# (worker_shim.load_reporter), and a router budgets each sender at twice that rate
# (router.sender_budget): a shim that sent faster was quarantined as a flood, so a shorter
# --load-period-s is refused. A router also reads a shorter period_s as this one.
MIN_LOAD_PERIOD_S = 0.05
# A NATS connection leaves a server that answered none of this many PINGs in a row: at the next
# interval, 3-4 intervals after it went silent (15-20 s at the default 5 s). A PONG or a message
# read answers (runtime.nats_connect): a reader behind on a backlog reads its PONG late. A frozen
# server's messages already in the socket buffers count too: it is left 3-4 intervals after they
# are read (16-21 s at 2 s with 20 MB queued, docs/deployment.md).
PINGS_UNANSWERED = 3
# A PONG is read behind everything the server sent before it, so a process behind on reading (a
# burst of messages waiting, its loop busy) reads it late: at 0.5 s such a reader left a healthy
# server 6 times in 30 s, at 1 s once, at 2 s never on an idle machine but 5 times in 40 with the
# CPU busy, while only a PONG counted (tests/runtime/test_nats_stale.py). A loop that reads nothing
# for 3 intervals still leaves.
# Above 120 s (nats-py's own default) a frozen node holds its clients for over 6 minutes.
PING_INTERVAL_S = (2.0, 120.0)


class ConditionalDisaggConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Conditional disaggregation, exactly as DESIGN.md defines it. Field names are the flags'.

    conditional_disagg: decide per request; off, every request prefills remotely when a prefill
        pool exists.
    conditional_disagg_policy: isl_bounding | prefill_load | isl_or_load | ttft_model | slo_aware.
    eff_isl_threshold: isl_bounding bypasses only below this many uncached prompt tokens (strict).
    eff_isl_ratio_threshold: ... and only below this uncached fraction of the prompt (strict).
    prefill_busy_threshold: prefill_load calls a prefill worker busy above this multiple of its
        max_num_batched_tokens in queued prefill tokens (strict); None inherits queue_threshold.
    decode_busy_threshold: a bypass is vetoed while the decode worker's KV use, this request
        included (all its prompt's blocks, the prefix the worker caches too), is above this
        fraction of its blocks (strict); None disables the guard.
    queue_threshold: the router's queue threshold: a worker whose queued prefill tokens exceed this
        multiple of its max_num_batched_tokens takes no new request while another is below it.
    ttft_link_gbps: ttft_model's KV transfer bandwidth between prefill and decode workers, GB/s.
    ttft_stall_weight: ttft_model's weight of the delay a local prefill adds to each running decode
        on the worker, against the request's own TTFT (1: a second of everyone's stall weighs as
        much as a second of this request's first-token wait).
    slo_headroom: slo_aware's share of each SLO (RouterSettings.slo_ttft_s, slo_itl_s) its
        predictions may use, in (0, 1].
    slo_prefill_fit: with slo_aware deciding, a prefill worker past the router's backlog bound (half
        the TTFT SLO) still takes a request remotely while its queue plus the request's uncached
        rest is predicted within this share of the TTFT SLO, in [0, 1]; 0 turns it off. At 0.5 or
        less it keeps a worker only where its queue's last partial chunk prices under the backlog
        bound's full-batch rate (router.policies.slo_aware), which is within one chunk's time.
    spill_to_prefill: while no decode worker has room, a prefill worker with room serves the whole
        request (prefill and decode) instead of the request waiting at admission. Its engine must
        accept whole requests: vLLM with `kv_role` kv_both (the NixlConnector's usual setting),
        engine_sim always; not SGLang's `--disaggregation-mode prefill`. Needs the policy to decide
        (disagg=conditional, conditional_disagg on); with slo_aware the prefill worker's TPOT room
        is judged too, with any other policy its prefill backlog alone.
    """

    conditional_disagg: bool = False
    conditional_disagg_policy: PolicyName = "isl_bounding"
    eff_isl_threshold: int = 2048
    eff_isl_ratio_threshold: float = 0.7
    prefill_busy_threshold: float | None = None
    decode_busy_threshold: float | None = None
    queue_threshold: float | None = None
    ttft_link_gbps: float = 50.0
    ttft_stall_weight: float = 0.1
    slo_headroom: float = 0.8
    slo_prefill_fit: float = 0.8
    spill_to_prefill: bool = False

    def validate(self) -> ConditionalDisaggConfig:
        _check_finite(self)
        if self.conditional_disagg_policy not in POLICY_NAMES:
            raise ConfigError.one_of("conditional_disagg_policy", self.conditional_disagg_policy, POLICY_NAMES)
        if self.eff_isl_threshold < 0:
            raise ConfigError("eff_isl_threshold", self.eff_isl_threshold, "must be >= 0")
        if not 0.0 <= self.eff_isl_ratio_threshold <= 1.0:
            raise ConfigError("eff_isl_ratio_threshold", self.eff_isl_ratio_threshold, "must be in [0, 1]")
        for name in ("prefill_busy_threshold", "decode_busy_threshold", "queue_threshold"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ConfigError(name, value, "must be >= 0")
        if self.ttft_link_gbps <= 0:
            raise ConfigError("ttft_link_gbps", self.ttft_link_gbps, "must be > 0")
        if self.ttft_stall_weight < 0:
            raise ConfigError("ttft_stall_weight", self.ttft_stall_weight, "must be >= 0")
        if not 0 < self.slo_headroom <= 1:
            raise ConfigError("slo_headroom", self.slo_headroom, "must be in (0, 1]")
        if not 0 <= self.slo_prefill_fit <= 1:
            raise ConfigError("slo_prefill_fit", self.slo_prefill_fit, "must be in [0, 1]")
        if self.conditional_disagg_policy in LOAD_POLICIES and self.effective_prefill_busy_threshold is None:
            raise ConfigError(
                "prefill_busy_threshold",
                None,
                f"policy {self.conditional_disagg_policy} needs prefill_busy_threshold or queue_threshold",
            )
        return self

    @property
    def effective_prefill_busy_threshold(self) -> float | None:
        return self.prefill_busy_threshold if self.prefill_busy_threshold is not None else self.queue_threshold


class RouterSettings(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """The router's live-tunable settings (also the value of /{ns}/config/router).

    routing: how the decode/agg worker is picked (kv: prefix overlap and load).
    disagg: never (aggregated), always (every request prefills remotely) or conditional (per
        request, when `conditional.conditional_disagg` is on). Without a prefill pool every request
        is aggregated.
    conditional: the conditional disaggregation settings; flat names in flags, env and files.
        `conditional_disagg` on needs disagg=conditional (the fixed modes never ask the policy).
    temperature: softmax temperature over negated costs for near-tie breaking; 0 is argmin.
    overlap_weight: weight of prefill work against decode load in the worker cost (default 4: on the
        H200 profiles a block of prefill costs about 3-4x the decode time a block of KV in use adds
        over a request's life; docs/router.md has the derivation and the measurement).
    max_queue: requests of one model that may wait at the router while no worker has room (each
        model has its own line, router.admission); beyond it a request gets 429 with Retry-After.
        None derives it from that model's measured throughput: as many as drain in half the TTFT SLO.
    prefill_timeout_s: a remote prefill leg slower than this falls back to a local prefill.
    pending_ttl_s: how long a routed request's prompt blocks count as cached on its workers before
        their KV events confirm them (0: off); an attempt that ends before a worker prefilled them
        withdraws them there at once (router.pending_prefixes).
    recompute_weight: how dearly the worker cost charges a worker for recomputing prefix tokens that
        another worker holds and could serve within half slo_ttft_s (0: not at all, the seed cost;
        router.selection has the rule, docs/benchmarks.md the sweep behind the default).
    stream_heartbeat_s: workers send a heartbeat on a silent leg this often; three missed ones end
        the leg (a dead worker is noticed within 3x this); at least MIN_STREAM_HEARTBEAT_S.
    slo_ttft_s, slo_itl_s: the service level the router protects: a worker takes new requests while
        its predicted prefill backlog is under half slo_ttft_s; the SLO-aware policy weighs both.
    """

    routing: RoutingMode = "kv"
    disagg: DisaggMode = "conditional"
    conditional: ConditionalDisaggConfig = msgspec.field(default_factory=ConditionalDisaggConfig)
    temperature: float = 0.0
    overlap_weight: float = 4.0
    max_queue: int | None = None
    prefill_timeout_s: float = 30.0
    pending_ttl_s: float = 20.0
    recompute_weight: float = 2.0
    stream_heartbeat_s: float = 0.4
    slo_ttft_s: float = 2.0
    slo_itl_s: float = 0.025

    def validate(self) -> RouterSettings:
        _check_finite(self)
        if self.routing not in ROUTING_MODES:
            raise ConfigError.one_of("routing", self.routing, ROUTING_MODES)
        if self.disagg not in DISAGG_MODES:
            raise ConfigError.one_of("disagg", self.disagg, DISAGG_MODES)
        if self.temperature < 0:
            raise ConfigError("temperature", self.temperature, "must be >= 0")
        if self.overlap_weight < 0:
            raise ConfigError("overlap_weight", self.overlap_weight, "must be >= 0")
        if self.max_queue is not None and self.max_queue < 0:
            raise ConfigError("max_queue", self.max_queue, "must be >= 0 (or unset: derived from throughput)")
        for name in ("prefill_timeout_s", "stream_heartbeat_s", "slo_ttft_s", "slo_itl_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(name, getattr(self, name), "must be > 0")
        if self.stream_heartbeat_s < MIN_STREAM_HEARTBEAT_S:
            raise ConfigError(
                "stream_heartbeat_s",
                self.stream_heartbeat_s,
                f"must be >= {MIN_STREAM_HEARTBEAT_S} (seconds; a leg silent for 3 heartbeats ends)",
            )
        if self.recompute_weight < 0:
            raise ConfigError("recompute_weight", self.recompute_weight, "must be >= 0 (0: the seed cost)")
        if self.pending_ttl_s < 0:
            raise ConfigError("pending_ttl_s", self.pending_ttl_s, "must be >= 0 (0: off)")
        self.conditional.validate()
        c = self.conditional
        if c.conditional_disagg and self.disagg != "conditional":
            raise ConfigError(
                "conditional_disagg",
                True,
                f"needs disagg=conditional (disagg={self.disagg} never asks the policy): drop one",
            )
        if c.spill_to_prefill and not (self.disagg == "conditional" and c.conditional_disagg):
            raise ConfigError(
                "spill_to_prefill",
                True,
                f"needs disagg=conditional and conditional_disagg on (got disagg={self.disagg}, "
                f"conditional_disagg={'on' if c.conditional_disagg else 'off'})",
            )
        return self


# What msgspec takes for a bool from a string (an environment variable's value): `yes` or `on`
# is refused, not read as off.
_BOOL_SPELLINGS = "allowed values: true, false, 1, 0 (true and false in any case)"


def _check_finite(settings: msgspec.Struct) -> None:
    """NaN and infinities are refused: one NaN threshold makes every routing cost NaN."""
    for f in msgspec.structs.fields(settings):
        value = getattr(settings, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f.name, value, "must be a finite number")


def _ip_version(host: str) -> int | None:
    try:
        return ipaddress.ip_address(host).version
    except ValueError:
        return None


def url_problem(url: str) -> str | None:
    """What is wrong with `url`'s host and port (a port that is not a number in 1..65535, no
    host), or None. Such a URL otherwise fails at the first connection, in a library's words."""
    # urllib's own messages are not passed on: they quote the netloc, or a "port" that is the start
    # of a password (`user:pa/ss@host`).
    try:
        parts = urlsplit(url)
    except ValueError:
        return "the host cannot be parsed"
    try:
        port = parts.port
    except ValueError:
        return "the port must be a number in 1..65535"
    if not parts.hostname:
        return "the URL names no host"
    if port == 0:
        return "the port must be a number in 1..65535"
    return None


class NatsSettings(msgspec.Struct, kw_only=True, frozen=True):
    servers: list[str] = msgspec.field(default_factory=lambda: ["nats://127.0.0.1:4222"])
    user: str | None = None
    password: str | None = None
    token: str | None = None
    creds_file: str | None = None
    nkey_file: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    # How often each connection PINGs its server; PINGS_UNANSWERED in a row unanswered and it leaves
    # for another server. nats-py's own 120 s x 2 let a frozen or cut-off node hold a connection,
    # with no error, for 4-6 minutes.
    ping_interval_s: float = 5.0

    def validate(self) -> NatsSettings:
        if not self.servers:
            raise ConfigError("nats_servers", self.servers, "at least one nats:// or tls:// URL")
        if len(self.servers) > 1 and any("@" in url and "://" not in url for url in self.servers[1:]):
            # A comma in a URL's password split it in two: the first piece, shown by the error below,
            # was the scheme, user and the password's start, with no `@` for the redaction to find.
            raise ConfigError(
                "nats_servers",
                "(not shown: it may hold a password)",
                "a comma inside a URL's user or password splits the list there: percent-encode it as %2C, "
                "or give the credentials with --nats-user and --nats-password",
            )
        for url in self.servers:
            if not url.startswith(("nats://", "tls://", "ws://", "wss://")):
                raise ConfigError("nats_servers", url, "URLs must start with nats://, tls://, ws:// or wss://")
            if (problem := url_problem(url)) is not None:
                raise ConfigError("nats_servers", url, problem)
        if (self.user is None) != (self.password is None):
            raise ConfigError("nats_user", self.user, "nats_user and nats_password go together")
        self._check_not_empty()
        self._check_one_credential(self._credential_kinds())
        if not PING_INTERVAL_S[0] <= self.ping_interval_s <= PING_INTERVAL_S[1]:  # NaN fails both
            raise ConfigError(
                "nats_ping_interval_s",
                self.ping_interval_s,
                f"must be in [{PING_INTERVAL_S[0]:g}, {PING_INTERVAL_S[1]:g}] seconds (a silent server is left after "
                f"{PINGS_UNANSWERED}-{PINGS_UNANSWERED + 1} of them; below {PING_INTERVAL_S[0]:g} s, a process "
                "behind on reading reads a healthy server's PONG late and leaves it)",
            )
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("nats_tls_cert", self.tls_cert, "nats_tls_cert and nats_tls_key go together")
        _check_files(
            nats_creds_file=self.creds_file,
            nats_nkey_file=self.nkey_file,
            nats_tls_ca=self.tls_ca,
            nats_tls_cert=self.tls_cert,
            nats_tls_key=self.tls_key,
        )
        # Parsed now: nats-py reads these only inside connect(), where a bad one was a traceback
        # (exit 1) or, for a creds file without a JWT, a loop that never ends.
        if self.nkey_file is not None:
            _check_seed("nats_nkey_file", self.nkey_file, Path(self.nkey_file).read_bytes().strip())
        if self.creds_file is not None:
            _check_creds(self.creds_file)
        if self.tls_ca or self.tls_cert:
            self.ssl_context()
        return self

    def _check_not_empty(self) -> None:
        """ConfigError for an empty user, password or token: nats-py sends none of them (`if
        self.options["token"]`), so '' would connect with no credential, or leave the file's in
        place, where it most likely came from a variable that was not set (`--nats-token "$TOKEN"`)."""
        for name in ("user", "password", "token"):
            if getattr(self, name) == "":
                raise ConfigError(
                    f"nats_{name}", "", "must not be empty (nats-py would send none): leave it unset to give none"
                )

    def _credential_kinds(self) -> list[str]:
        """The kinds of NATS credential given (_CREDENTIAL_FIELDS' keys, in its order); a URL's
        `user:password@` or `token@` is `servers`'."""
        return [
            kind
            for kind, fields in _CREDENTIAL_FIELDS.items()
            if (
                any(urlsplit(url).username is not None for url in self.servers)
                if kind == "servers"
                else any(getattr(self, name) is not None for name in fields)
            )
        ]

    def _check_one_credential(self, kinds: Sequence[str], where: Mapping[str, str] | None = None) -> None:
        """ConfigError naming the first two of `kinds` that cannot go together, and where each came
        from when `where` (by kind) says: nats-py sends one of them alone and drops the other without
        a word (a creds file before an nkey seed, either of them, to a server that asks for a
        signature, before a user and password, those before a token, a token before a URL's
        userinfo), and a server that wants the other refused it for ever ('Authorization
        Violation'). A token beside a creds file or an nkey seed is not refused: nats-py sends it
        with the signature, for an auth callout to read (nats-py 2.16, Client._connect_command),
        and alone to a server that asks for none."""
        pair = next(((a, b) for i, a in enumerate(kinds) for b in kinds[i + 1 :] if _clash(a, b)), None)
        if pair is None:
            return
        kind, other = pair
        given = f" (one from {where[kind]}, the other from {where[other]})" if where is not None else ""
        value = self.servers if kind == "servers" else getattr(self, kind)
        raise ConfigError(
            "nats_" + kind,
            value,
            f"give one NATS credential, not both {_CREDENTIALS[kind]} and {_CREDENTIALS[other]}{given}: "
            "nats-py would send one of them alone and drop the other without a word; one given at a higher layer "
            "(flag > environment > config file) sets aside those of other kinds below it",
        )

    def across_layers(self, sources: Mapping[str, tuple[int, str]]) -> NatsSettings:
        """These settings less each credential that one of another kind it cannot go with, given in a
        higher layer, shadows (flag > environment > config file, as any setting: `sources` gives each
        field's layer, 0 the highest, and where it came from), each said at INFO. Layer by layer from
        the file up: one set aside stays aside when what shadowed it is set aside in turn.
        ConfigError for two such in one layer, naming where each came from. Until 2026-12-07 a token
        in the config file refused `--nats-user ops --nats-password pw` naming --nats-token, which the
        operator never set."""
        self._check_not_empty()  # before anything is set aside for it
        kinds = self._credential_kinds()
        where = {kind: _given_by(_CREDENTIAL_FIELDS[kind], sources) for kind in kinds}
        layer = {kind: min(sources[name][0] for name in _CREDENTIAL_FIELDS[kind] if name in sources) for kind in kinds}
        kept: list[str] = []
        aside: dict[str, str] = {}  # a kind set aside: the kind above it that shadows it
        for rank in sorted(set(layer.values()), reverse=True):  # the config file's first
            here = [kind for kind in kinds if layer[kind] == rank]
            self._check_one_credential(here, where)
            for kind in here:
                for below in kept:
                    if _clash(kind, below):
                        aside.setdefault(below, kind)
            kept = [kind for kind in kept if kind not in aside] + here
        cleared: dict[str, Any] = {}
        for below, above in aside.items():
            log.info(
                "NATS credential %s (%s) set aside: %s (%s) shadows it, given above it (flag > environment > config "
                "file), and nats-py would send one of them alone",
                _LABELS[below], where[below], _LABELS[above], where[above],
            )  # fmt: skip
            if below == "servers":
                cleared["servers"] = [without_userinfo(url) for url in self.servers]
            else:
                cleared |= dict.fromkeys(_CREDENTIAL_FIELDS[below])
        return msgspec.structs.replace(self, **cleared)

    def shown_servers(self) -> list[str]:
        """The server URLs as logs may name them: without a `user:password@`."""
        return [without_userinfo(url) for url in self.servers]

    def credential_flags(self) -> list[str]:
        """The flags of the credentials given, for a server's refusal to name: a URL's userinfo
        (nats-py sends `user:password@` as a user and password, a lone `token@` as a token) too."""
        given = {"--nats-creds-file": self.creds_file, "--nats-nkey-file": self.nkey_file, "--nats-token": self.token}
        flags = [flag for flag, value in given.items() if value is not None]
        if self.user is not None:
            flags.append("--nats-user and --nats-password")
        for url in self.servers:
            parts = urlsplit(url)
            in_url = (
                "the user and password in --nats-servers"
                if parts.password is not None
                else "the token in --nats-servers"
            )
            if parts.username is not None and in_url not in flags:
                flags.append(in_url)
        return flags

    def connect_options(self, name: str) -> dict[str, Any]:
        """Keyword arguments for `nats.connect()`: every setting, reconnecting forever, and leaving a
        server that answers no PING for PINGS_UNANSWERED+1 intervals (a frozen or cut-off node:
        its TCP connection stays open, so nothing else would notice it)."""
        opts: dict[str, Any] = {
            "servers": self.servers,
            "name": name,
            "max_reconnect_attempts": -1,
            "reconnect_time_wait": 0.5,
            "ping_interval": self.ping_interval_s,
            "max_outstanding_pings": PINGS_UNANSWERED,
        }
        if self.user is not None:
            opts["user"], opts["password"] = self.user, self.password
        if self.token is not None:
            opts["token"] = self.token
        if self.creds_file is not None:
            opts["user_credentials"] = self.creds_file
        if self.nkey_file is not None:
            opts["nkeys_seed"] = self.nkey_file
        if self.tls_ca or self.tls_cert:
            opts["tls"] = self.ssl_context()
        return opts

    def ssl_context(self) -> ssl.SSLContext:
        """The client TLS context of --nats-tls-ca (the system's CAs without it) and the client
        certificate; ConfigError naming the file that does not load."""
        return _ssl_context("nats_", self.tls_ca, self.tls_cert, self.tls_key)


# The NATS credential kinds, by the fields that give them (a URL's userinfo is `servers`'): nats-py
# sends one alone, but a token goes with a creds file or a seed (_GO_TOGETHER).
_CREDENTIAL_FIELDS: dict[str, tuple[str, ...]] = {
    "creds_file": ("creds_file",),
    "nkey_file": ("nkey_file",),
    "user": ("user", "password"),
    "servers": ("servers",),
    "token": ("token",),
}
_GO_TOGETHER = {frozenset({"token", "creds_file"}), frozenset({"token", "nkey_file"})}


def _clash(kind: str, other: str) -> bool:
    """Whether credentials of these two kinds cannot be given together."""
    return kind != other and frozenset({kind, other}) not in _GO_TOGETHER


def _given_by(fields: Iterable[str], sources: Mapping[str, tuple[int, str]]) -> str:
    """Where `fields` came from, each place once ("--nats-user and KVSWITCH_NATS_PASSWORD")."""
    return " and ".join(dict.fromkeys(sources[name][1] for name in fields if name in sources))


# The NATS credential kinds as a message names them, and with how each is given.
_LABELS = {
    "creds_file": "nats_creds_file",
    "nkey_file": "nats_nkey_file",
    "user": "nats_user/nats_password",
    "servers": "a user:password@ or token@ in nats_servers",
    "token": "nats_token",
}
_CREDENTIALS = {
    kind: f"{label} ({setting_names('nats_user')}; {setting_names('nats_password')})"
    if kind == "user"
    else f"{label} ({setting_names('nats_' + kind)})"
    for kind, label in _LABELS.items()
}


class EtcdSettings(msgspec.Struct, kw_only=True, frozen=True):
    endpoints: list[str] = msgspec.field(default_factory=lambda: ["http://127.0.0.1:2379"])
    user: str | None = None
    password: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None

    def members(self) -> tuple[int | None, list[tuple[str, int]]]:
        """The endpoints' (host, port)s and their IP version: None for one DNS name. A client
        balances over a static list of addresses, or over what one name resolves to (a Service, or
        a pod's new IP) as often as it asks: several names cannot be balanced over."""
        parts = [urlsplit(u) for u in self.endpoints]
        addresses = [(p.hostname or "", p.port or 2379) for p in parts]
        families = {_ip_version(host) for host, _ in addresses}
        if families == {None} and len(addresses) == 1:
            return None, addresses
        if None in families:
            raise ConfigError(
                "etcd_endpoints",
                self.endpoints,
                "several endpoints must be IP addresses: give one DNS name that resolves to every member (a "
                "Service, as etcd.kvswitch.svc.cluster.local) or the members' IPs",
            )
        if len(families) > 1:
            raise ConfigError("etcd_endpoints", self.endpoints, "give IPv4 or IPv6 addresses, not both")
        return families.pop(), addresses

    def validate(self) -> EtcdSettings:
        if not self.endpoints:
            raise ConfigError("etcd_endpoints", self.endpoints, "at least one http:// or https:// URL")
        for url in self.endpoints:
            if not url.startswith(("http://", "https://")):
                raise ConfigError("etcd_endpoints", url, "URLs must start with http:// or https://")
            if (problem := url_problem(url)) is not None:
                raise ConfigError("etcd_endpoints", url, problem)
            if urlsplit(url).username is not None:  # etcd's gRPC channel cannot even parse such a target
                raise ConfigError(
                    "etcd_endpoints", url, "a URL takes no user:password@: give --etcd-user and --etcd-password"
                )
        if (self.user is None) != (self.password is None):
            raise ConfigError("etcd_user", self.user, "etcd_user and etcd_password go together")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("etcd_tls_cert", self.tls_cert, "etcd_tls_cert and etcd_tls_key go together")
        _check_files(etcd_tls_ca=self.tls_ca, etcd_tls_cert=self.tls_cert, etcd_tls_key=self.tls_key)
        # discovery.session speaks TLS only with a CA: https:// without one would go in plaintext,
        # and a client certificate without one would be dropped without a word.
        if self.tls_ca is None:
            https = [u for u in self.endpoints if u.startswith("https://")]
            if https:
                raise ConfigError(
                    "etcd_tls_ca",
                    None,
                    f"{without_userinfo(https[0])} speaks TLS: give the CA that signs its certificate (else plaintext)",
                )
            if self.tls_cert is not None:
                raise ConfigError("etcd_tls_ca", None, "etcd_tls_cert and etcd_tls_key need etcd_tls_ca")
        else:
            http = [u for u in self.endpoints if u.startswith("http://")]
            if http:
                raise ConfigError(
                    "etcd_endpoints", http[0], "with etcd_tls_ca every URL must be https:// (http:// is plaintext)"
                )
            # Loaded as gRPC will: it takes the PEM bytes unparsed, and then never connects.
            _ssl_context("etcd_", self.tls_ca, self.tls_cert, self.tls_key, grpc=True)
        self.members()
        return self


def _check_files(**paths: str | None) -> None:
    for setting, path in paths.items():
        if path is None:
            continue
        if not Path(path).is_file():
            raise ConfigError(setting, path, "must name a readable file")
        # Opened, not stat'ed: a file this uid may not read (a root-owned Secret) failed only at the
        # first connect, with a traceback. is_file() first: opening a FIFO would block.
        try:
            with open(path, "rb"):
                pass
        except OSError as exc:
            raise ConfigError(setting, path, f"must name a readable file ({exc.strerror})") from exc


class _Encrypted(Exception):
    pass


def _no_passphrase() -> str:
    raise _Encrypted  # OpenSSL would prompt on the terminal for it, and wait


def _ssl_context(
    prefix: str, ca: str | None, cert: str | None, key: str | None, *, grpc: bool = False
) -> ssl.SSLContext:
    """A client context trusting `ca` (the system's CAs when None) and presenting `cert` and `key`;
    ConfigError naming `{prefix}tls_ca`, `_cert` or `_key`, whichever does not load. `grpc`: the
    files go to gRPC (etcd), whose TLS has no security level, so OpenSSL's (which refuses an RSA
    key under 2048 bits or a SHA-1 signature) must not refuse files it takes."""
    try:
        ctx = ssl.create_default_context(cafile=ca)
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError(f"{prefix}tls_ca", ca, f"holds no PEM CA certificate ({exc})") from exc
    if cert is None or key is None:
        return ctx
    if grpc:
        ctx.set_ciphers("DEFAULT:@SECLEVEL=0")
    try:  # the certificate alone first: load_cert_chain's error does not say which file it was
        ssl.create_default_context(cafile=cert)
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError(f"{prefix}tls_cert", cert, f"holds no PEM certificate ({exc})") from exc
    flag = f"--{prefix[:-1]}-tls-cert"
    try:
        ctx.load_cert_chain(cert, key, password=_no_passphrase)
    except _Encrypted:
        raise ConfigError(
            f"{prefix}tls_key", key, "is encrypted: give it unencrypted (no passphrase is read)"
        ) from None
    except (ssl.SSLError, OSError) as exc:
        mismatch = isinstance(exc, ssl.SSLError) and exc.reason == "KEY_VALUES_MISMATCH"
        why = f"is not the PEM private key of the certificate in {flag}" if mismatch else f"does not load with {flag}"
        raise ConfigError(f"{prefix}tls_key", key, f"{why} ({exc})") from exc
    return ctx


def _check_seed(setting: str, path: str, seed: bytes) -> None:
    """ConfigError unless `seed` is an nkey seed (nats-py signs with it only when it connects)."""
    import nkeys  # only where a seed is given: processes without NATS need not load it

    try:
        nkeys.from_seed(bytearray(seed)).wipe()
    except (nkeys.NkeysError, ValueError, TypeError) as exc:
        raise ConfigError(
            setting, path, f"holds no nkey seed ({type(exc).__name__}; kvswitch secrets writes one per identity)"
        ) from exc


def _check_creds(path: str) -> None:
    """ConfigError unless `path` is a NATS creds file, read as nats-py reads it: the line after
    each BEGIN marker is the user JWT, then the user's nkey seed."""
    lines = Path(path).read_bytes().split(b"\n")
    value = b""
    for marker in (b"BEGIN NATS USER JWT", b"BEGIN USER NKEY SEED"):
        at = next((i for i, line in enumerate(lines) if marker in line), None)
        value = lines[at + 1] if at is not None and at + 1 < len(lines) else b""
        if not value.strip():
            raise ConfigError("nats_creds_file", path, f"is no NATS creds file: it has no {marker.decode()} block")
    _check_seed("nats_creds_file", path, value)  # the seed's line, as is: nats-py strips nothing off it


def add_flags(parser: argparse._ActionsContainer, schema: type[msgspec.Struct], prefix: str = "") -> None:
    """One flag per field of `schema` (nested Structs flattened), named as `resolve()` reads them:
    `--{prefix}{field}` with dashes. Every default is None, so an absent flag falls through to the
    environment, the file and the schema's own default."""
    for f in msgspec.structs.fields(schema):
        tp = _base_type(f.type)
        if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
            add_flags(parser, tp, prefix)
            continue
        dest = prefix + f.name
        flag = "--" + dest.replace("_", "-")
        if tp is bool:
            parser.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction, default=None)
        elif get_origin(tp) is Literal:
            parser.add_argument(flag, dest=dest, choices=[str(c) for c in get_args(tp)], default=None)
        elif get_origin(tp) is list:
            parser.add_argument(flag, dest=dest, type=_csv, default=None, metavar="A,B")
        else:
            parser.add_argument(flag, dest=dest, type=tp if tp in (int, float) else str, default=None)


def flat_names(schema: type[msgspec.Struct]) -> list[str]:
    """The flat setting names of `schema` (nested Structs flattened), as flags and files name them."""
    out: list[str] = []
    for f in msgspec.structs.fields(schema):
        sub = _struct_type(_base_type(f.type))
        out += flat_names(sub) if sub is not None else [f.name]
    return out


def _base_type(tp: Any) -> Any:
    if get_origin(tp) in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        return args[0] if len(args) == 1 else str
    return tp


def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader refusing a key given twice in one mapping: PyYAML keeps the last without a word
    (TOML refuses it), so an edit to the first copy would do nothing."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *base` may be overridden by the keys beside it: YAML's merge
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark, f"found the key {key!r} twice", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML (.yaml/.yml) or TOML (.toml) config file into a mapping."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError("config", str(p), f"cannot read: {exc.strerror}") from exc
    if p.suffix == ".toml":
        try:
            data: Any = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError("config", str(p), f"not valid TOML: {exc}") from exc
    elif p.suffix in (".yaml", ".yml"):
        try:
            data = yaml.load(text, Loader=_UniqueKeyLoader) or {}  # a SafeLoader: no arbitrary objects
        except yaml.YAMLError as exc:
            raise ConfigError("config", str(p), f"not valid YAML: {_yaml_problem(exc)}") from None
    else:
        raise ConfigError("config", str(p), "the file name must end in .yaml, .yml or .toml")
    if not isinstance(data, dict):
        raise ConfigError("config", str(p), "the top level must be a mapping")
    return data


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """Where and what, as TOML's errors say it: PyYAML's own text quotes the offending line, which
    printed a password to the log when it began with `@` or had an unclosed quote. Quoted values in
    the problem (an alias's name, a character) are left out too, but for a constructor's (a key
    given twice, a tag): those name keys, not values."""
    problem = getattr(exc, "problem", None) or type(exc).__name__
    if not isinstance(exc, yaml.constructor.ConstructorError):
        problem = re.sub(r"'[^']*'|\"[^\"]*\"", "'...'", problem)
    mark = getattr(exc, "problem_mark", None)
    return f"{problem} (at line {mark.line + 1}, column {mark.column + 1})" if mark is not None else problem


def file_keys(schema: type[msgspec.Struct], setting_prefix: str = "") -> set[str]:
    """The top-level keys a config file may use for `schema`, as `resolve` reads them: each field's
    flat setting name and bare name, and a nested Struct's name and its fields' keys."""
    keys: set[str] = set()
    for field in msgspec.structs.fields(schema):
        sub = _struct_type(field.type)
        keys.add(field.name)
        keys |= file_keys(sub, setting_prefix) if sub is not None else {setting_prefix + field.name}
    return keys


def check_file_keys(file: Mapping[str, Any], allowed: set[str], path: str) -> None:
    """ConfigError naming the first key of `file` that no setting reads: a typo would otherwise
    leave its setting at the default without a word."""
    if (unknown := _first_unknown(file, allowed)) is not None:
        key, hint = unknown
        raise ConfigError("config", path, f"{key!r} is not a setting{hint} (the settings are the flags' names)")


def check_shared_keys(file: Mapping[str, Any], path: str, *schemas: tuple[type[msgspec.Struct], str]) -> None:
    """ConfigError naming a bare key of `file` that fields of more than one of the prefixed `schemas`
    read (`user`: both `nats_user` and `etcd_user`): `resolve` takes a field's bare name too, so one
    key would set both, an etcd password sent to the NATS server beside its nkey, without a word."""
    readers: dict[str, list[str]] = {}
    for schema, prefix in schemas:
        for field in msgspec.structs.fields(schema):
            readers.setdefault(field.name, []).append(prefix + field.name)
    for key in sorted(file, key=str):
        names = readers.get(key, [])
        if len(names) > 1 and key not in names:
            raise ConfigError("config", path, f"{key!r} would set {' and '.join(names)}: write the one you mean")


def _first_unknown(keys: Iterable[Any], allowed: Collection[str]) -> tuple[Any, str] | None:
    """The first of `keys` no setting reads, and a did-you-mean hint ("" for none)."""
    unknown = sorted((k for k in keys if k not in allowed), key=str)  # YAML keys need not be strings
    if not unknown:
        return None
    near = difflib.get_close_matches(str(unknown[0]), sorted(allowed), n=1)
    return unknown[0], f"; did you mean {near[0]!r}?" if near else ""


S = TypeVar("S", bound=msgspec.Struct)


def resolve(
    schema: type[S],
    *,
    cli: Mapping[str, Any] | None = None,
    file: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    env_prefix: str = "KVSWITCH_",
    setting_prefix: str = "",
    live: Mapping[str, Any] | None = None,
    file_name: str | None = None,
) -> S:
    """Build `schema` from its layers: live > CLI flag > env > file > default, then validate it.

    Field `x` is flag/file/live key `{setting_prefix}x` and env var `{env_prefix}{SETTING_PREFIX}X`.
    CLI values that are None count as not given (an unset flag); a live value counts whenever its
    key is there, so a live None (JSON null) clears an Optional setting whichever layer set it.
    Fields of a nested Struct share their parent's flat names (a file may also nest them under the
    field's name). List fields take comma-separated strings from the environment. A schema with an
    `across_layers(sources)` (NatsSettings: a credential shadows those of other kinds below it) is
    given where each of its fields came from (`file_name`: the config file's path, for its words).
    """
    env = os.environ if env is None else env
    sources: dict[str, tuple[int, str]] = {}
    merged = _layer(schema, live or {}, cli or {}, file or {}, env, env_prefix, setting_prefix, sources, file_name)
    try:
        value = msgspec.convert(merged, schema, strict=False)
    except msgspec.ValidationError as exc:
        raise _named_error(schema, merged, exc, setting_prefix) from exc
    across_layers = getattr(value, "across_layers", None)
    if across_layers is not None:
        value = across_layers(sources)
    validate = getattr(value, "validate", None)
    return validate() if validate is not None else value


def _layer(
    schema: type[msgspec.Struct],
    live: Mapping[str, Any],
    cli: Mapping[str, Any],
    file: Mapping[str, Any],
    env: Mapping[str, str],
    env_prefix: str,
    prefix: str,
    sources: dict[str, tuple[int, str]],
    file_name: str | None,
) -> dict[str, Any]:
    """The settings of `schema` from its layers, and into `sources` each given top-level field's layer
    (0 live, 1 flag, 2 environment, 3 file) and where it came from ("--nats-token")."""
    out: dict[str, Any] = {}
    in_file = f" in {file_name}" if file_name else " in the config file"
    for field in msgspec.structs.fields(schema):
        sub = _struct_type(field.type)
        if sub is not None:
            sub_file = _with_section(file, field.name, sub, prefix)
            out[field.name] = _layer(sub, live, cli, sub_file, env, env_prefix, prefix, {}, file_name)
            continue
        name = prefix + field.name
        if name != field.name and name in file and field.name in file:
            # Either winning would leave the other edited in vain without a word (as _with_section).
            raise ConfigError(
                name, file[name], f"the config file gives it twice, as {name!r} and as {field.name!r}: keep one"
            )
        env_name = env_prefix + name.upper()
        if name in live:
            out[field.name], sources[field.name] = live[name], (0, f"{name} in the live config")
        elif cli.get(name) is not None:
            out[field.name], sources[field.name] = cli[name], (1, "--" + name.replace("_", "-"))
        elif env_name in env:
            raw = env[env_name]
            out[field.name] = [s.strip() for s in raw.split(",") if s.strip()] if _is_list(field.type) else raw
            sources[field.name] = (2, env_name)
        elif name in file:
            out[field.name], sources[field.name] = file[name], (3, name + in_file)
        elif field.name in file:
            out[field.name], sources[field.name] = file[field.name], (3, field.name + in_file)
    return out


def check_flag_only_env(
    flags: Iterable[str], env: Mapping[str, str] | None = None, env_prefix: str = "KVSWITCH_"
) -> None:
    """ConfigError for the first of `flags` (dest names of this process's flags, e.g. `no_api_keys`)
    in FLAG_ONLY whose `{env_prefix}{NAME}` is in `env`, whatever its value: `resolve` reads no
    such variable, so the switch would be ignored while its user believes it on."""
    env = os.environ if env is None else env
    for name in sorted(FLAG_ONLY.intersection(flags)):
        env_name = env_prefix + name.upper()
        if env_name in env:
            flag = "--" + name.replace("_", "-")
            raise ConfigError(
                name,
                env[env_name],
                f"{env_name} is not read: {flag} is a flag only (no variable, no file key); "
                f"pass {flag} on the command line and unset {env_name}",
            )


def env_names(schema: type[msgspec.Struct], setting_prefix: str = "", env_prefix: str = "KVSWITCH_") -> set[str]:
    """The environment variables `resolve(schema, setting_prefix=..., env_prefix=...)` reads."""
    return {env_prefix + (setting_prefix + name).upper() for name in flat_names(schema)}


def check_env_names(
    known: Collection[str], env: Mapping[str, str] | None = None, env_prefix: str = "KVSWITCH_"
) -> None:
    """VariableError naming every `{env_prefix}` variable of `env` not in `known`, each with the
    nearest known name: `resolve` reads only the names it knows, so a misspelt one (KVSWITCH_DISAG)
    would leave its setting at the default without a word."""
    env = os.environ if env is None else env
    unknown = sorted(name for name in env if name.startswith(env_prefix) and name not in known)
    if not unknown:
        return
    # Matched without the prefix they all share, which would make any two names look alike.
    by_suffix = {name.removeprefix(env_prefix): name for name in known}
    problems = []
    for name in unknown:
        near = difflib.get_close_matches(name.removeprefix(env_prefix).upper(), sorted(by_suffix), n=1)
        problems.append("is no kvswitch setting" + (f" (did you mean {by_suffix[near[0]]}?)" if near else ""))
    rest = "".join(f"; {name} {problem}" for name, problem in zip(unknown[1:], problems[1:], strict=True))
    raise VariableError(unknown[0], problems[0] + rest)


def _with_section(file: Mapping[str, Any], name: str, sub: type[msgspec.Struct], prefix: str) -> Mapping[str, Any]:
    """`file` with the keys of its `name:` section (a nested Struct's) laid over it. A section that
    is no mapping, or a key in it no setting reads, is a ConfigError: it would otherwise leave its
    settings at their defaults without a word. An empty section (YAML null) is none."""
    nested = file.get(name)
    if nested is None:
        return file
    allowed = sorted(file_keys(sub, prefix))
    if not isinstance(nested, Mapping):
        raise ConfigError("config", {name: nested}, f"{name!r} must be a mapping of {', '.join(allowed)}")
    if (unknown := _first_unknown(nested, allowed)) is not None:
        key, hint = unknown
        raise ConfigError("config", {name: nested}, f"{key!r} is not a setting of {name!r}{hint}")
    # A setting given both top-level and in the section is refused, equal values too: either one
    # winning would leave the other edited in vain without a word.
    for key in sorted(nested, key=str):
        bare = key[len(prefix) :] if prefix and key.startswith(prefix) else key
        top = next((k for k in dict.fromkeys((key, bare, prefix + bare)) if k in file), None)
        if top is not None:
            raise ConfigError(
                "config",
                {top: file[top], name: {key: nested[key]}},
                f"{bare!r} is given both top-level and under {name!r}: give it in one place",
            )
    return {**file, **nested}


def _named_error(
    schema: type[msgspec.Struct], merged: Mapping[str, Any], exc: msgspec.ValidationError, prefix: str
) -> ConfigError:
    """Turn msgspec's `... - at `$.a.b`` into a ConfigError naming the flat setting. An item of a
    list (`$.servers[1]`) is its list's: it must not leave the whole mapping, secrets and all, as
    the value."""
    message = str(exc)
    where = message.rsplit("at `$.", 1)[-1].rstrip("`") if "at `$." in message else ""
    path = [part.partition("[")[0] for part in where.split(".")] if where else []
    tp: Any = schema
    value: Any = merged
    for part in path:
        field = next((f for f in msgspec.structs.fields(tp) if f.name == part), None) if _struct_type(tp) else None
        if field is None:
            break
        tp, value = field.type, value.get(part) if isinstance(value, Mapping) else None
    setting = prefix + path[-1] if path else schema.__name__
    choices = get_args(tp) if getattr(tp, "__origin__", None) is Literal else ()
    if choices:
        return ConfigError.one_of(setting, value, [str(c) for c in choices])
    problem = message.split(" - at ", maxsplit=1)[0]
    if _base_type(tp) is bool:  # msgspec's words alone do not say which strings it takes
        problem += f"; {_BOOL_SPELLINGS}"
    return ConfigError(setting, value, problem)


def _struct_type(tp: Any) -> type[msgspec.Struct] | None:
    return tp if isinstance(tp, type) and issubclass(tp, msgspec.Struct) else None


def _is_list(tp: Any) -> bool:
    return getattr(tp, "__origin__", None) is list
