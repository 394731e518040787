"""A private CA and one certificate for the control plane (NATS and etcd), for `kvswitch up --secure`
and the docker-compose init job. On Kubernetes, cert-manager or your own PKI issues them instead.

The certificate names every host given (DNS names and IP addresses) and is good for both server and
client authentication, since cluster members present it to each other. The key files are written
readable by their owner only. The CA's key is not kept, so a certificate naming other hosts means a
new CA too, which every client must then trust: a certificate already written is kept, and one that
lacks a host asked for is refused rather than replaced.
"""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from kvswitch.servers import TlsFiles

__all__ = ["KeptCertificateError", "certificate_hosts", "write_tls"]


class KeptCertificateError(ValueError):
    """The certificate already in the directory is unreadable or lacks a host asked for."""


_CN_MAX = 64


def _name(common: str) -> x509.Name:
    return x509.Name(
        [x509.NameAttribute(NameOID.ORGANIZATION_NAME, "kvswitch"), x509.NameAttribute(NameOID.COMMON_NAME, common)]
    )


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _canonical(host: str) -> str:
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return host.lower()  # DNS names match whatever their case


def certificate_hosts(cert: Path) -> list[str]:
    """The DNS names and IP addresses a PEM certificate names; ValueError when it is not one."""
    loaded = x509.load_pem_x509_certificate(cert.read_bytes())
    try:
        names = loaded.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return [str(n.value) for n in names if isinstance(n, x509.DNSName | x509.IPAddress)]


def _check_kept(files: TlsFiles, hosts: list[str]) -> None:
    reissue = f"delete {files.cert.parent} to issue a new CA and certificate (every client must then trust the new CA)"
    try:
        named = certificate_hosts(files.cert)
    except ValueError as exc:
        raise KeptCertificateError(f"{files.cert} is not a PEM certificate ({exc}): {reissue}") from exc
    have = {_canonical(h) for h in named}
    missing = [h for h in hosts if _canonical(h) not in have]
    if missing:
        raise KeptCertificateError(
            f"the certificate kept in {files.cert} names {', '.join(named) or 'no host'}, not {', '.join(missing)}: "
            f"{reissue}"
        )


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    path.touch(mode=0o600)
    path.chmod(0o600)
    path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )


def write_tls(out: Path, hosts: list[str], *, days: int = 365) -> TlsFiles:
    """ca.pem, tls.crt and tls.key in `out`; existing files are kept, so a rerun changes nothing
    (KeptCertificateError when the kept certificate does not name every host in `hosts`)."""
    if not hosts:
        raise ValueError("a certificate needs at least one host name or address")
    files = TlsFiles(out / "ca.pem", out / "tls.crt", out / "tls.key")
    if all(p.is_file() for p in (files.ca, files.cert, files.key)):
        _check_kept(files, hosts)
        return files
    out.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(_name("kvswitch CA"))
        .issuer_name(_name("kvswitch CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    usages = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    cert = (
        x509.CertificateBuilder()
        # X.509 caps a common name at 64 characters, a DNS name at 253: clients check the SAN list
        .subject_name(_name(hosts[0] if len(hosts[0]) <= _CN_MAX else "kvswitch server"))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName([_san(h) for h in hosts]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    files.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    files.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(files.key, key)
    return files
