"""`TransferFailures`: the KV pulls this worker's engine failed, from its own counter.

Under vLLM's default `kv_load_failure_policy: "fail"` a failed pull fails its request, which the
router sees. Under `"recompute"` the engine prefills the prompt itself and the request succeeds,
late: the prefill leg's work was thrown away, the decode worker did it again, and nothing but
the engine's `vllm:nixl_num_failed_transfers` counter says so. The shim reads that counter with
the load polls, adds its increases to `total` (forwarded as LoadReport.kv_transfers_failed, so
every router closes the remote path into this worker for a while: router.transfer_health), and
logs a WARNING when failures start after `quiet_s` without any.

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
        self.total = 0  # failed pulls seen since the shim started
        self._last: int | None = None  # the engine counter's last reading
        self._last_failure_at: float | None = None

    def reading(self, failed: int | None, at: float) -> bool:
        """The engine's cumulative failed pulls at `at`; True when it failed more since the last
        reading."""
        last, self._last = self._last, failed
        if failed is None or last is None or failed <= last:
            return False
        new = failed - last
        self.total += new
        if self._last_failure_at is None or at - self._last_failure_at >= self.quiet_s:
            log.warning(
                "engine %s failed %d KV pull(s) (vllm:nixl_num_failed_transfers): the prefill workers' work for "
                "those requests was lost and, under kv_load_failure_policy recompute, this worker prefilled them "
                "itself; routers stop sending it remote prefills for a while. Check the KV connector (NIXL) "
                "between the prefill workers and this one, and the prefill engines' kv pin timeout",
                self.engine or "?",
                new,
            )
        self._last_failure_at = at
        return True
