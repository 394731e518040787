"""The `KVSWITCH_` variables kvswitch reads, and the check every `kvswitch` subcommand makes of
its environment before it starts (kvswitch.cli).

A variable is refused only when no kvswitch process reads it: operators share one environment
between the router and the shims (a compose env_file, a ConfigMap), so a shim's setting in a
router's environment is no typo. A misspelt one (KVSWITCH_DISAG) would otherwise leave its setting
at the default without a word, as a misspelt file key would (protocol.config.check_file_keys).
The variables a kubelet sets for a Service named `kvswitch-*` (enableServiceLinks) are refused too,
saying so: the manifests turn them off (deploy/k8s); a pod spec of an operator's own may not.
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Mapping

from protocol.config import EtcdSettings, NatsSettings, RouterSettings, check_env_names, env_names
from protocol.errors import FLAG_ONLY, VariableError
from protocol.timing import PROFILE_DIR_ENV, profile_dir

__all__ = ["ENV_PREFIX", "PROCESS_VARIABLES", "check_environment", "known_variables"]

ENV_PREFIX = "KVSWITCH_"
# runtime.configure_logging's, read by every process.
_LOG_VARIABLES = frozenset({"KVSWITCH_LOG_LEVEL", "KVSWITCH_LOG_FORMAT"})
# The router's and the shim's own settings' (router.cli.ProcessSettings, worker_shim.config.ShimConfig),
# written out: importing them to ask takes a second and 40 MB in every process, `kvswitch sim`'s too.
# tests/kvswitch/test_environment.py keeps it equal to theirs.
PROCESS_VARIABLES = frozenset({
    "KVSWITCH_API_KEYS_FILE", "KVSWITCH_BLOCK_SIZE", "KVSWITCH_BODY_TIMEOUT_S", "KVSWITCH_BOOTSTRAP_HOST",
    "KVSWITCH_BUSY_LIMIT_S", "KVSWITCH_CHAT_TEMPLATE_CONTENT_FORMAT", "KVSWITCH_CLIENT_BUFFER_MIB",
    "KVSWITCH_DATA_PARALLEL_RANK",
    "KVSWITCH_DEBUG_API_KEYS_FILE", "KVSWITCH_DEFAULT_CHAT_TEMPLATE_KWARGS", "KVSWITCH_DRAIN_GRACE_S",
    "KVSWITCH_ENGINE", "KVSWITCH_ENGINE_URL", "KVSWITCH_EVENTS_TIMEOUT_S",
    "KVSWITCH_EXCLUDE_TOOLS_WHEN_TOOL_CHOICE_NONE", "KVSWITCH_HEALTH_FAILURES", "KVSWITCH_HEALTH_INTERVAL_S",
    "KVSWITCH_HTTP_HOST", "KVSWITCH_HTTP_PORT", "KVSWITCH_IDLE_TIMEOUT_S", "KVSWITCH_INDEX_LIMIT_PER_WORKER",
    "KVSWITCH_KV_BUDGET_BATCHES_PER_S", "KVSWITCH_KV_BUDGET_BATCH_BURST", "KVSWITCH_KV_BUDGET_MIB_BURST",
    "KVSWITCH_KV_BUDGET_MIB_PER_S", "KVSWITCH_KV_BYTES_PER_TOKEN", "KVSWITCH_KV_EVENTS", "KVSWITCH_KV_EVENTS_CONFIG",
    "KVSWITCH_KV_EVENTS_MODE", "KVSWITCH_KV_EVENTS_TOPIC", "KVSWITCH_KV_REPLAY", "KVSWITCH_KV_TOTAL_BLOCKS",
    "KVSWITCH_LEASE_TTL", "KVSWITCH_LOAD_PERIOD_S", "KVSWITCH_MAX_BODY_BYTES", "KVSWITCH_MAX_INFLIGHT_LEGS",
    "KVSWITCH_MAX_NUM_BATCHED_TOKENS", "KVSWITCH_MODEL", "KVSWITCH_MODEL_PATH", "KVSWITCH_NAMESPACE",
    "KVSWITCH_NO_CALIBRATION", "KVSWITCH_NO_ENDPOINT_PROBE", "KVSWITCH_ORPHAN_GRACE_S", "KVSWITCH_REQUEST_TIMEOUT",
    "KVSWITCH_REREGISTER_GRACE_S", "KVSWITCH_ROLE", "KVSWITCH_ROUTE_INFO", "KVSWITCH_STALL_LIMIT_S",
    "KVSWITCH_SYNC_SNAPSHOT_S", "KVSWITCH_TIMING_PROFILE",
    "KVSWITCH_TOKENIZER", "KVSWITCH_WORKER_NAME",
})  # fmt: skip

# What the kubelet sets for a Service S (upper case, dashes to underscores; its pkg/kubelet/envvars):
# S_SERVICE_HOST, S_SERVICE_PORT and S_SERVICE_PORT_<PORT NAME>, then Docker's link variables
# S_PORT and, for each port, S_PORT_<n>_<PROTO> and its _PROTO, _PORT and _ADDR. The shortest
# Service wins where two read alike (KVSWITCH_SERVICE_PORT: `kvswitch`'s, not `kvswitch-service`'s).
_PROTO = r"_[0-9]+_(?:TCP|UDP|SCTP)"
_SERVICE_LINK = re.compile(
    rf"{ENV_PREFIX}(?:(?P<rest>[A-Z0-9_]+?)_)??(?:"
    rf"(?P<ip>SERVICE_HOST|PORT{_PROTO}_ADDR)|(?P<port>SERVICE_PORT(?:_[A-Z0-9_]+)?|PORT{_PROTO}_PORT)"
    rf"|(?P<url>PORT(?:{_PROTO})?)|(?P<proto>PORT{_PROTO}_PROTO))"
)
_LINK_URL = re.compile(r"(?:tcp|udp|sctp)://\[?(?P<ip>[0-9A-Fa-f.:]+?)\]?:[0-9]+")  # the Service's IP


def _common_variables() -> set[str]:
    """The variables of the shared settings, the flag-only switches (refused by the process that
    has the flag, naming it: protocol.config.check_flag_only_env) and the process-wide ones."""
    from kvswitch.deploy_secrets import PASSWORD_ENV
    from kvswitch.servers import FREE_PORTS_ENV, PORTS_DIR_ENV

    return (
        env_names(RouterSettings)
        | env_names(NatsSettings, "nats_")
        | env_names(EtcdSettings, "etcd_")
        | {ENV_PREFIX + name.upper() for name in FLAG_ONLY}
        | _LOG_VARIABLES
        | {PROFILE_DIR_ENV, FREE_PORTS_ENV, PORTS_DIR_ENV}
        | set(PASSWORD_ENV.values())
    )


def known_variables() -> set[str]:
    """Every `KVSWITCH_` variable some kvswitch process reads."""
    return _common_variables() | PROCESS_VARIABLES


def _is_ip(value: str) -> bool:
    try:
        ipaddress.ip_address(value)
    except ValueError:
        return False
    return True


def _link_service(name: str, value: str) -> str | None:
    """The Service whose kubelet-set variable `name` = `value` is, or None: the value must have
    the link's shape too, so a misspelt KVSWITCH_HTPP_PORT=8080 is still named a typo."""
    link = _SERVICE_LINK.fullmatch(name)
    if link is None:
        return None
    shaped = (
        (link["ip"] is not None and _is_ip(value))
        or (link["port"] is not None and value.isascii() and value.isdigit())
        or (link["url"] is not None and (url := _LINK_URL.fullmatch(value)) is not None and _is_ip(url["ip"]))
        or (link["proto"] is not None and value in ("tcp", "udp", "sctp"))
    )
    if not shaped:
        return None
    return "kvswitch" + ("-" + link["rest"].lower().replace("_", "-") if link["rest"] else "")


def _service_links(env: Mapping[str, str], known: set[str]) -> tuple[list[str], set[str]]:
    """A sentence for each Service whose link variables `env` holds, each opening with one of them
    (one a Service, as a Service with one port sets eight), and those variables."""
    services: dict[str, list[str]] = {}
    for name in sorted(env):
        if name.startswith(ENV_PREFIX) and name not in known and (service := _link_service(name, env[name])):
            services.setdefault(service, []).append(name)
    sentences = []
    for service, names in services.items():
        lead, *rest = sorted(names, key=lambda name: (not name.endswith("_SERVICE_HOST"), name))
        sentences.append(
            f"{lead} looks like a Kubernetes service link for Service {service!r}"
            + (f" (as do {', '.join(rest)})" if rest else "")
            + ": set enableServiceLinks: false in the pod spec or rename the Service"
        )
    return sentences, {name for names in services.values() for name in names}


def check_environment(env: Mapping[str, str] | None = None) -> None:
    """VariableError naming each `KVSWITCH_` variable of `env` (os.environ) that no kvswitch process
    reads, with the nearest known name or the Kubernetes Service that set it, or a
    KVSWITCH_PROFILE_DIR that names no directory."""
    env = os.environ if env is None else env
    if not any(name.startswith(ENV_PREFIX) for name in env):
        return
    known = known_variables()
    problems, linked = _service_links(env, known)
    try:
        check_env_names(known | linked, env, ENV_PREFIX)  # the rest: typos
    except VariableError as typos:
        problems.append(str(typos))
    if problems:
        variable, problem = "; ".join(problems).split(" ", 1)  # each problem opens with its variable
        raise VariableError(variable, problem)
    profile_dir(env)
