"""Credential and CA files are parsed at start, not only opened: one with the wrong content is a
ConfigError naming its flag (exit 2). It was accepted, and the process died at its first connect
with a traceback (exit 1), looped in nats-py, or retried forever blaming --nats-servers or
--etcd-endpoints."""

from __future__ import annotations

import os
from pathlib import Path

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


def test_the_right_seed_and_creds_files_pass(tmp_path: Path) -> None:
    (tmp_path / "w.nk").write_text(SEED + "\n")
    (tmp_path / "u.creds").write_text(_creds(SEED))
    s = resolve(
        NatsSettings,
        cli={"nats_nkey_file": str(tmp_path / "w.nk"), "nats_creds_file": str(tmp_path / "u.creds")},
        env={},
        setting_prefix="nats_",
    )
    assert s.nkey_file == str(tmp_path / "w.nk")


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
