"""etcd: registration under a lease, watches of workers and routers, and live router config.

The only package that imports the etcd client. Everything it hands out is a protocol type.
"""

from discovery.lease import Lease, LeaseLost, LeaseState
from discovery.live_config import ConfigWatcher, put_config
from discovery.registration import Registration, RegistrationState
from discovery.session import Discovery, DiscoveryError, KeyTaken
from discovery.watch import Deleted, Put, Snapshot, WatchEvent

__all__ = [
    "ConfigWatcher",
    "Deleted",
    "Discovery",
    "DiscoveryError",
    "KeyTaken",
    "Lease",
    "LeaseLost",
    "LeaseState",
    "Put",
    "Registration",
    "RegistrationState",
    "Snapshot",
    "WatchEvent",
    "put_config",
]
