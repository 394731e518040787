"""etcd: registration under a lease, watches of workers and routers, and live router config.

The only package that imports the etcd client. Everything it hands out is a protocol type.
"""

from discovery.lease import Lease, LeaseLost
from discovery.live_config import ConfigWatcher, put_config
from discovery.session import Discovery, DiscoveryError
from discovery.watch import Deleted, Put, Snapshot, WatchEvent

__all__ = [
    "ConfigWatcher",
    "Deleted",
    "Discovery",
    "DiscoveryError",
    "Lease",
    "LeaseLost",
    "Put",
    "Snapshot",
    "WatchEvent",
    "put_config",
]
