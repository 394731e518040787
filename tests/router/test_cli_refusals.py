"""`kvswitch router`: a setting refused at startup is one line naming its flag, before NATS or etcd."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvswitch.nats_auth import MAX_RESPONSE_TTL_S
from protocol import ConfigError
from protocol.config import EtcdSettings, NatsSettings, RouterSettings, file_keys, flat_names
from protocol.errors import FLAG_ONLY
from router import cli


def test_a_tokenizer_that_cannot_be_loaded_is_refused_naming_the_flag() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvswitch", "router", "--tokenizer", "/nonexistent",
         "--nats-servers", "nats://127.0.0.1:1", "--etcd-endpoints", "http://127.0.0.1:1"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0] == (
        "kvswitch router: invalid tokenizer (--tokenizer, KVSWITCH_TOKENIZER) = '/nonexistent': "
        "no such file or directory: /nonexistent"
    )
    assert "NATS" not in out.stderr


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize(
    ("env", "flag"),
    [
        ({"KVSWITCH_NO_API_KEYS": "true", "KVSWITCH_HTTP_HOST": "0.0.0.0"}, "--no-api-keys"),
        ({"KVSWITCH_TRUST_REQUEST_CHAT_TEMPLATE": "true"}, "--trust-request-chat-template"),
        ({"KVSWITCH_CONFIG": "/etc/kvswitch/router.yaml"}, "--config"),
    ],
)
def test_a_flag_only_switch_set_in_the_environment_is_refused_naming_the_flag(
    env: dict[str, str], flag: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It was ignored: KVSWITCH_NO_API_KEYS then got "give ... --no-api-keys", which its user thought given.
    The message names the flag alone: it named the variable too, as a way to set it, in the breath
    that said it was not read (the flag-only list was written twice, and ConfigError's had --config alone)."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=rf"is not read: {flag} is a flag only .*pass {flag} on the command line"):
        cli.build_config(_args())
    with pytest.raises(ConfigError) as err:
        cli.build_config(_args())
    variable = "KVSWITCH_" + flag.removeprefix("--").replace("-", "_").upper()
    assert str(err.value).startswith(
        f"invalid {err.value.setting} ({flag}) = {env[variable]!r}: {variable} is not read"
    )


def test_every_flag_no_setting_reads_is_flag_only() -> None:
    """A new flag without a variable must be listed, or its variable is ignored without a word."""
    settings = (
        file_keys(cli.ProcessSettings)
        | set(flat_names(RouterSettings))
        | {f"nats_{n}" for n in flat_names(NatsSettings)}
        | {f"etcd_{n}" for n in flat_names(EtcdSettings)}
    )
    assert set(vars(_args())) - settings == FLAG_ONLY


def test_no_deployment_file_sets_a_flag_only_variable() -> None:
    """Compose and Kubernetes files share one environment between processes: none may be refused."""
    root = Path(__file__).resolve().parents[2]
    texts = [p.read_text() for p in (root / "deploy").rglob("*.y*ml")] + [(root / "docker-compose.yml").read_text()]
    used = {name for text in texts for name in re.findall(r"KVSWITCH_[A-Z0-9_]+", text)}
    assert used and not used & {f"KVSWITCH_{n.upper()}" for n in FLAG_ONLY}


@pytest.mark.parametrize("host", ["999.1.1.1", "bogus.invalid", "192.0.2.1"])
@pytest.mark.parametrize("no_keys", [[], ["--no-api-keys"]])
def test_a_host_it_cannot_listen_on_is_refused_as_http_host_before_the_api_keys(host: str, no_keys: list[str]) -> None:
    """Without --no-api-keys it was blamed on a missing --api-keys-file ("serves beyond this machine")."""
    with pytest.raises(ConfigError) as err:
        cli.build_config(_args("--http-host", host, *no_keys))
    assert (err.value.setting, err.value.value) == ("http_host", host)
    assert "give a name or address of this host" in str(err.value)


@pytest.mark.parametrize("key", ["user", "password", "tls_ca", "tls_cert", "tls_key"])
def test_a_file_key_that_would_set_both_nats_and_etcd_is_refused_without_its_value(key: str, tmp_path: Path) -> None:
    # A bare field name is read too: `password` set the NATS and the etcd password alike, silently.
    path = tmp_path / "router.yaml"
    path.write_text(f"{key}: s3cret\n")
    with pytest.raises(ConfigError) as err:
        cli.build_config(_args("--config", str(path)))
    assert f"'{key}' would set nats_{key} and etcd_{key}" in str(err.value)
    assert "s3cret" not in str(err.value)
    path.write_text(f"etcd_{key}: s3cret\nservers: [nats://127.0.0.1:4222]\n")  # one reader: as before
    with pytest.raises(ConfigError) as err:
        cli.build_config(_args("--config", str(path)))
    assert "would set" not in str(err.value)


def test_a_token_beside_a_user_and_password_is_refused_at_startup() -> None:
    """nats-py sent the user and password alone: against a token server the router started and
    retried 'Authorization Violation' for ever (review, 2026-12-07). Both by flag: neither shadows
    the other, and the refusal says where each came from."""
    with pytest.raises(ConfigError) as err:
        cli.build_config(_args("--nats-token", "s3cret", "--nats-user", "ops", "--nats-password", "pw"))
    assert str(err.value).startswith("invalid nats_user (--nats-user, KVSWITCH_NATS_USER) = 'ops': give one NATS")
    assert "nats_token (--nats-token, KVSWITCH_NATS_TOKEN)" in str(err.value) and "s3cret" not in str(err.value)
    assert "(one from --nats-user and --nats-password, the other from --nats-token)" in str(err.value)


def test_a_user_and_password_by_flag_set_aside_a_token_from_the_config_file_saying_so(tmp_path: Path) -> None:
    """A token in the config file refused `--nats-user ops --nats-password pw` naming --nats-token,
    which the operator never set (review of 15fec0f, finding 2): a flag shadows the file, for a
    credential of another kind as for any setting, and the process says so at INFO in its log."""
    path = tmp_path / "router.yaml"
    path.write_text("nats_token: s3cret-file\nnats_servers: [nats://127.0.0.1:1]\n")
    given = ("--config", str(path), "--nats-user", "ops", "--nats-password", "pw")
    opts = cli.build_config(_args(*given)).nats.connect_options("x")
    assert (opts["user"], opts["password"]) == ("ops", "pw") and "token" not in opts
    out = subprocess.run(
        [sys.executable, "-m", "kvswitch", "router", *given, "--tokenizer", "/nonexistent",
         "--etcd-endpoints", "http://127.0.0.1:1"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    # The tokenizer's refusal comes after the settings resolved, before NATS: the line was said by then.
    assert out.returncode == 2 and "kvswitch router: invalid tokenizer" in out.stderr, out.stderr
    assert (
        f"INFO kvswitch.config: NATS credential nats_token (nats_token in {path}) set aside: nats_user/nats_password "
        "(--nats-user and --nats-password) shadows it, given above it (flag > environment > config file)"
    ) in out.stderr, out.stderr
    assert "s3cret" not in out.stderr


@pytest.mark.parametrize("flag", ["--body-timeout-s", "--idle-timeout-s"])
@pytest.mark.parametrize("value", ["0", "inf", "-1"])
def test_a_front_door_timeout_that_is_not_finite_and_positive_is_refused_naming_it(flag: str, value: str) -> None:
    with pytest.raises(ConfigError) as err:
        cli.build_config(_args(flag, value))
    assert flag in str(err.value)


@pytest.mark.parametrize(
    ("flag", "value", "allowed"),
    [
        ("--kv-budget-batches-per-s", "100", "[500, 1e+06]"),
        ("--kv-budget-batches-per-s", "400", "[500, 1e+06]"),
        ("--kv-budget-batch-burst", "10", "[1000, 1e+07]"),
        ("--kv-budget-mib-per-s", "nan", "[2, 4096]"),
        ("--kv-budget-mib-per-s", "1.5", "[2, 4096]"),
        ("--kv-budget-mib-burst", "1", "[4, 40960]"),
    ],
)
def test_a_kv_budget_an_honest_shim_would_pass_is_refused_naming_the_flag_and_range(
    flag: str, value: str, allowed: str
) -> None:
    with pytest.raises(ConfigError) as err:
        cli.build_config(_args(flag, value))
    assert flag in str(err.value) and allowed in str(err.value)


def test_the_kv_budget_flags_reach_the_router() -> None:
    config = cli.build_config(_args("--kv-budget-batches-per-s", "2000", "--kv-budget-mib-burst", "16"))
    budget = config.kv_budget.budget()
    assert (budget.rate_per_s, budget.burst, budget.bytes_per_s, budget.bytes_burst) == (2000, 5000, 4 << 20, 16 << 20)


@pytest.mark.parametrize("value", ["string", "openai"])
@pytest.mark.parametrize("given", ["flag", "env"])
def test_a_chat_template_content_format_without_a_tokenizer_is_refused_naming_it(
    value: str, given: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Config review of 2026-12-07, finding 7: the built-in tokenizer ignored it (as it would
    --default-chat-template-kwargs, which was refused), and the router started."""
    if given == "env":
        monkeypatch.setenv("KVSWITCH_CHAT_TEMPLATE_CONTENT_FORMAT", value)
    argv = ["--chat-template-content-format", value] if given == "flag" else []
    with pytest.raises(ConfigError) as err:
        cli.build_config(_args(*argv))
    assert (err.value.setting, err.value.value) == ("chat_template_content_format", value)
    assert "read with --tokenizer only" in str(err.value), err.value
    assert cli.build_config(_args("--chat-template-content-format", "auto")).chat_template_content_format == "auto"


@pytest.mark.parametrize("given", ["flag", "env"])
def test_no_api_keys_beside_an_api_keys_file_is_refused_naming_both(
    given: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Config review of 2026-12-07, finding 7: --no-api-keys was ignored, and the keys required."""
    keys = tmp_path / "api-keys"
    keys.write_text("sk-a\n")
    keys.chmod(0o600)
    if given == "env":
        monkeypatch.setenv("KVSWITCH_API_KEYS_FILE", str(keys))
    argv = ["--api-keys-file", str(keys)] if given == "flag" else []
    with pytest.raises(ConfigError) as err:
        cli.build_config(_args(*argv, "--http-host", "0.0.0.0", "--no-api-keys"))
    said = str(err.value)
    assert said.startswith("invalid no_api_keys (--no-api-keys) = True: read without an API keys file only"), said
    assert f"--api-keys-file, KVSWITCH_API_KEYS_FILE gives {keys}" in said
    assert cli.build_config(_args(*argv, "--http-host", "0.0.0.0")).api_keys_file == str(keys)


def test_a_request_timeout_no_workers_reply_leave_can_outlive_is_refused() -> None:
    """Review of fb2b841, finding 3: kvswitch secrets takes --response-ttl up to a day, to be given
    above every router's --request-timeout, which took any number: a router at 100000 s came up,
    and a worker's reply to a request older than the leave it was given was refused."""
    longest = MAX_RESPONSE_TTL_S - 0.5  # the longest leave kvswitch secrets writes is above it
    assert cli.build_config(_args("--request-timeout", str(longest))).request_timeout_s == longest
    for too_long in (MAX_RESPONSE_TTL_S, 1e12):
        with pytest.raises(ConfigError) as err:
            cli.build_config(_args("--request-timeout", str(too_long)))
        assert err.value.setting == "request_timeout", err.value
        assert f"< {MAX_RESPONSE_TTL_S} (a day: kvswitch secrets --response-ttl" in str(err.value), err.value


@pytest.mark.parametrize("value", ["7", "0", "-1", "1048577"])
@pytest.mark.parametrize("given", ["flag", "env"])
def test_a_client_buffer_outside_its_range_is_refused_naming_the_flag_and_range(
    value: str, given: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if given == "env":
        monkeypatch.setenv("KVSWITCH_CLIENT_BUFFER_MIB", value)
    with pytest.raises(ConfigError) as err:
        cli.build_config(_args(*(["--client-buffer-mib", value] if given == "flag" else [])))
    assert "--client-buffer-mib" in str(err.value) and "[8, 1048576]" in str(err.value), err.value


def test_the_client_buffer_reaches_the_router_in_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    assert cli.build_config(_args()).client_buffer_bytes == 512 << 20
    assert cli.build_config(_args("--client-buffer-mib", "64")).client_buffer_bytes == 64 << 20
    monkeypatch.setenv("KVSWITCH_CLIENT_BUFFER_MIB", "32")
    assert cli.build_config(_args()).client_buffer_bytes == 32 << 20
