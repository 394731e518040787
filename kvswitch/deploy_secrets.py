"""`kvswitch secrets`: the credentials a deployment needs, written to one directory.

- NATS: one nkey per router and per worker, and the nats-server `authorization` block with their
  permissions (kvswitch.nats_auth): `nats-auth.conf` to include in nats-server's config,
  `nats-auth-values.yaml` for the NATS Helm chart, `router-NAME.nk` / `worker-NAME.nk` seeds.
- TLS (`--tls-hosts`): the control plane's CAs and certificates (kvswitch.certs): one for NATS's
  clients, one for etcd's, one for NATS routes and one for etcd peers, routes and peers each under
  their own CA, so that neither server's key opens the other's cluster.
- etcd (`--etcd-endpoint`): creates the `router` and `worker` users and turns authentication on,
  with the passwords from KVSWITCH_ETCD_{ROOT,ROUTER,WORKER}_PASSWORD; where it is on already, it
  signs in as root and sets the users' grants under that --namespace as this release makes them
  (an upgrade's step; rerun it with the same --namespace), saying each grant it revoked. Another
  namespace sharing the etcd keeps its grants (the users and passwords are etcd-wide): a password
  that does not work for an existing user is refused (exit 2, nothing changed) unless
  --rotate-etcd-passwords is given.
- Router API keys (`--api-keys N`): `api-keys`, N random bearer keys for `kvswitch router
  --api-keys-file` (mode 0600; add or remove lines to rotate, the routers reload it).

Rerunning it keeps every key, certificate and seed already there and adds what is new (a worker
name added to `--workers` gets a seed; the others keep theirs). Kept certificates that lack a host
of `--tls-hosts` are refused (exit 2, before anything is written), not replaced: new ones need new
CAs, which every client must then trust; so is the one shared certificate (`tls/tls.crt`) of a
release before 2026-12-07. It is the docker-compose init job and the first step of
docs/deployment.md.
"""

from __future__ import annotations

import argparse
import os
import secrets
import ssl
import sys
from pathlib import Path
from urllib.parse import urlsplit

from kvswitch.etcd_auth import EtcdAuthError, PasswordsRefused, enable_auth, namespace_users
from kvswitch.nats_auth import MAX_RESPONSE_TTL_S, RESPONSE_TTL_S, NatsAuthPlan
from protocol import subjects
from protocol.errors import without_userinfo

__all__ = ["add_arguments", "run"]

PASSWORD_ENV = {role: f"KVSWITCH_ETCD_{role.upper()}_PASSWORD" for role in ("root", "router", "worker")}


def _names(text: str) -> list[str]:
    return [n.strip() for n in text.split(",") if n.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default=None, help="directory to write into (created; files kept on rerun)")
    parser.add_argument("--namespace", default=subjects.DEFAULT_NAMESPACE, help="the cluster's namespace")
    parser.add_argument("--routers", type=_names, default=[], metavar="A,B", help="router names (NATS identities)")
    parser.add_argument("--workers", type=_names, default=[], metavar="A,B",
                        help="worker names, as each shim's --worker-name")  # fmt: skip
    parser.add_argument("--response-ttl", type=int, default=None, metavar="S",
                        help=f"seconds a worker may reply to one request, with --workers (above the router's "
                             f"deadline; at most {MAX_RESPONSE_TTL_S}, a day; default {RESPONSE_TTL_S})")  # fmt: skip
    parser.add_argument("--tls-hosts", type=_names, default=[], metavar="A,B",
                        help="write CAs and certificates naming these hosts (DNS names or IPs) for NATS, "
                             "NATS routes, etcd and etcd peers")  # fmt: skip
    parser.add_argument("--etcd-endpoint", default=None, metavar="URL",
                        help="turn etcd authentication on there; passwords from KVSWITCH_ETCD_*_PASSWORD")  # fmt: skip
    parser.add_argument("--etcd-ca", default=None, metavar="FILE",
                        help="CA that signed etcd's certificate, with --etcd-endpoint")  # fmt: skip
    parser.add_argument("--rotate-etcd-passwords", action="store_true",
                        help="with etcd authentication on, change the router and worker passwords that differ from "
                             "KVSWITCH_ETCD_*_PASSWORD (shared by every namespace on that etcd: all their "
                             "processes need the new ones)")  # fmt: skip
    parser.add_argument("--api-keys", type=int, default=0, metavar="N",
                        help="write N router API keys to OUT/api-keys (kept on rerun)")  # fmt: skip


# Flags read only beside another (bench.cli._refuse_unread's pattern): given without it, each did
# nothing, without a word (--etcd-ca with no --etcd-endpoint wrote the NATS files and exited 0).
_READ_WITH = (("etcd_ca", "etcd_endpoint"), ("rotate_etcd_passwords", "etcd_endpoint"), ("response_ttl", "workers"))


def _check_flags(args: argparse.Namespace) -> None:
    """ValueError naming the flag for one given where nothing reads it, or a --response-ttl that
    nats-server would keep too long or refuse."""
    for given, needed in _READ_WITH:
        if getattr(args, given) not in (None, False) and not getattr(args, needed):
            flag, other = (f"--{name.replace('_', '-')}" for name in (given, needed))
            raise ValueError(f"{flag} is read with {other} only: give {other}, or drop {flag}")
    ttl = args.response_ttl
    if ttl is not None and not 0 < ttl <= MAX_RESPONSE_TTL_S:
        raise ValueError(
            f"--response-ttl must be in 1..{MAX_RESPONSE_TTL_S} seconds (a day; nats-server keeps a worker's leave to "
            f"reply to each request that long; give one above every router's --request-timeout, which is below a "
            f"day), got {ttl}"
        )


def write_api_keys(out: Path, count: int) -> Path:
    """`out/api-keys` with at least `count` keys; the keys and comments already there are kept."""
    path = out / "api-keys"
    text = path.read_text(encoding="utf-8-sig") if path.exists() else ""  # as router/api_keys.py reads it
    lines = [line for line in text.splitlines() if line.strip()]
    held = sum(not line.strip().startswith("#") for line in lines)  # a comment is no key to the router
    lines += [f"sk-kvswitch-{secrets.token_urlsafe(32)}" for _ in range(max(0, count - held))]
    out.mkdir(parents=True, exist_ok=True)
    path.touch(mode=0o600)  # private before a key is in it (and a file loosened since, too)
    path.chmod(0o600)
    path.write_text("".join(line + "\n" for line in lines))
    return path


def _etcd_context(ca: str) -> ssl.SSLContext:
    """A TLS context trusting the CA file `ca` (--etcd-ca); ValueError naming the flag when it
    cannot be read as one."""
    if not Path(ca).is_file():  # checked first: loading a FIFO would block
        raise ValueError(f"--etcd-ca {ca}: must name a readable file")
    try:
        return ssl.create_default_context(cafile=ca)
    except OSError as exc:  # ssl.SSLError too: not a PEM CA
        raise ValueError(f"--etcd-ca {ca}: cannot load it as a CA ({exc.strerror or exc})") from exc


def _check_etcd_endpoint(url: str, ca: str | None) -> None:
    """ValueError naming the flag for an endpoint the run would send passwords to unsafely or echo:
    with --etcd-ca it must be https:// (urllib ignores a TLS context for http://, so the three
    passwords went in the clear under a run that said nothing), and credentials in it would be
    printed with any error."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--etcd-endpoint {without_userinfo(url)!r}: must be an http:// or https:// URL")
    if parts.username is not None or parts.password is not None:
        raise ValueError(
            "--etcd-endpoint: credentials in the URL are refused (they would be shown in errors): the root "
            f"password comes from {PASSWORD_ENV['root']}"
        )
    if ca is not None and parts.scheme != "https":
        raise ValueError(
            f"--etcd-endpoint {url}: with --etcd-ca it must be https:// (http:// sends the passwords in the clear)"
        )


def _enable_etcd_auth(args: argparse.Namespace, context: ssl.SSLContext | None) -> str:
    missing = [env for env in PASSWORD_ENV.values() if not os.environ.get(env)]
    if missing:
        raise SystemExit(f"kvswitch secrets: --etcd-endpoint needs {', '.join(missing)} set")
    pw = {role: os.environ[env] for role, env in PASSWORD_ENV.items()}
    users = namespace_users(args.namespace, pw["router"], pw["worker"])
    setup = enable_auth(
        args.etcd_endpoint, pw["root"], users, context=context, rotate_passwords=args.rotate_etcd_passwords
    )
    if setup.turned_on:
        said = f"etcd authentication on at {args.etcd_endpoint}: users router, worker (namespace {args.namespace})"
    else:
        said = (
            f"etcd authentication was already on at {args.etcd_endpoint}: users router, worker and their grants "
            f"under /{args.namespace}/ set as this release makes them (namespace {args.namespace}; another "
            f"namespace's grants are kept)"
        )
    changed = [
        f"changed etcd user {user}'s password to {PASSWORD_ENV[user]}'s: every process signing in as {user}, in "
        "every namespace on this etcd, needs the new one"
        for user in setup.changed
    ]
    return "\n".join(
        [said, *(f"revoked a grant this release does not make: {grant}" for grant in setup.revoked), *changed]
    )


def _refused(exc: PasswordsRefused) -> str:
    """Why a rerun with other passwords stops, and the two ways on."""
    given = ", ".join(f"{user} (from {PASSWORD_ENV[user]})" for user in exc.users)
    return (
        f"etcd authentication is on at {exc.shown} and refuses the password given for {given}; nothing was "
        "changed: the router and worker users and their passwords are shared by "
        "every namespace on this etcd, and a new password ends the tokens of every process signing in as that "
        "user, in each of them. Give the passwords they have, or --rotate-etcd-passwords to change them (then "
        "give every such process the new ones)"
    )


def run(args: argparse.Namespace) -> int:
    if args.api_keys < 0:
        print(f"kvswitch secrets: --api-keys must be >= 0, got {args.api_keys}", file=sys.stderr)
        return 2
    writes = bool(args.routers or args.workers or args.tls_hosts or args.api_keys)
    if writes and args.out is None:
        print("kvswitch secrets: --routers, --workers, --tls-hosts and --api-keys need --out DIR", file=sys.stderr)
        return 2
    if not writes and not args.etcd_endpoint:
        print(
            "kvswitch secrets: nothing to do: give --workers, --tls-hosts, --api-keys or --etcd-endpoint",
            file=sys.stderr,
        )
        return 2
    try:  # before anything is written: a bad flag leaves no half-done run
        _check_flags(args)
        etcd_context = _etcd_context(args.etcd_ca) if args.etcd_endpoint and args.etcd_ca else None
        if args.etcd_endpoint:
            _check_etcd_endpoint(args.etcd_endpoint, args.etcd_ca)
    except ValueError as exc:
        print(f"kvswitch secrets: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out is not None else Path()
    plan = None
    if args.routers or args.workers:
        try:
            plan = NatsAuthPlan.generate(
                args.namespace,
                args.routers,
                args.workers,
                response_ttl_s=args.response_ttl or RESPONSE_TTL_S,
                seeds_dir=out,
            )
        except ValueError as exc:
            print(f"kvswitch secrets: {exc}", file=sys.stderr)
            return 2
    tls = None
    if args.tls_hosts:  # before the NATS files: a kept certificate it refuses leaves no half-done run
        from kvswitch.certs import certificate_hosts, write_tls

        try:
            tls = write_tls(out / "tls", args.tls_hosts)
        except ValueError as exc:  # a host no certificate can name, or a KeptCertificateError
            print(f"kvswitch secrets: --tls-hosts: {exc}", file=sys.stderr)
            return 2
    if plan is not None:
        written = plan.write(out)
        print(f"NATS: {len(args.routers)} routers, {len(args.workers)} workers -> {written[0]}, {written[1]}")
    if tls is not None:  # the names the certificates hold: kept ones may name more than asked for
        print(
            f"TLS: client CA {tls.ca}; NATS {tls.nats.cert}, etcd {tls.etcd.cert}; NATS routes "
            f"{tls.nats_route.cert} (CA {tls.nats_route.ca}), etcd peers {tls.etcd_peer.cert} "
            f"(CA {tls.etcd_peer.ca}); for {', '.join(certificate_hosts(tls.nats.cert))}"
        )
    if args.api_keys:
        print(f"API keys: {write_api_keys(out, args.api_keys)}")
    if args.etcd_endpoint:
        try:
            print(_enable_etcd_auth(args, etcd_context))
        except PasswordsRefused as exc:
            print(f"kvswitch secrets: {_refused(exc)}", file=sys.stderr)
            return 2
        except EtcdAuthError as exc:
            print(f"kvswitch secrets: {exc}", file=sys.stderr)
            return 1
    return 0
