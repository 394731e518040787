"""The control plane's certificates (NATS and etcd), for `kvswitch secrets --tls-hosts`,
`kvswitch up --secure` and the docker-compose init job. On Kubernetes, cert-manager or your own
PKI may issue them instead, with the same separation.

One identity per purpose (kvswitch.servers.ControlPlaneTls), so that a key taken from one server
opens nothing else: `ca.pem` signs the certificates NATS (`nats.crt`) and etcd (`etcd.crt`) show
their clients, for server authentication only; NATS routes (`nats-route.crt`, CA
`nats-route-ca.pem`) and etcd peers (`etcd-peer.crt`, CA `etcd-peer-ca.pem`) each have their own
CA, and each member takes as a route or peer only its own identity's name. Until 2026-12-07 one
certificate served all four, and holding the etcd key let a rogue nats-server join the NATS
cluster as a route and read every subject, whatever the nkey permissions.

Every certificate names every host given (DNS names and IP addresses, each checked first:
`host_problem`); route and peer identities are good for server and client authentication, since
members present them to each other. Key files
are written readable by their owner only. The CAs' keys are not kept, so certificates naming other
hosts mean new CAs too, which every client must then trust: certificates already written are kept,
and ones that lack a host asked for are refused rather than replaced.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import re
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from kvswitch.servers import ControlPlaneTls, TlsFiles

__all__ = [
    "ETCD_PEER_NAME",
    "NATS_ROUTE_NAME",
    "KeptCertificateError",
    "certificate_hosts",
    "host_problem",
    "write_tls",
]


class KeptCertificateError(ValueError):
    """The certificates already in the directory are unreadable, lack a host asked for, or are the
    one shared certificate of a release before 2026-12-07."""


# The common names members pin each other to (nats-server's route authorization, etcd's
# --peer-cert-allowed-cn): kvswitch.servers reads them from the identity's certificate.
NATS_ROUTE_NAME = "kvswitch-nats-route"
ETCD_PEER_NAME = "kvswitch-etcd-peer"


def _name(common: str) -> x509.Name:
    return x509.Name(
        [x509.NameAttribute(NameOID.ORGANIZATION_NAME, "kvswitch"), x509.NameAttribute(NameOID.COMMON_NAME, common)]
    )


# One DNS label: letters, digits and hyphens, 1 to 63 of them, no hyphen at either end (RFC 1123).
_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


def host_problem(host: str) -> str | None:
    """Why `host` cannot be named in a certificate, None where it can: an IP address, or a DNS name
    of labels (`_LABEL`), 253 characters at most, with an optional leading `*.` wildcard. A client
    checks the name it dials against these as they are: a URL, a port or a path in one matches no
    server (`nats.kvswitch.svc:4222` was written as a DNS name, and every client refused the
    certificate), and a dotted number that is no address (10.0.0.256) is no name either."""
    if "://" in host:
        return "a URL: give its host alone"
    if any(c.isspace() for c in host):
        return "has whitespace in it"
    if "/" in host:
        return "has a path in it: give the host alone"
    with contextlib.suppress(ValueError):
        ipaddress.ip_address(host)
        # a certificate names the address alone: the zone would be dropped, and a rerun refused
        return "has an IPv6 zone (%...) in it: give the address alone" if "%" in host else None
    if ":" in host or host.startswith("["):
        return "has a port in it (or an IPv6 address in brackets): give the host or the address alone"
    labels = host.removeprefix("*.").split(".")
    if labels[-1].isdigit():
        return "is no IP address, and a DNS name's last label is never all digits"
    if len(host) > 253 or not all(_LABEL.fullmatch(label) for label in labels):
        return (
            "is neither an IP address nor a DNS name (labels of letters, digits and hyphens, 1-63 each, no hyphen at "
            "either end, 253 characters in all; a leading *. for a wildcard)"
        )
    return None


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


def _reissue(out: Path) -> str:
    return (
        f"delete {out} to issue new CAs and certificates (every client must then trust the new ca.pem, and the "
        "TLS Secrets be made again)"
    )


def _check_kept(out: Path, leaves: list[TlsFiles], hosts: list[str]) -> None:
    for files in leaves:
        try:
            named = certificate_hosts(files.cert)
        except ValueError as exc:
            raise KeptCertificateError(f"{files.cert} is not a PEM certificate ({exc}): {_reissue(out)}") from exc
        have = {_canonical(h) for h in named}
        missing = [h for h in hosts if _canonical(h) not in have]
        if missing:
            raise KeptCertificateError(
                f"the certificate kept in {files.cert} names {', '.join(named) or 'no host'}, not "
                f"{', '.join(missing)}: {_reissue(out)}"
            )


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    path.touch(mode=0o600)
    path.chmod(0o600)
    path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )


def _files(out: Path) -> ControlPlaneTls:
    ca = out / "ca.pem"
    return ControlPlaneTls(
        ca=ca,
        nats=TlsFiles(ca, out / "nats.crt", out / "nats.key"),
        nats_route=TlsFiles(out / "nats-route-ca.pem", out / "nats-route.crt", out / "nats-route.key"),
        etcd=TlsFiles(ca, out / "etcd.crt", out / "etcd.key"),
        etcd_peer=TlsFiles(out / "etcd-peer-ca.pem", out / "etcd-peer.crt", out / "etcd-peer.key"),
    )


class _Issuer:
    """A CA made for one run; its key lives only as long as the run."""

    def __init__(self, common: str, days: int) -> None:
        self.now = datetime.datetime.now(datetime.UTC)
        self.days = days
        self.name = _name(common)
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.cert = (
            self._builder(self.name, self.key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
            .sign(self.key, hashes.SHA256())
        )

    def _builder(self, subject: x509.Name, public: ec.EllipticCurvePublicKey) -> x509.CertificateBuilder:
        return (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(self.name)
            .public_key(public)
            .serial_number(x509.random_serial_number())
            .not_valid_before(self.now - datetime.timedelta(minutes=5))
            .not_valid_after(self.now + datetime.timedelta(days=self.days))
        )

    def write_ca(self, path: Path) -> None:
        path.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, files: TlsFiles, common: str, hosts: list[str], *, peer: bool) -> None:
        """A leaf for server authentication, and client authentication too for a cluster `peer`."""
        key = ec.generate_private_key(ec.SECP256R1())
        usages = [ExtendedKeyUsageOID.SERVER_AUTH] + ([ExtendedKeyUsageOID.CLIENT_AUTH] if peer else [])
        cert = (
            self._builder(_name(common), key.public_key())
            .add_extension(x509.SubjectAlternativeName([_san(h) for h in hosts]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .sign(self.key, hashes.SHA256())
        )
        files.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(files.key, key)


def write_tls(out: Path, hosts: list[str], *, days: int = 365) -> ControlPlaneTls:
    """The control plane's CAs, certificates and keys in `out`; existing files are kept, so a rerun
    changes nothing (KeptCertificateError when a kept certificate does not name every host in
    `hosts`, or `out` holds the one shared certificate of a release before 2026-12-07)."""
    if not hosts:
        raise ValueError("a certificate needs at least one host name or address")
    for host in hosts:  # before a kept certificate is read: its names would be refused alike
        if (problem := host_problem(host)) is not None:
            raise ValueError(f"{host!r} {problem}")
    tls = _files(out)
    leaves = [tls.nats, tls.nats_route, tls.etcd, tls.etcd_peer]
    if all(p.is_file() for files in leaves for p in (files.ca, files.cert, files.key)):
        _check_kept(out, leaves, hosts)
        return tls
    if (out / "tls.crt").exists() or (out / "tls.key").exists():
        raise KeptCertificateError(
            f"{out} holds tls.crt and tls.key, the one certificate for NATS and etcd of a release before "
            "2026-12-07, whose key lets whoever holds either server's Secret join the NATS cluster: "
            f"{_reissue(out)}"
        )
    out.mkdir(parents=True, exist_ok=True)
    clients, routes, peers = (_Issuer(f"kvswitch {what} CA", days) for what in ("client", "NATS route", "etcd peer"))
    clients.write_ca(tls.ca)
    routes.write_ca(tls.nats_route.ca)
    peers.write_ca(tls.etcd_peer.ca)
    clients.issue(tls.nats, "kvswitch-nats", hosts, peer=False)
    clients.issue(tls.etcd, "kvswitch-etcd", hosts, peer=False)
    routes.issue(tls.nats_route, NATS_ROUTE_NAME, hosts, peer=True)
    peers.issue(tls.etcd_peer, ETCD_PEER_NAME, hosts, peer=True)
    return tls
