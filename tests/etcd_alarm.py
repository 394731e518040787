"""etcd's NOSPACE alarm raised and disarmed by hand, as a backend at --quota-backend-bytes raises
it: etcd then answers every write (a lease grant included) "database space exceeded" until disarmed.
It refuses every client's writes: a test raises it on an etcd of its own."""

from __future__ import annotations

import json
import urllib.request

from kvswitch.servers import EtcdServer


def nospace_alarm(etcd: EtcdServer, action: str) -> None:
    """`action`: "ACTIVATE" or "DEACTIVATE" (etcd's AlarmRequest)."""
    with urllib.request.urlopen(urllib.request.Request(f"{etcd.url}/v3/maintenance/status", b"{}")) as resp:
        status = json.loads(resp.read())
    body = {"action": action, "memberID": status["header"]["member_id"], "alarm": "NOSPACE"}
    with urllib.request.urlopen(urllib.request.Request(f"{etcd.url}/v3/maintenance/alarm", json.dumps(body).encode())):
        pass
