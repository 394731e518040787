"""`TransferFailures`: the KV pulls this worker's engine failed without failing their request.

Under vLLM's default `kv_load_failure_policy: "fail"` a failed pull fails its request with a 500,
which the router that sent it sees, and it knows the prefill worker too (router.transfer_health).
Under `"recompute"` the engine prefills the prompt itself and the request succeeds, late: the
prefill leg's work was thrown away, the decode worker did it again, and nothing but the engine's
`vllm:nixl_num_failed_transfers` counter says so. The shim reads that counter with the load
polls and takes from its rises the decode legs it saw fail with an engine error before any output
(`leg_failed`): what is left are the silent failures, `total`, forwarded as
LoadReport.kv_transfers_failed so that every router closes the remote path into this worker for a
while. A rise is judged one reading after it is seen, as the engine counts a failure just before
its answer says so. A WARNING goes out when silent failures start after `quiet_s` without any.

A counter that goes down (the engine restarted) starts over from its new value; None (the
engine exports no such counter: no NIXL connector, or another engine) counts nothing.
Synchronous: the caller passes the time in.
"""

from __future__ import annotations

import logging

__all__ = ["TransferFailures"]

log = logging.getLogger(__name__)


class TransferFailures:
    def __init__(self, engine: str = "", *, quiet_s: float = 60.0) -> None:
        self.engine = engine  # names it in the log
        self.quiet_s = quiet_s
        self.total = 0  # silent failed pulls since the shim started
        self.rises = 0  # every failed pull the engine counted since then
        self.failed_legs = 0  # decode legs fed by a transfer that the engine failed
        self.readings = 0
        self._last: int | None = None  # the engine counter's last reading
        self._judged = 0  # `rises` as of the reading before: those old enough to judge
        self._last_failure_at: float | None = None

    def leg_failed(self) -> None:
        """A decode leg fed by a transfer ended with an engine error before any output."""
        self.failed_legs += 1

    def reading(self, failed: int | None, at: float) -> bool:
        """The engine's cumulative failed pulls at `at`; True when `total` grew."""
        self.readings += 1
        last, self._last = self._last, failed
        judged = self._judged
        if failed is not None and last is not None and failed > last:
            self.rises += failed - last
        self._judged = self.rises
        silent = judged - self.failed_legs
        if silent <= self.total:
            return False
        new, self.total = silent - self.total, silent
        if self._last_failure_at is None or at - self._last_failure_at >= self.quiet_s:
            log.warning(
                "engine %s failed %d KV pull(s) without failing the request (vllm:nixl_num_failed_transfers; "
                "kv_load_failure_policy recompute): the prefill workers' work for them was lost and this worker "
                "prefilled them itself; routers stop sending it remote prefills for a while. Check the KV connector "
                "(NIXL) between the prefill workers and this one, and the prefill engines' kv pin timeout",
                self.engine or "?",
                new,
            )
        self._last_failure_at = at
        return True
