"""Config validation: every error names the setting (flag and env var) and what is allowed."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import nkeys
import pytest

from kvswitch.certs import write_tls
from protocol import ConfigError
from protocol.config import (
    POLICY_NAMES,
    ConditionalDisaggConfig,
    EtcdSettings,
    NatsSettings,
    RouterSettings,
    check_env_names,
    check_file_keys,
    check_flag_only_env,
    env_names,
    file_keys,
    load_file,
    resolve,
)
from protocol.errors import VariableError


def test_defaults_match_design() -> None:
    c = ConditionalDisaggConfig().validate()
    assert (c.conditional_disagg_policy, c.eff_isl_threshold, c.eff_isl_ratio_threshold) == ("isl_bounding", 2048, 0.7)
    assert c.prefill_busy_threshold is None and c.decode_busy_threshold is None
    assert set(POLICY_NAMES) == {"isl_bounding", "prefill_load", "isl_or_load", "ttft_model", "slo_aware"}


@pytest.mark.parametrize(
    ("cli", "match"),
    [
        (
            {"conditional_disagg_policy": "fastest"},
            r"conditional_disagg_policy \(--conditional-disagg-policy, KVSWITCH_CONDITIONAL_DISAGG_POLICY\) = "
            r"'fastest': "
            r"allowed values: isl_bounding, prefill_load, isl_or_load, ttft_model",
        ),
        ({"eff_isl_threshold": -1}, r"eff_isl_threshold .* = -1: must be >= 0"),
        ({"eff_isl_ratio_threshold": 1.01}, r"eff_isl_ratio_threshold .* = 1.01: must be in \[0, 1\]"),
        ({"eff_isl_ratio_threshold": -0.1}, r"eff_isl_ratio_threshold .* = -0.1: must be in \[0, 1\]"),
        ({"prefill_busy_threshold": -2.0}, r"prefill_busy_threshold .* = -2.0: must be >= 0"),
        ({"decode_busy_threshold": -0.5}, r"decode_busy_threshold .* = -0.5: must be >= 0"),
        ({"queue_threshold": -1.0}, r"queue_threshold .* = -1.0: must be >= 0"),
        (
            {"conditional_disagg_policy": "prefill_load"},
            r"prefill_busy_threshold .*: policy prefill_load needs prefill_busy_threshold or queue_threshold",
        ),
        (
            {"conditional_disagg_policy": "isl_or_load"},
            r"prefill_busy_threshold .*: policy isl_or_load needs prefill_busy_threshold or queue_threshold",
        ),
        ({"routing": "fastest"}, r"routing \(--routing, KVSWITCH_ROUTING\) = 'fastest': allowed values: kv, "),
        ({"disagg": "sometimes"}, r"disagg .* = 'sometimes': allowed values: conditional, always, never"),
        ({"temperature": -1.0}, r"temperature .* must be >= 0"),
        (
            {"recompute_weight": -0.5},
            r"recompute_weight \(--recompute-weight, KVSWITCH_RECOMPUTE_WEIGHT\) = -0.5: must be >= 0",
        ),
        ({"ttft_link_gbps": 0.0}, r"ttft_link_gbps \(--ttft-link-gbps, KVSWITCH_TTFT_LINK_GBPS\) = 0.0: must be > 0"),
        ({"ttft_stall_weight": -0.1}, r"ttft_stall_weight .* = -0.1: must be >= 0"),
        ({"eff_isl_threshold": "many"}, r"eff_isl_threshold .* = 'many': Expected `int`, got `str`"),
    ],
)
def test_invalid_router_settings_name_the_setting(cli: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        resolve(RouterSettings, cli=cli, env={})


@pytest.mark.parametrize("ratio", [0.0, 1.0])
def test_ratio_bounds_are_inclusive(ratio: float) -> None:
    assert (
        resolve(RouterSettings, cli={"eff_isl_ratio_threshold": ratio}, env={}).conditional.eff_isl_ratio_threshold
        == ratio
    )


@pytest.mark.parametrize(
    "name", ["eff_isl_threshold", "prefill_busy_threshold", "queue_threshold", "decode_busy_threshold"]
)
def test_thresholds_of_zero_are_accepted(name: str) -> None:
    # DESIGN.md: thresholds >= 0 (a `<= 0` check refusing 0 passed every other test)
    assert getattr(resolve(RouterSettings, cli={name: 0}, env={}).conditional, name) == 0


@pytest.mark.parametrize(
    ("cli", "busy"),
    [
        ({"prefill_busy_threshold": 2.0}, 2.0),
        ({"queue_threshold": 1.5}, 1.5),
        ({"prefill_busy_threshold": 0.5, "queue_threshold": 3.0}, 0.5),
    ],
)
def test_load_policy_threshold_inherits_queue_threshold(cli: dict[str, object], busy: float) -> None:
    s = resolve(RouterSettings, cli={"conditional_disagg_policy": "prefill_load", **cli}, env={})
    assert s.conditional.effective_prefill_busy_threshold == busy


def test_precedence_cli_over_env_over_file_over_default() -> None:
    file = {"eff_isl_threshold": 100, "eff_isl_ratio_threshold": 0.5, "temperature": 0.3}
    env = {"KVSWITCH_EFF_ISL_THRESHOLD": "200", "KVSWITCH_EFF_ISL_RATIO_THRESHOLD": "0.6"}
    s = resolve(RouterSettings, cli={"eff_isl_threshold": 300, "temperature": None}, env=env, file=file)
    assert s.conditional.eff_isl_threshold == 300  # CLI
    assert s.conditional.eff_isl_ratio_threshold == 0.6  # env
    assert s.temperature == 0.3  # file
    assert s.routing == "kv"  # default


def test_file_may_nest_the_conditional_section(tmp_path: Path) -> None:
    path = tmp_path / "router.yaml"
    path.write_text("routing: least_loaded\nconditional:\n  conditional_disagg: true\n  eff_isl_threshold: 512\n")
    s = resolve(RouterSettings, file=load_file(path), env={})
    assert s.routing == "least_loaded"
    assert s.conditional.conditional_disagg and s.conditional.eff_isl_threshold == 512


@pytest.mark.parametrize("section", ["5", "[eff_isl_threshold]", "x", "true"])
def test_a_conditional_section_that_is_no_mapping_is_refused(tmp_path: Path, section: str) -> None:
    """Dropped without a word, it would leave every conditional setting at its default."""
    path = tmp_path / "router.yaml"
    path.write_text(f"conditional: {section}\n")
    with pytest.raises(ConfigError) as err:
        resolve(RouterSettings, file=load_file(path), env={})
    assert err.value.setting == "config"
    assert "'conditional' must be a mapping of conditional_disagg, conditional_disagg_policy," in str(err.value)
    assert "eff_isl_threshold" in err.value.allowed


def test_an_unknown_key_in_the_conditional_section_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "router.yaml"
    path.write_text("conditional:\n  eff_isl_treshold: 512\n")
    with pytest.raises(ConfigError, match=r"'eff_isl_treshold' is not a setting of 'conditional'; did you mean"):
        resolve(RouterSettings, file=load_file(path), env={})


@pytest.mark.parametrize(
    "text",
    [
        "conditional:\n  eff_isl_threshold: 5\neff_isl_threshold: 7\n",
        "eff_isl_threshold: 7\nconditional:\n  eff_isl_threshold: 5\n",
        "eff_isl_threshold: 5\nconditional:\n  eff_isl_threshold: 5\n",  # equal values too
        "conditional:\n  conditional_disagg: true\nconditional_disagg: false\n",
    ],
)
def test_a_setting_both_top_level_and_in_the_conditional_section_is_refused(tmp_path: Path, text: str) -> None:
    """The section's value won silently, whichever came first in the file."""
    path = tmp_path / "router.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=r"is given both top-level and under 'conditional': give it in one place"):
        resolve(RouterSettings, file=load_file(path), env={})


@pytest.mark.parametrize(
    ("text", "setting", "short"),
    [
        ("nats_servers: [nats://a:1]\nservers: [nats://b:1]\n", "nats_servers", "servers"),
        ("servers: [nats://a:1]\nnats_servers: [nats://a:1]\n", "nats_servers", "servers"),
        ("nats_token: aaa\ntoken: bbb\n", "nats_token", "token"),
        ("etcd_endpoints: [http://a:1]\nendpoints: [http://b:1]\n", "etcd_endpoints", "endpoints"),
    ],
)
def test_a_setting_under_both_its_full_and_its_short_name_is_refused(
    tmp_path: Path, text: str, setting: str, short: str
) -> None:
    """The full name won silently, whichever came first in the file, equal values or not (review,
    2026-12-07); a flag over both does not make the file right."""
    path = tmp_path / "kvswitch.yaml"
    path.write_text(text)
    flag = {"nats_servers": ["nats://c:1"], "nats_token": "ccc", "etcd_endpoints": ["http://c:1"]}[setting]
    for cli in ({}, {setting: flag}):
        with pytest.raises(ConfigError) as err:
            if setting.startswith("nats_"):
                resolve(NatsSettings, cli=cli, file=load_file(path), env={}, setting_prefix="nats_")
            else:
                resolve(EtcdSettings, cli=cli, file=load_file(path), env={}, setting_prefix="etcd_")
        assert err.value.setting == setting
        assert f"the config file gives it twice, as {setting!r} and as {short!r}: keep one" in str(err.value)
        assert "aaa" not in str(err.value) and "bbb" not in str(err.value)


def test_an_empty_conditional_section_is_none(tmp_path: Path) -> None:
    path = tmp_path / "router.yaml"
    path.write_text("eff_isl_threshold: 300\nconditional:\n")
    assert resolve(RouterSettings, file=load_file(path), env={}).conditional.eff_isl_threshold == 300


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("eff_isl_threshold: 5\nrouting: random\neff_isl_threshold: 7\n", "eff_isl_threshold"),
        ("conditional:\n  queue_threshold: 1\n  queue_threshold: 2\n", "queue_threshold"),
    ],
)
def test_a_yaml_key_given_twice_is_refused_not_the_last_taken(tmp_path: Path, text: str, key: str) -> None:
    """PyYAML keeps the last of two equal keys without a word; TOML refuses them."""
    path = tmp_path / "router.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=f"found the key '{key}' twice"):
        load_file(path)


def test_yaml_merge_keys_may_be_overridden_beside_them(tmp_path: Path) -> None:
    path = tmp_path / "router.yaml"
    path.write_text("base: &b {queue_threshold: 1, routing: random}\nconditional:\n  <<: *b\n  queue_threshold: 2\n")
    assert load_file(path)["conditional"] == {"queue_threshold": 2, "routing": "random"}


def test_toml_file(tmp_path: Path) -> None:
    path = tmp_path / "router.toml"
    path.write_text('routing = "random"\nqueue_threshold = 2.5\n')
    s = resolve(RouterSettings, file=load_file(path), env={})
    assert s.routing == "random" and s.conditional.queue_threshold == 2.5


@pytest.mark.parametrize(
    ("name", "text", "match"),
    [
        ("x.json", "{}", "must end in .yaml"),
        ("x.yaml", "a: [", "not valid YAML"),
        ("x.toml", "a = ", "not valid TOML"),
        ("x.yaml", "- 1\n- 2\n", "top level must be a mapping"),
    ],
)
def test_bad_config_file_is_refused(tmp_path: Path, name: str, text: str, match: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        load_file(path)


@pytest.mark.parametrize(
    "line",
    ["nats_password: @Hunter2secret", 'nats_password: "Hunter2secret', "nats_password: *Hunter2secret"],
)
def test_a_yaml_error_says_where_without_the_line_it_is_on(tmp_path: Path, line: str) -> None:
    # PyYAML's text quotes the offending line: a password that began with `@` or had an unclosed
    # quote was printed to stderr, into the logs
    path = tmp_path / "r.yaml"
    path.write_text(f"routing: kv\n{line}\n")
    with pytest.raises(ConfigError, match=r"not valid YAML: .*\(at line \d+, column \d+\)") as err:
        load_file(path)
    assert "Hunter2" not in str(err.value)


def test_missing_config_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read") as err:
        load_file(tmp_path / "nope.yaml")
    # --config is a flag only: the message named a KVSWITCH_CONFIG that nothing reads
    assert str(err.value).startswith("invalid config (--config) = ")


def test_nats_settings_from_env_list() -> None:
    s = resolve(NatsSettings, env={"KVSWITCH_NATS_SERVERS": "nats://a:1, nats://b:2"}, setting_prefix="nats_")
    assert s.servers == ["nats://a:1", "nats://b:2"]


@pytest.mark.parametrize(
    ("cli", "match"),
    [
        ({"nats_servers": ["http://x:1"]}, r"nats_servers .* must start with nats://"),
        ({"nats_user": "u"}, "nats_user and nats_password go together"),
        ({"nats_tls_cert": "/c"}, "nats_tls_cert and nats_tls_key go together"),
        ({"nats_creds_file": "/definitely/missing.creds"}, r"nats_creds_file .* must name a readable file"),
        # a traceback from nats-py at the first connection before
        ({"nats_servers": ["nats://127.0.0.1:-1"]}, r"nats_servers .* the port must be a number in 1\.\.65535"),
        ({"nats_servers": ["nats://a:1", "tls://b:abc"]}, r"'tls://b:abc': the port must be a number"),
        ({"nats_servers": ["nats://:4222"]}, "the URL names no host"),
    ],
)
def test_invalid_nats_settings(cli: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        resolve(NatsSettings, cli=cli, env={}, setting_prefix="nats_")


def test_a_comma_in_a_urls_password_is_refused_without_showing_it() -> None:
    # the list was split there and the first piece, with no `@` to redact at, was shown
    env = {"KVSWITCH_NATS_SERVERS": "nats://alice:Hunter2,secret@127.0.0.1:4222"}
    with pytest.raises(ConfigError, match="percent-encode it as %2C") as err:
        resolve(NatsSettings, env=env, setting_prefix="nats_")
    assert "Hunter2" not in str(err.value) and "secret@" not in str(err.value)


@pytest.mark.parametrize(
    ("cli", "match"),
    [
        ({"etcd_endpoints": ["127.0.0.1:2379"]}, "must start with http:// or https://"),
        ({"etcd_password": "p"}, "etcd_user and etcd_password go together"),
        ({"etcd_tls_ca": "/definitely/missing.pem"}, "must name a readable file"),
        ({"etcd_endpoints": ["http://127.0.0.1:99999"]}, "the port must be a number in 1..65535"),  # a raw gRPC error
        ({"etcd_endpoints": ["http://127.0.0.1:0"]}, "the port must be a number in 1..65535"),
    ],
)
def test_invalid_etcd_settings(cli: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        resolve(EtcdSettings, cli=cli, env={}, setting_prefix="etcd_")


def test_etcd_settings_with_auth_and_tls_files(tmp_path: Path) -> None:
    tls = write_tls(tmp_path, ["e"]).etcd
    s = resolve(
        EtcdSettings,
        cli={
            "etcd_user": "u",
            "etcd_password": "p",
            "etcd_tls_ca": str(tls.ca),
            "etcd_tls_cert": str(tls.cert),
            "etcd_tls_key": str(tls.key),
            "etcd_endpoints": ["https://e:2379"],
        },
        env={},
        setting_prefix="etcd_",
    )
    assert (s.user, s.tls_ca) == ("u", str(tls.ca))


def _creds() -> str:
    """A NATS creds file's layout, with a real seed (its content is parsed at start)."""
    return (
        "-----BEGIN NATS USER JWT-----\neyJ0eXAiOiJqd3QifQ.e30.sig\n------END NATS USER JWT------\n\n"
        f"-----BEGIN USER NKEY SEED-----\n{_seed()}------END USER NKEY SEED------\n"
    )


def _seed() -> str:
    seed: bytes = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    return seed.decode() + "\n"


@pytest.fixture(scope="module")
def valid(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """What each credential file holds when it is right: a placeholder no longer passes."""
    ca = write_tls(tmp_path_factory.mktemp("tls"), ["e"]).ca.read_text()
    return {"nats_nkey_file": _seed(), "nats_creds_file": _creds(), "nats_tls_ca": ca, "etcd_tls_ca": ca}


def _said(setting: str, path: str) -> str:
    """What resolving one file setting says: "ok", or its ConfigError."""
    schema, cli = (
        (EtcdSettings, {"etcd_endpoints": ["https://e:2379"]}) if setting[:5] == "etcd_" else (NatsSettings, {})
    )
    try:
        resolve(schema, cli={**cli, setting: path}, env={}, setting_prefix=setting[:5])
    except ConfigError as exc:
        return str(exc)
    return "ok"


@contextmanager
def _unprivileged() -> Iterator[None]:
    """Bound by file permissions meanwhile: root reads any file, so as root (CI) act as `nobody`,
    with the effective ids only, which root may take back."""
    if os.geteuid() != 0:
        yield
        return
    gid = os.getegid()
    os.setegid(65534)
    os.seteuid(65534)
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(gid)


@pytest.mark.parametrize("setting", ["nats_nkey_file", "nats_creds_file", "nats_tls_ca", "etcd_tls_ca"])
def test_an_existing_file_the_process_may_not_read_is_refused_naming_the_flag(
    setting: str, valid: dict[str, str]
) -> None:
    """A Secret file the kubelet wrote root:root 0400, read as uid 10001: is_file() passed it, and
    the process died at its first connect with a traceback and exit status 1."""
    with tempfile.TemporaryDirectory() as directory:
        os.chmod(directory, 0o755)  # nobody must reach both files, so only the mode can refuse one
        readable, secret = Path(directory, "readable"), Path(directory, "secret")
        for path, mode in ((readable, 0o444), (secret, 0o400 if os.geteuid() == 0 else 0)):
            path.write_text(valid[setting])
            path.chmod(mode)
        with _unprivileged():
            ok, refused = _said(setting, str(readable)), _said(setting, str(secret))
    assert ok == "ok"
    flag = setting.replace("_", "-")
    assert refused.startswith(f"invalid {setting} (--{flag}, KVSWITCH_{setting.upper()}) = '{secret}': "), refused
    assert refused.endswith(": must name a readable file (Permission denied)"), refused


@pytest.mark.parametrize(
    ("cli", "match"),
    [
        # without a CA the client would speak plaintext to a TLS server
        ({"etcd_endpoints": ["https://e:2379"]}, r"etcd_tls_ca .* = None: https://e:2379 speaks TLS"),
        ({"etcd_tls_cert": "cert", "etcd_tls_key": "key"}, r"etcd_tls_ca .* etcd_tls_cert and etcd_tls_key need"),
        ({"etcd_tls_ca": "ca"}, r"etcd_endpoints .* = 'http://127.0.0.1:2379': with etcd_tls_ca every URL must be"),
        (
            {"etcd_tls_ca": "ca", "etcd_endpoints": ["https://a:1", "http://b:1"]},
            r"etcd_endpoints .* = 'http://b:1'",
        ),
        ({"etcd_tls_ca": "ca", "etcd_endpoints": ["https://e:1"], "etcd_tls_cert": "cert"}, "go together"),
    ],
)
def test_etcd_tls_settings_that_would_not_speak_tls_are_refused(
    cli: dict[str, object], match: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tls = write_tls(tmp_path, ["e"]).etcd
    for n, path in (("ca", tls.ca), ("cert", tls.cert), ("key", tls.key)):
        (tmp_path / n).write_bytes(path.read_bytes())
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=match):
        resolve(EtcdSettings, cli=cli, env={}, setting_prefix="etcd_")
    assert resolve(
        EtcdSettings, cli={"etcd_endpoints": ["https://e:1"], "etcd_tls_ca": "ca"}, env={}, setting_prefix="etcd_"
    )


@pytest.mark.parametrize("value", [0.002, 0.049])
def test_a_stream_heartbeat_too_short_to_tell_a_dead_worker_is_refused(value: float) -> None:
    with pytest.raises(
        ConfigError, match=rf"stream_heartbeat_s \(--stream-heartbeat-s, .*\) = {value}: must be >= 0.05"
    ):
        resolve(RouterSettings, cli={"stream_heartbeat_s": value}, env={})
    assert resolve(RouterSettings, cli={"stream_heartbeat_s": 0.05}, env={}).stream_heartbeat_s == 0.05


@pytest.mark.parametrize("disagg", ["always", "never"])
def test_conditional_disagg_with_a_fixed_mode_is_refused(disagg: str) -> None:
    with pytest.raises(ConfigError, match=rf"conditional_disagg .* needs disagg=conditional \(disagg={disagg}"):
        resolve(RouterSettings, cli={"conditional_disagg": True, "disagg": disagg}, env={})
    # the same from a live change on top of a flag (discovery.live_config resolves it this way)
    with pytest.raises(ConfigError, match="conditional_disagg"):
        resolve(RouterSettings, cli={"conditional_disagg": True}, file={"disagg": disagg}, env={})
    assert resolve(RouterSettings, cli={"disagg": disagg}, env={}).disagg == disagg


def test_nats_connect_options_carry_every_setting(tmp_path: Path) -> None:
    creds = tmp_path / "u.creds"
    creds.write_text(_creds())
    # one credential each (two that nats-py would not both send are refused: test_config_credentials)
    user = resolve(
        NatsSettings, cli={"nats_user": "u", "nats_password": "p"}, env={}, setting_prefix="nats_"
    ).connect_options("me")
    assert (user["user"], user["password"]) == ("u", "p")
    s = resolve(
        NatsSettings,
        cli={"nats_servers": ["nats://h:1"], "nats_token": "t", "nats_creds_file": str(creds)},
        env={}, setting_prefix="nats_",
    )  # fmt: skip
    opts = s.connect_options("me")
    assert opts["servers"] == ["nats://h:1"] and opts["name"] == "me"
    assert opts["token"] == "t"
    assert opts["user_credentials"] == str(creds)
    assert opts["max_reconnect_attempts"] == -1
    assert "tls" not in opts
    # nats-py's own 120 s x 2 held a frozen server's clients for 4-6 minutes
    assert (opts["ping_interval"], opts["max_outstanding_pings"]) == (5.0, 3)


def test_the_nats_ping_interval_comes_from_the_flag_or_the_environment() -> None:
    flag = resolve(NatsSettings, cli={"nats_ping_interval_s": 2.5}, env={}, setting_prefix="nats_")
    assert flag.connect_options("me")["ping_interval"] == 2.5
    env = resolve(NatsSettings, env={"KVSWITCH_NATS_PING_INTERVAL_S": "30"}, setting_prefix="nats_")
    assert env.connect_options("me")["ping_interval"] == 30.0


# 0.5 and 1 s were allowed: a process behind on reading read a healthy server's PONG late and left it.
@pytest.mark.parametrize("value", [0.0, 0.5, 1.0, 1.9, 120.5, -1.0, float("nan"), float("inf")])
def test_a_nats_ping_interval_out_of_range_is_refused(value: float) -> None:
    with pytest.raises(
        ConfigError,
        match=r"nats_ping_interval_s \(--nats-ping-interval-s, KVSWITCH_NATS_PING_INTERVAL_S\) = .*: "
        r"must be in \[2, 120\] seconds \(a silent server is left after 3-4 of them; below 2 s, a process behind "
        r"on reading reads a healthy server's PONG late and leaves it\)",
    ):
        resolve(NatsSettings, cli={"nats_ping_interval_s": value}, env={}, setting_prefix="nats_")
    for edge in (2.0, 120.0):
        assert (
            resolve(NatsSettings, cli={"nats_ping_interval_s": edge}, env={}, setting_prefix="nats_").ping_interval_s
            == edge
        )


def test_add_flags_gives_every_setting_a_flag_that_resolve_reads() -> None:
    import argparse

    from protocol.config import add_flags

    parser = argparse.ArgumentParser()
    add_flags(parser, RouterSettings)
    add_flags(parser, NatsSettings, "nats_")
    args = parser.parse_args(
        [
            "--nats-servers",
            "nats://a:1, nats://b:2",
            "--conditional-disagg",
            "--routing",
            "random",
            "--eff-isl-threshold",
            "9",
        ]
    )
    given = vars(args)
    assert resolve(NatsSettings, cli=given, env={}, setting_prefix="nats_").servers == ["nats://a:1", "nats://b:2"]
    s = resolve(RouterSettings, cli=given, env={})
    assert (s.routing, s.conditional.conditional_disagg, s.conditional.eff_isl_threshold) == ("random", True, 9)
    assert given["temperature"] is None  # absent flags fall through to env, file and default
    with pytest.raises(SystemExit):
        parser.parse_args(["--routing", "fastest"])


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_non_finite_numbers_are_refused_naming_the_setting(value: str) -> None:
    with pytest.raises(ConfigError, match=r"overlap_weight.*finite"):
        resolve(RouterSettings, cli={"overlap_weight": float(value)}, env={})
    with pytest.raises(ConfigError, match=r"decode_busy_threshold.*finite"):
        resolve(RouterSettings, cli={"decode_busy_threshold": float(value)}, env={})


def test_a_file_key_no_setting_reads_is_refused_with_the_nearest(tmp_path: Path) -> None:
    allowed = file_keys(RouterSettings) | file_keys(NatsSettings, "nats_")
    assert {"queue_threshold", "conditional", "eff_isl_threshold", "nats_servers", "servers"} <= allowed
    check_file_keys({"routing": "kv", "conditional": {"eff_isl_threshold": 5}, "nats_servers": []}, allowed, "f.yaml")
    with pytest.raises(ConfigError, match="'queue_threshod' is not a setting; did you mean 'queue_threshold'"):
        check_file_keys({"queue_threshod": 2}, allowed, "f.yaml")
    with pytest.raises(ConfigError, match="'zzz' is not a setting \\(the settings"):
        check_file_keys({"zzz": 1}, allowed, "f.yaml")


def test_env_names_are_the_variables_resolve_reads() -> None:
    names = env_names(RouterSettings)
    assert {"KVSWITCH_ROUTING", "KVSWITCH_DISAGG", "KVSWITCH_CONDITIONAL_DISAGG_POLICY"} <= names  # nested flattened
    assert "KVSWITCH_CONDITIONAL" not in names  # the section's own name is a file key, no variable
    assert env_names(NatsSettings, "nats_") >= {"KVSWITCH_NATS_SERVERS", "KVSWITCH_NATS_PING_INTERVAL_S"}
    for name in sorted(names):  # each one is read: a bad value is refused naming it
        with pytest.raises(ConfigError, match=name):
            resolve(RouterSettings, env={name: "[not a value]"})


def test_a_variable_no_setting_reads_is_refused_with_the_nearest() -> None:
    """Audit 2026-12-07: KVSWITCH_DISAG=never started with disagg=conditional without a word."""
    known = env_names(RouterSettings)
    check_env_names(known, env={"KVSWITCH_DISAGG": "never", "PATH": "/bin", "KVSWITCHED": "1"})
    with pytest.raises(VariableError) as err:
        check_env_names(known, env={"KVSWITCH_DISAG": "never", "KVSWITCH_ROUTING": "kv"})
    assert str(err.value) == "KVSWITCH_DISAG is no kvswitch setting (did you mean KVSWITCH_DISAGG?)"
    assert isinstance(err.value, ConfigError)  # each process exits 2 on it, as on any config error
    with pytest.raises(VariableError, match=r"^KVSWITCH_QQQQ is no kvswitch setting$"):
        check_env_names(known, env={"KVSWITCH_QQQQ": "1"})


@pytest.mark.parametrize("value", ["yes", "on", "", "2"])
def test_a_bad_boolean_is_refused_listing_the_spellings_taken(value: str) -> None:
    with pytest.raises(ConfigError) as err:
        resolve(RouterSettings, env={"KVSWITCH_CONDITIONAL_DISAGG": value})
    said = str(err.value)
    assert said.startswith(
        f"invalid conditional_disagg (--conditional-disagg, KVSWITCH_CONDITIONAL_DISAGG) = {value!r}"
    )
    assert said.endswith("allowed values: true, false, 1, 0 (true and false in any case)"), said


@pytest.mark.parametrize(("value", "on"), [("true", True), ("TRUE", True), ("False", False), ("1", True), ("0", False)])
def test_every_listed_boolean_spelling_is_taken(value: str, on: bool) -> None:
    settings = resolve(RouterSettings, env={"KVSWITCH_CONDITIONAL_DISAGG": value})
    assert settings.conditional.conditional_disagg is on


@pytest.mark.parametrize("value", ["true", "false", ""])
def test_a_variable_of_a_flag_only_switch_is_refused_naming_the_flag(value: str) -> None:
    """resolve() reads no such variable: ignored, the switch stayed off while its user believed it on."""
    check_flag_only_env(["no_api_keys"], env={"KVSWITCH_NO_API_KEYS_FILE": "x", "KVSWITCH_HTTP_HOST": "h"})
    check_flag_only_env(["http_host"], env={"KVSWITCH_HTTP_HOST": "h"})  # a process's other flags have variables
    with pytest.raises(ConfigError) as err:
        check_flag_only_env(["http_host", "config", "no_api_keys"], env={"KVSWITCH_NO_API_KEYS": value})
    assert (err.value.setting, err.value.value) == ("no_api_keys", value)
    # It named the variable as a way to set it, then said it was not read (ConfigError kept a list of
    # its own, which had --config alone).
    assert str(err.value).startswith(f"invalid no_api_keys (--no-api-keys) = {value!r}: KVSWITCH_NO_API_KEYS is not")
    assert "KVSWITCH_NO_API_KEYS is not read: --no-api-keys is a flag only" in str(err.value)
    assert "pass --no-api-keys on the command line and unset KVSWITCH_NO_API_KEYS" in str(err.value)
