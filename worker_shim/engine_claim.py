"""The shim's claim on its engine: `/{ns}/engines/{engine}`, created if absent under the worker's
lease, so a second shim started beside an engine that one already serves fails at startup.

Without it, two shims on one engine (a copy-paste slip, a second `kvswitch shim` left running)
both registered and both were routed to: one engine's capacity and cache counted twice, its
requests split between two workers that each saw the other's load as nothing of theirs.

Identity (`engine_id`): where `--engine-url` leads, not how it is spelled. The scheme is dropped
(one port serves one of them), the host lowercased (an IP address in its short form, an IPv4-mapped
IPv6 one as its IPv4), the port made explicit (80, 443) and a trailing `/` cut. A host that may
name another machine from each machine (`host_relative`) is qualified by this host: its name, and
its machine id (/etc/machine-id, when there is one: machines cloned from one image may share a host
name, even `localhost`). A loopback or unspecified host (`localhost`, `127.0.0.1`, `::1`,
`0.0.0.0`, `::ffff:127.0.0.1`) is one engine on this host (`localhost@{host}`: a Kubernetes
sidecar reaches its engine at localhost, and every pod's localhost is another engine). Qualified
too (`{address}@{host}`): every IP address that is not globally routable (a docker bridge's
gateway, 172.17.0.1, is each docker host; a compose network's 172.18.0.5 each machine's own
container; a link-local 169.254.x.x or fe80:: is per link), a name of one label (`vllm`: a compose
service, an /etc/hosts entry, a search domain, each resolved by this machine), and the names
container runtimes give the host (host.docker.internal, gateway.docker.internal,
host.containers.internal, host.lima.internal). A false refusal takes a second machine's engine out,
where a miss leaves the double count the claim is there to catch, so the rule errs on the miss:
shims on two machines given one engine's private address or one-label name are not caught (a
Kubernetes pod IP, a Service's short name), nor one engine named by two hosts (its loopback and its
own address, or two DNS names). A name with a dot, or a global address, is taken to name one
engine wherever it is resolved. vLLM data parallelism runs a shim per rank beside one server
(`--data-parallel-rank R`): each rank is an engine of its own (`#dpR`); no rank and rank 0 are one
engine (a server with more ranks refuses a shim without one).

A held claim is met as a held `--worker-name` is (worker_shim.shim): a holder proven gone (killed
without its stop) has its lease revoked and the claim is made at once (worker_shim.takeover);
otherwise, for one lease TTL and a margin, it may be a crashed shim's whose lease expires, so the
shim waits; past that it exits 2 naming `--engine-url` and the worker, host and lease that hold
the engine. The claim is read so at each session's start too, before the shim binds the engine's
event address: an engine that connects to its shim (an endpoint with no `*`, as `kvswitch up`
starts one) has that address bound by the first shim, and a second one's bind failed first, with
advice about --kv-events-mode that led nowhere (operator walkthrough of 2026-12-07).
"""

from __future__ import annotations

import ipaddress
import socket
from pathlib import Path
from urllib.parse import urlsplit

from discovery import KeyTaken
from protocol import ConfigError, EngineClaim, ProtocolError, decode_json, subjects

__all__ = ["claim", "claim_key", "engine_id", "host_relative", "taken", "this_host"]

MACHINE_ID = "/etc/machine-id"  # systemd's; absent in most containers, where the host name tells pods apart
# The names container runtimes give the machine a container runs on (Docker, Podman, Lima).
HOST_ALIASES = frozenset(
    {"host.docker.internal", "gateway.docker.internal", "host.containers.internal", "host.lima.internal"}
)


def _address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """`host` as an IP address (an IPv4-mapped IPv6 one as its IPv4), or None for a name."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _loopback(host: str) -> bool:
    if host == "localhost" or host.endswith(".localhost"):
        return True
    address = _address(host)
    return address is not None and (address.is_loopback or address.is_unspecified)


def host_relative(host: str) -> bool:
    """Whether `host` (lowercased) may lead to another machine from each machine: loopback, an
    address not globally routable, a name of one label, a container runtime's name for the host."""
    address = _address(host)
    if address is not None:
        return not address.is_global
    return _loopback(host) or "." not in host or host in HOST_ALIASES


def this_host() -> str:
    """This host's name, and its machine id's first 12 digits when it has one (`name~id`)."""
    try:
        machine = Path(MACHINE_ID).read_text().strip()[:12]
    except OSError:
        machine = ""
    return socket.gethostname() + (f"~{machine}" if machine else "")


def engine_id(url: str, rank: int | None, hostname: str) -> str:
    """The engine `url` (a validated `--engine-url`) leads to, seen from `hostname` (this_host()),
    and its rank."""
    parts = urlsplit(url)
    host = (parts.hostname or "").lower()
    port = parts.port or (443 if parts.scheme == "https" else 80)
    address = _address(host)
    shown = address.compressed if address is not None else host
    if ":" in shown:
        shown = f"[{shown}]"
    if _loopback(host):
        where = f"localhost@{hostname}"
    elif host_relative(host):
        where = f"{shown}@{hostname}"
    else:
        where = shown
    return f"{where}:{port}{parts.path.rstrip('/')}" + (f"#dp{rank}" if rank else "")


def claim_key(ns: str, url: str, rank: int | None) -> str:
    """The key of the claim on the engine at `url`."""
    return subjects.engine_key(ns, engine_id(url, rank, this_host()))


def claim(ns: str, url: str, rank: int | None, worker: str) -> dict[str, EngineClaim]:
    """The claim `worker` makes on the engine at `url` (Registration's `claims`)."""
    return {claim_key(ns, url, rank): EngineClaim(worker=worker, engine_url=url, host=socket.gethostname())}


def taken(exc: KeyTaken, url: str, ttl: int) -> ConfigError:
    """The startup error of a claim another lease holds, naming its holder."""
    try:
        holder = decode_json(exc.value, EngineClaim)
        who = f"worker {holder.worker} (host {holder.host}, --engine-url {holder.engine_url}, lease {exc.holder:x})"
    except ProtocolError:
        who = f"lease {exc.holder:x}"
    engine = exc.key.split("/", 3)[-1]  # /{ns}/engines/{engine}, the engine's id with its slashes
    return ConfigError(
        "engine_url",
        url,
        f"the engine {engine} is already served by {who}: a second shim would count its capacity and cache "
        f"twice. Stop one (a crashed shim's lease would have expired within {ttl}s); vLLM data-parallel "
        "ranks each take their own shim with --data-parallel-rank R",
    )
