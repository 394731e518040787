"""The router: prefix index, load view, worker selection, conditional disaggregation, dispatch,
the OpenAI front door, replica sync, metrics and traces (docs/router.md).

In-process: `async with RouterService(RouterConfig(ns=..., nats=..., etcd=...)) as r: r.url`; its
`broken` event is set once it is no longer correct (a failed registration, a loop it needs that
ended), and `await r.serve(stop)` runs it as `kvswitch router` does: stopped then, returning 1.
"""

from router.block_index import BlockIndex
from router.disagg import Disaggregator, RoutePlan
from router.kv_ingest import KvIngest
from router.load_view import LoadView, WorkerLoad
from router.planner import PlanError, Planner
from router.policies import POLICIES, Decision, DecodeGuard, Outcome, Path, Policy, make_policy
from router.replica_sync import ReplicaSync
from router.request_context import Candidate, RequestContext
from router.selection import Selector, worker_cost
from router.service import RouterConfig, RouterService, RouterStatus
from router.worker_registry import WorkerRegistry

__all__ = [
    "POLICIES",
    "BlockIndex",
    "Candidate",
    "Decision",
    "DecodeGuard",
    "Disaggregator",
    "KvIngest",
    "LoadView",
    "Outcome",
    "Path",
    "PlanError",
    "Planner",
    "Policy",
    "ReplicaSync",
    "RequestContext",
    "RoutePlan",
    "RouterConfig",
    "RouterService",
    "RouterStatus",
    "Selector",
    "WorkerLoad",
    "WorkerRegistry",
    "make_policy",
    "worker_cost",
]
