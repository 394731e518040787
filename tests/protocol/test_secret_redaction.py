"""A ConfigError is printed at startup and logged: it never shows a password's or token's value,
nor the `user:password@` of a URL, and the credential a NATS server refuses is named even when it
rode in the URL."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from protocol import ConfigError
from protocol.config import EtcdSettings, NatsSettings, resolve
from protocol.errors import without_userinfo

SECRET = "S3cret-9f8e"


def _error(schema: type[msgspec.Struct], prefix: str, **sources: Any) -> str:
    with pytest.raises(ConfigError) as err:
        resolve(schema, setting_prefix=prefix, **{"env": {}, **sources})
    return str(err.value)


@pytest.mark.parametrize(
    ("setting", "value", "shown"),
    [
        ("nats_password", 8675309123, "<redacted> (an int): Expected `str | null`, got `int`"),  # unquoted YAML
        ("nats_password", [SECRET], "<redacted> (a list): Expected `str | null`, got `array`"),
        ("nats_token", 8675309123, "<redacted> (an int): Expected `str | null`, got `int`"),
        ("etcd_password", [SECRET], "<redacted> (a list): Expected `str | null`, got `array`"),
        ("etcd_password", {"pw": SECRET}, "<redacted> (a dict): Expected `str | null`, got `object`"),
    ],
)
def test_a_secret_setting_shows_its_type_not_its_value(setting: str, value: object, shown: str) -> None:
    schema = NatsSettings if setting.startswith("nats_") else EtcdSettings
    prefix = setting.partition("_")[0] + "_"
    said = _error(schema, prefix, file={setting: value, prefix + "user": "alice"})
    assert f"invalid {setting} (--{setting.replace('_', '-')}, KVSWITCH_{setting.upper()}) = {shown}" in said
    assert SECRET not in said and "8675309123" not in said


def test_the_message_hides_the_secret_but_the_error_keeps_it() -> None:
    err = ConfigError("nats_password", SECRET, "too short")
    assert str(err) == "invalid nats_password (--nats-password, KVSWITCH_NATS_PASSWORD) = <redacted> (a str): too short"
    assert err.value == SECRET
    assert str(ConfigError("nats_token", None, "x")).endswith(" = None: x")  # nothing to hide


@pytest.mark.parametrize(
    ("sources", "shown"),
    [
        ({"env": {"KVSWITCH_NATS_SERVERS": f"nats://alice:{SECRET}@127.0.0.1:0"}}, "= 'nats://127.0.0.1:0': the port"),
        ({"file": {"nats_servers": [f"nats://alice:{SECRET}@127.0.0.1:0"]}}, "= 'nats://127.0.0.1:0': the port"),
        ({"file": {"nats_servers": f"nats://alice:{SECRET}@h:1"}}, "= 'nats://h:1': Expected `array`, got `str`"),
        ({"file": {"nats_servers": {"a": f"tls://{SECRET}@h:1"}}}, "= {'a': 'tls://h:1'}: Expected `array`"),
        # a password with an unescaped `/`: urllib takes its start for the port, and said so
        ({"cli": {"nats_servers": [f"nats://alice:{SECRET}/x@h:4222"]}}, "= 'nats://h:4222': the port must be"),
        # an item of the list: its setting, not the whole mapping (with nats_password in it) as the value
        (
            {"file": {"nats_servers": [f"nats://alice:{SECRET}@h:1", 5], "nats_user": "u", "nats_password": SECRET}},
            "invalid nats_servers (--nats-servers, KVSWITCH_NATS_SERVERS) = ['nats://h:1', 5]: Expected `str`",
        ),
    ],
)
def test_a_nats_url_is_shown_without_its_userinfo(sources: dict[str, Any], shown: str) -> None:
    said = _error(NatsSettings, "nats_", **sources)
    assert shown in said and SECRET not in said and "alice" not in said, said


@pytest.mark.parametrize(
    ("cli", "shown"),
    [
        ({"etcd_endpoints": [f"http://root:{SECRET}@127.0.0.1:0"]}, "= 'http://127.0.0.1:0': the port"),
        ({"etcd_endpoints": [f"https://root:{SECRET}@etcd:2379"]}, "= 'https://etcd:2379': a URL takes no user"),
    ],
)
def test_an_etcd_url_is_shown_without_its_userinfo(cli: dict[str, Any], shown: str) -> None:
    said = _error(EtcdSettings, "etcd_", cli=cli)
    assert shown in said and SECRET not in said and "root" not in said, said


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("nats://alice:pw@host:4222", "nats://host:4222"),
        ("tls://token@host:4222", "tls://host:4222"),
        ("nats://alice:p@ss/w@rd@host:4222", "nats://host:4222"),  # unescaped: all up to the last @
        ("nats://host:4222", "nats://host:4222"),
        ("user@host", "user@host"),  # not a URL
        ("demo:s3cret@127.0.0.1:4222", "127.0.0.1:4222"),  # a URL whose scheme was left out
    ],
)
def test_without_userinfo(url: str, shown: str) -> None:
    assert without_userinfo(url) == shown


@pytest.mark.parametrize(
    ("setting", "value", "shown"),
    [
        ("timing_profile", "h200:nope@10x", "= 'h200:nope@10x'"),  # was '10x'
        ("timing_profile", "lab@h200:m@v2", "= 'lab@h200:m@v2'"),  # was 'v2'
        ("model", "org/m:v1@sha", "= 'org/m:v1@sha'"),
        ("engine_url", "http://u:pw@h:8000", "= 'http://h:8000'"),  # a URL setting keeps losing it
        ("kv_events_config", {"endpoint": "tcp://u:pw@h:5557"}, "= {'endpoint': 'tcp://h:5557'}"),
    ],
)
def test_a_name_is_shown_whole_and_a_url_without_its_userinfo(setting: str, value: object, shown: str) -> None:
    """Review of 3a2a9c4: every value with an `@` and a `:` lost all up to its last `@`, so a refused
    `--timing-profile h200:nope@10x` was shown as '10x'."""
    said = str(ConfigError(setting, value, "no"))
    assert f"{shown}: no" in said and "pw" not in said, said


@pytest.mark.parametrize(
    ("settings", "flags"),
    [
        (NatsSettings(servers=[f"nats://alice:{SECRET}@h:1"]), ["the user and password in --nats-servers"]),
        (NatsSettings(servers=["nats://tok@h:1", "nats://tok@g:1"]), ["the token in --nats-servers"]),
        (
            NatsSettings(servers=["nats://h:1", "nats://a:b@g:1"], token="t"),
            ["--nats-token", "the user and password in --nats-servers"],
        ),
        (NatsSettings(servers=["nats://h:1"]), []),
    ],
)
def test_credentials_in_a_url_count_as_given(settings: NatsSettings, flags: list[str]) -> None:
    assert settings.credential_flags() == flags


def test_an_etcd_url_with_credentials_is_refused_naming_the_flags_not_the_password() -> None:
    """etcd's gRPC client cannot parse `user:password@` (its error then quoted the password); the
    credentials have flags of their own."""
    with pytest.raises(ConfigError) as err:
        EtcdSettings(endpoints=["http://alice:S3cret@127.0.0.1:2379"]).validate()
    said = str(err.value)
    assert "--etcd-user and --etcd-password" in said and "S3cret" not in said and "alice" not in said, said


def test_a_url_without_its_scheme_is_shown_without_its_password() -> None:
    """The scheme check's error showed `demo:s3cret@127.0.0.1:4222` as given."""
    nats, etcd = NatsSettings(servers=["demo:s3cret@127.0.0.1:4222"]), EtcdSettings(endpoints=["demo:s3cret@h:2379"])
    for settings in (nats, etcd):
        with pytest.raises(ConfigError) as err:
            settings.validate()
        assert "s3cret" not in str(err.value) and "must start with" in str(err.value), str(err.value)
