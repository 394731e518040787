"""The `KVSWITCH_` variables kvswitch reads, and the check every `kvswitch` subcommand makes of
its environment before it starts (kvswitch.cli).

A variable is refused only when no kvswitch process reads it: operators share one environment
between the router and the shims (a compose env_file, a ConfigMap), so a shim's setting in a
router's environment is no typo. A misspelt one (KVSWITCH_DISAG) would otherwise leave its setting
at the default without a word, as a misspelt file key would (protocol.config.check_file_keys).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from protocol.config import EtcdSettings, NatsSettings, RouterSettings, check_env_names, env_names
from protocol.errors import FLAG_ONLY
from protocol.timing import PROFILE_DIR_ENV, profile_dir

__all__ = ["ENV_PREFIX", "check_environment", "known_variables"]

ENV_PREFIX = "KVSWITCH_"
# runtime.configure_logging's, read by every process.
_LOG_VARIABLES = frozenset({"KVSWITCH_LOG_LEVEL", "KVSWITCH_LOG_FORMAT"})


def _common_variables() -> set[str]:
    """The variables known without importing the router or the shim (each a second or more):
    those of the shared settings, the flag-only switches (refused by the process that has the flag,
    naming it: protocol.config.check_flag_only_env) and the process-wide ones."""
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


def _process_variables() -> set[str]:
    """The router's and the shim's own settings' variables."""
    from router.cli import ProcessSettings
    from worker_shim.config import ShimConfig

    return env_names(ProcessSettings) | env_names(ShimConfig)


def known_variables() -> set[str]:
    """Every `KVSWITCH_` variable some kvswitch process reads."""
    return _common_variables() | _process_variables()


def check_environment(env: Mapping[str, str] | None = None) -> None:
    """VariableError naming each `KVSWITCH_` variable of `env` (os.environ) that no kvswitch process
    reads, with the nearest known name, or a KVSWITCH_PROFILE_DIR that names no directory."""
    env = os.environ if env is None else env
    given = {name for name in env if name.startswith(ENV_PREFIX)}
    if not given:
        return
    known = _common_variables()
    if not given <= known:  # only then is it worth importing the router and the shim to know theirs
        known = known_variables()
    check_env_names(known, env, ENV_PREFIX)
    profile_dir(env)
