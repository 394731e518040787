"""etcd: registration under a lease, watches of workers and routers, and live router config.

The only package that imports the etcd client. Everything it hands out is a protocol type.

gRPC's fork support is turned off before the client is imported: a process that used etcd and then
starts children (the local cluster, the benchmarks) would otherwise crash them between fork and
exec in gRPC's fork handlers (SIGABRT, "epoll_wait error: Bad file descriptor"). Every child here
execs at once, so nothing needs gRPC to survive a fork.
"""

import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

from discovery.advice import advice
from discovery.failed_tries import SAID_EVERY_S, FailedTries
from discovery.lease import Lease, LeaseLost, LeaseState, renewal_interval
from discovery.live_config import ConfigWatcher, put_config
from discovery.registration import PutTrouble, Registration, RegistrationState
from discovery.session import Discovery, DiscoveryError, KeyTaken
from discovery.watch import Deleted, Put, Snapshot, WatchEvent

__all__ = [
    "SAID_EVERY_S",
    "ConfigWatcher",
    "Deleted",
    "Discovery",
    "DiscoveryError",
    "FailedTries",
    "KeyTaken",
    "Lease",
    "LeaseLost",
    "LeaseState",
    "Put",
    "PutTrouble",
    "Registration",
    "RegistrationState",
    "Snapshot",
    "WatchEvent",
    "advice",
    "put_config",
    "renewal_interval",
]
