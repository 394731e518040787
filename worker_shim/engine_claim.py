"""The shim's claim on its engine: `/{ns}/engines/{engine}`, created if absent under the worker's
lease, so a second shim started beside an engine that one already serves fails at startup.

Without it, two shims on one engine (a copy-paste slip, a second `kvswitch shim` left running)
both registered and both were routed to: one engine's capacity and cache counted twice, its
requests split between two workers that each saw the other's load as nothing of theirs.

Identity (`engine_id`): where `--engine-url` leads, not how it is spelled. The scheme is dropped
(one port serves one of them), the host lowercased, the port made explicit (80, 443) and a trailing
`/` cut. A loopback or unspecified host (`localhost`, `127.0.0.1`, `::1`, `0.0.0.0`) names an
engine on this host only: it is qualified by the host name (a Kubernetes sidecar reaches its
engine at localhost, and every pod's localhost is another engine), and by the machine id
(/etc/machine-id, when there is one: machines cloned from one image may share a host name, even
`localhost`, and refusing a second machine's shim would take its engine out). vLLM data parallelism runs a
shim per rank beside one server (`--data-parallel-rank R`): each rank is an engine of its own
(`#dpR`); no rank and rank 0 are one engine (a server with more ranks refuses a shim without one).
Not caught: one engine named by two hosts (its loopback and its own IP address, or two DNS names).

A held claim is met as a held `--worker-name` is (worker_shim.shim): a holder proven gone (killed
without its stop) has its lease revoked and the claim is made at once (worker_shim.takeover);
otherwise, for one lease TTL and a margin, it may be a crashed shim's whose lease expires, so the
shim waits; past that it exits 2 naming `--engine-url` and the worker, host and lease that hold
the engine.
"""

from __future__ import annotations

import ipaddress
import socket
from pathlib import Path
from urllib.parse import urlsplit

from discovery import KeyTaken
from protocol import ConfigError, EngineClaim, ProtocolError, decode_json, subjects

__all__ = ["claim", "engine_id", "taken", "this_host"]

MACHINE_ID = "/etc/machine-id"  # systemd's; absent in most containers, where the host name tells pods apart


def _local(host: str) -> bool:
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return address.is_loopback or address.is_unspecified


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
    where = f"localhost@{hostname}" if _local(host) else f"[{host}]" if ":" in host else host
    return f"{where}:{port}{parts.path.rstrip('/')}" + (f"#dp{rank}" if rank else "")


def claim(ns: str, url: str, rank: int | None, worker: str) -> dict[str, EngineClaim]:
    """The claim `worker` makes on the engine at `url` (Registration's `claims`)."""
    key = subjects.engine_key(ns, engine_id(url, rank, this_host()))
    return {key: EngineClaim(worker=worker, engine_url=url, host=socket.gethostname())}


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
