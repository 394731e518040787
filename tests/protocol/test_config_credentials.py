"""Credential and CA files are parsed at start, not only opened: one with the wrong content is a
ConfigError naming its flag (exit 2). It was accepted, and the process died at its first connect
with a traceback (exit 1), looped in nats-py, or retried forever blaming --nats-servers or
--etcd-endpoints."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import msgspec
import nkeys
import pytest

from kvswitch.certs import write_tls
from kvswitch.servers import TlsFiles
from protocol import ConfigError
from protocol.config import EtcdSettings, NatsSettings, resolve

GARBAGE = b"not a pem\n"
SEED = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER).decode()


def _creds(seed: str) -> str:
    return (
        "-----BEGIN NATS USER JWT-----\neyJ0eXAiOiJqd3QifQ.e30.sig\n------END NATS USER JWT------\n\n"
        f"-----BEGIN USER NKEY SEED-----\n{seed}\n------END USER NKEY SEED------\n"
    )


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> tuple[TlsFiles, TlsFiles]:
    """Two CAs, each with its own certificate and key."""
    a, b = (write_tls(tmp_path_factory.mktemp(name), ["nats"]).nats for name in "ab")
    return a, b


def _resolve(cli: dict[str, object]) -> NatsSettings | EtcdSettings:
    if any(k.startswith("etcd_") for k in cli):
        return resolve(EtcdSettings, cli={"etcd_endpoints": ["https://e:2379"], **cli}, env={}, setting_prefix="etcd_")
    return resolve(NatsSettings, cli=cli, env={}, setting_prefix="nats_")


@pytest.mark.parametrize(
    ("setting", "content", "said"),
    [
        ("nats_tls_ca", GARBAGE, "holds no PEM CA certificate"),
        ("etcd_tls_ca", GARBAGE, "holds no PEM CA certificate"),
        ("nats_nkey_file", b"SUgarbage\n", "holds no nkey seed"),
        ("nats_nkey_file", SEED.replace("SU", "UA", 1).encode(), "holds no nkey seed"),  # a public key's shape
        ("nats_creds_file", GARBAGE, "no BEGIN NATS USER JWT block"),
        ("nats_creds_file", _creds(SEED).split("\n\n")[0].encode(), "no BEGIN USER NKEY SEED block"),
        ("nats_creds_file", _creds("SUgarbage").encode(), "holds no nkey seed"),
    ],
    ids=["ca-nats", "ca-etcd", "seed-garbage", "seed-public-key", "creds-garbage", "creds-no-seed", "creds-bad-seed"],
)
def test_a_file_with_the_wrong_content_is_refused_naming_its_flag(
    tmp_path: Path, setting: str, content: bytes, said: str
) -> None:
    path = tmp_path / "file"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as err:
        _resolve({setting: str(path)})
    assert err.value.setting == setting
    assert str(err.value).startswith(f"invalid {setting} (--{setting.replace('_', '-')}, "), err.value
    assert said in str(err.value)


@pytest.mark.parametrize("prefix", ["nats_", "etcd_"])
def test_a_key_of_another_certificate_or_a_certificate_that_is_none_is_refused(
    tmp_path: Path, tls: tuple[TlsFiles, TlsFiles], prefix: str
) -> None:
    a, b = tls
    given = {f"{prefix}tls_ca": str(a.ca), f"{prefix}tls_cert": str(a.cert)}
    with pytest.raises(ConfigError, match=f"is not the PEM private key of the certificate in --{prefix[:-1]}-tls-cert"):
        _resolve({**given, f"{prefix}tls_key": str(b.key)})
    (tmp_path / "cert").write_bytes(GARBAGE)
    with pytest.raises(ConfigError, match=f"invalid {prefix}tls_cert .*: holds no PEM certificate"):
        _resolve({**given, f"{prefix}tls_cert": str(tmp_path / "cert"), f"{prefix}tls_key": str(a.key)})
    # The right files pass, and the NATS context is the one connect() is given.
    settings = _resolve({**given, f"{prefix}tls_key": str(a.key)})
    if isinstance(settings, NatsSettings):
        assert settings.connect_options("x")["tls"].verify_mode.name == "CERT_REQUIRED"


@pytest.mark.parametrize(
    ("setting", "content"), [("nats_nkey_file", SEED + "\n"), ("nats_creds_file", _creds(SEED))], ids=["seed", "creds"]
)
def test_the_right_seed_and_creds_files_pass(tmp_path: Path, setting: str, content: str) -> None:
    (tmp_path / "file").write_text(content)
    s = resolve(NatsSettings, cli={setting: str(tmp_path / "file")}, env={}, setting_prefix="nats_")
    assert getattr(s, setting.removeprefix("nats_")) == str(tmp_path / "file")


TOKEN = {"nats_token": "s3cret"}
USER = {"nats_user": "ops", "nats_password": "pw"}


@pytest.mark.parametrize(
    ("given", "setting", "other"),
    [
        # nats-py sends the user and password, never the token: the brief's repro retried for ever
        ({**TOKEN, **USER}, "nats_user", "nats_token (--nats-token, KVSWITCH_NATS_TOKEN)"),
        ({"nats_creds_file": "{creds}", "nats_nkey_file": "{seed}"}, "nats_creds_file", "nats_nkey_file (--nats-nkey"),
        ({"nats_nkey_file": "{seed}", **USER}, "nats_nkey_file", "nats_user/nats_password (--nats-user, KVSWITC"),
        ({"nats_creds_file": "{creds}", **USER, **TOKEN}, "nats_creds_file", "nats_user/nats_password (--nats-user"),
        ({"nats_servers": ["nats://ops:pw@h:4222"], **USER}, "nats_user", "a user:password@ or token@ in nats_se"),
        ({"nats_servers": ["nats://h:4222", "nats://tok@g:4222"], **TOKEN}, "nats_servers", "nats_token (--nats-t"),
        ({"nats_servers": ["nats://ops:pw@h:4222"], "nats_nkey_file": "{seed}"}, "nats_nkey_file", "in nats_servers"),
    ],
    ids=["token-user", "creds-seed", "seed-user", "creds-user-token", "url-user", "url-token", "url-seed"],
)
@pytest.mark.parametrize("layer", ["cli", "env", "file"])
def test_two_nats_credentials_are_refused_naming_both(
    tmp_path: Path, given: dict[str, str | list[str]], setting: str, other: str, layer: str
) -> None:
    """nats-py sends one of them alone (a creds file before a seed, either before a user and password,
    those before a token, a token before a URL's) and drops the other without a word, so a server
    that wanted the other answered 'Authorization Violation' for ever (review, 2026-12-07)."""
    (tmp_path / "w.nk").write_text(SEED + "\n")
    (tmp_path / "u.creds").write_text(_creds(SEED))
    files = {"{seed}": str(tmp_path / "w.nk"), "{creds}": str(tmp_path / "u.creds")}
    values = {k: files.get(v, v) if isinstance(v, str) else v for k, v in given.items()}
    env = {f"KVSWITCH_{k.upper()}": v if isinstance(v, str) else ",".join(v) for k, v in values.items()}
    with pytest.raises(ConfigError) as err:
        resolve(
            NatsSettings,
            cli=values if layer == "cli" else {},
            env=env if layer == "env" else {},
            file=values if layer == "file" else {},
            setting_prefix="nats_",
        )
    said = str(err.value)
    assert err.value.setting == setting
    assert said.startswith(f"invalid {setting} (--{setting.replace('_', '-')}, KVSWITCH_{setting.upper()})"), said
    assert "give one NATS credential, not both" in said and other in said, said
    assert "s3cret" not in said and "pw" not in said, said
    # where each came from: one layer, so neither shadows the other
    where = {"cli": f"--{setting.replace('_', '-')}", "env": f"KVSWITCH_{setting.upper()}"}
    assert f"(one from {where.get(layer, f'{setting} in the config file')}" in said, said


_LAYERS = ("cli", "env", "file")


@pytest.mark.parametrize(
    ("above", "below", "shadowed"),
    [
        (TOKEN, USER, "nats_user/nats_password"),
        (USER, TOKEN, "nats_token"),
        ({"nats_nkey_file": "{seed}"}, USER, "nats_user/nats_password"),
        ({"nats_creds_file": "{creds}"}, {"nats_nkey_file": "{seed}"}, "nats_nkey_file"),
        (TOKEN, {"nats_servers": ["nats://ops:pw@h:4222"]}, "a user:password@ or token@ in nats_servers"),
        ({"nats_servers": ["nats://tok@h:4222"]}, TOKEN, "nats_token"),
    ],
    ids=["token-over-user", "user-over-token", "seed-over-user", "creds-over-seed", "token-over-url", "url-over-token"],
)
@pytest.mark.parametrize(("high", "low"), [("cli", "env"), ("cli", "file"), ("env", "file")])
def test_a_credential_shadows_one_of_another_kind_from_a_lower_layer_saying_so(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    above: dict[str, str | list[str]],
    below: dict[str, str | list[str]],
    shadowed: str,
    high: str,
    low: str,
) -> None:
    """A token in the config file refused `--nats-user ops --nats-password pw` naming --nats-token,
    which the operator never set (review of 15fec0f, finding 2): flag > environment > config file
    holds for a credential of another kind as for any setting. The one below is not sent, and that
    is said at INFO, naming both and where each came from."""
    (tmp_path / "w.nk").write_text(SEED + "\n")
    (tmp_path / "u.creds").write_text(_creds(SEED))
    files = {"{seed}": str(tmp_path / "w.nk"), "{creds}": str(tmp_path / "u.creds")}
    layers: dict[str, dict[str, str | list[str]]] = {layer: {} for layer in _LAYERS}
    for layer, given in ((high, above), (low, below)):
        layers[layer] = {k: files.get(v, v) if isinstance(v, str) else v for k, v in given.items()}
    env = {f"KVSWITCH_{k.upper()}": v if isinstance(v, str) else ",".join(v) for k, v in layers["env"].items()}
    with caplog.at_level(logging.INFO, logger="kvswitch.config"):
        settings = resolve(
            NatsSettings, cli=layers["cli"], env=env, file=layers["file"], setting_prefix="nats_", file_name="f.yaml"
        )
    kept = {k: files.get(v, v) if isinstance(v, str) else v for k, v in above.items()}
    for key, value in kept.items():
        assert getattr(settings, key.removeprefix("nats_")) == value
    opts = settings.connect_options("x")
    sent: set[str] = {k for k in ("user", "token", "user_credentials", "nkeys_seed") if k in opts}
    sent |= {"url"} if any("@" in url for url in opts["servers"]) else set()
    assert len(sent) == 1, opts  # one credential, the one above
    said = [r.getMessage() for r in caplog.records if r.name == "kvswitch.config"]
    assert len(said) == 1 and said[0].startswith(f"NATS credential {shadowed} ("), said
    where = {"cli": "--nats-", "env": "KVSWITCH_NATS_", "file": " in f.yaml"}
    aside, shadow = said[0].split(" set aside: ")
    assert where[low] in aside and where[high] in shadow, said
    assert "s3cret" not in said[0] and "pw" not in said[0], said


def test_a_credential_shadowed_by_one_itself_shadowed_stays_aside(tmp_path: Path) -> None:
    """Layer by layer, as any setting: the environment's user and password set aside the config
    file's token, and the flag's nkey seed the environment's user and password; the file's token
    does not come back beside the seed, which it could go with."""
    env = {"KVSWITCH_NATS_USER": "ops", "KVSWITCH_NATS_PASSWORD": "pw"}
    settings = resolve(NatsSettings, env=env, file=TOKEN, setting_prefix="nats_")
    assert (settings.user, settings.token) == ("ops", None)
    (tmp_path / "w.nk").write_text(SEED + "\n")
    seed = {"nats_nkey_file": str(tmp_path / "w.nk")}
    settings = resolve(NatsSettings, cli=seed, env=env, file=TOKEN, setting_prefix="nats_")
    assert (settings.nkey_file, settings.user, settings.password, settings.token) == (
        seed["nats_nkey_file"],
        None,
        None,
        None,
    )


@pytest.mark.parametrize("setting", ["nats_token", "nats_user", "nats_password"])
def test_an_empty_credential_is_refused(setting: str) -> None:
    """nats-py sends no empty token, user or password: NatsSettings(token='') connected with none, and
    `--nats-token ''` was still a token beside the config file's user and password, refused naming it."""
    given = {**USER, setting: ""} if setting != "nats_token" else {setting: ""}
    with pytest.raises(ConfigError, match=rf"invalid {setting} \(.*\) = .*: must not be empty"):
        msgspec.convert({k.removeprefix("nats_"): v for k, v in given.items()}, NatsSettings).validate()
    for layers in ({"cli": given, "file": TOKEN if setting != "nats_token" else USER}, {"env": given}):
        env = {f"KVSWITCH_{k.upper()}": v for k, v in layers.get("env", {}).items()}
        with pytest.raises(ConfigError, match=rf"invalid {setting} \(.*\) = .*: must not be empty"):
            resolve(NatsSettings, cli=layers.get("cli"), env=env, file=layers.get("file"), setting_prefix="nats_")


@pytest.mark.parametrize("setting", ["nats_nkey_file", "nats_creds_file"])
def test_a_token_beside_a_seed_or_a_creds_file_passes_and_both_are_sent(tmp_path: Path, setting: str) -> None:
    """nats-py sends the token with the signature, for an auth callout (and the token alone to a
    server that asks for no signature): neither is dropped, so the pair is not refused."""
    (tmp_path / "file").write_text(SEED + "\n" if setting == "nats_nkey_file" else _creds(SEED))
    given = {setting: str(tmp_path / "file"), **TOKEN}
    opts = resolve(NatsSettings, cli=given, env={}, setting_prefix="nats_").connect_options("x")
    assert opts["token"] == "s3cret"
    assert opts["nkeys_seed" if setting == "nats_nkey_file" else "user_credentials"] == str(tmp_path / "file")


def _rsa_pair(tmp_path: Path, bits: int, passphrase: bytes | None = None) -> tuple[Path, Path]:
    """A self-signed RSA certificate and its key (encrypted with `passphrase` when given)."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from cryptography.x509.oid import NameOID

    key = rsa.generate_private_key(public_exponent=65537, key_size=bits)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "etcd-client")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(1)
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=1))
        .sign(key, hashes.SHA256())
    )
    crypt = serialization.BestAvailableEncryption(passphrase) if passphrase else serialization.NoEncryption()
    (tmp_path / "c.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "c.key").write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, crypt)
    )
    return tmp_path / "c.crt", tmp_path / "c.key"


def test_an_etcd_client_key_grpc_takes_is_not_refused_by_openssls_security_level(
    tmp_path: Path, tls: tuple[TlsFiles, TlsFiles]
) -> None:
    """gRPC connects to etcd with an RSA-1024 client key; OpenSSL's default security level refuses
    it, and the check said the key was not the certificate's (review of the credential checks)."""
    cert, key = _rsa_pair(tmp_path, 1024)
    given: dict[str, object] = {"etcd_tls_ca": str(tls[0].ca), "etcd_tls_cert": str(cert), "etcd_tls_key": str(key)}
    assert _resolve(given).tls_key == str(key)


@pytest.mark.parametrize("prefix", ["nats_", "etcd_"])
def test_an_encrypted_key_is_refused_at_once_saying_so(
    tmp_path: Path, tls: tuple[TlsFiles, TlsFiles], prefix: str
) -> None:
    """OpenSSL asked for the passphrase on the terminal and waited; without one it said "Invalid argument"."""
    cert, key = _rsa_pair(tmp_path, 2048, passphrase=b"secret")
    given: dict[str, object] = {
        f"{prefix}tls_ca": str(tls[0].ca),
        f"{prefix}tls_cert": str(cert),
        f"{prefix}tls_key": str(key),
    }
    with pytest.raises(ConfigError, match=f"invalid {prefix}tls_key .*: is encrypted"):
        _resolve(given)
