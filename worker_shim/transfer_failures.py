"""`TransferFailures`: the KV pulls this worker's engine failed without failing their request.

Under vLLM's default `kv_load_failure_policy: "fail"` a failed pull fails its request with a 500,
which the router that sent it sees, and it knows the prefill worker too (router.transfer_health).
Under `"recompute"` the engine prefills the prompt itself and the request succeeds, late: the
prefill leg's work was thrown away, the decode worker did it again, and nothing but the engine's
`vllm:nixl_num_failed_transfers` counter says so. The shim reads that counter with the load
polls and takes from its rises the decode legs it saw the engine itself fail (a 500 of its own,
not a connection lost) before any output (`leg_failed`): what is left are the silent failures,
`total`, forwarded as LoadReport.kv_transfers_failed so that every router closes the remote path
into this worker for a while. A rise is judged one reading after it is seen, as the engine counts a
failure just before its answer says so. A failed leg explains a rise judged within `LEG_READINGS`
readings of it and nothing later: one the engine never counted (it failed for another reason) is
forgotten, not kept to hide a later silent failure. A WARNING goes out when silent failures start
after `quiet_s` without any.

A counter that goes down (the engine restarted) starts over from its new value; the rise seen at
the old run's last reading is still judged against the old run's failed legs, which are then
forgotten. None (the engine exports no such counter: no NIXL connector, or another engine) counts
nothing. Synchronous: the caller passes the time in.
"""

from __future__ import annotations

import logging
from collections import deque

__all__ = ["LEG_READINGS", "TransferFailures"]

log = logging.getLogger(__name__)
# A failed leg's count can be read one reading late (the poll read the counter just before the
# engine counted it) and is judged one reading after that: a leg waits this many for its rise.
LEG_READINGS = 3


class TransferFailures:
    def __init__(self, engine: str = "", *, quiet_s: float = 60.0) -> None:
        self.engine = engine  # names it in the log
        self.quiet_s = quiet_s
        self.total = 0  # silent failed pulls since the shim started
        self.rises = 0  # every failed pull the engine counted since then
        self.failed_legs = 0  # decode legs fed by a transfer that the engine failed
        self.readings = 0
        self._last: int | None = None  # the engine counter's last reading
        self._seen = 0  # the rise at the last reading, judged at the next one
        self._legs: deque[int] = deque()  # `readings` when each failed leg not yet matched came
        self._last_failure_at: float | None = None

    def leg_failed(self) -> None:
        """A decode leg fed by a transfer ended with an engine error before any output."""
        self.failed_legs += 1
        self._legs.append(self.readings)

    def reading(self, failed: int | None, at: float) -> bool:
        """The engine's cumulative failed pulls at `at`; True when `total` grew."""
        self.readings += 1
        last, self._last = self._last, failed
        judged, self._seen = self._seen, 0
        legs = self._legs
        while legs and legs[0] < self.readings - LEG_READINGS:
            legs.popleft()
        explained = min(len(legs), judged)
        for _ in range(explained):
            legs.popleft()
        # The rise judged was seen at the last reading: that run's legs explain it before a reset.
        if failed is None or last is None or failed < last:
            legs.clear()  # no counter, a new baseline or a restarted engine
        elif failed > last:
            self._seen = failed - last
            self.rises += self._seen
        new = judged - explained
        if new <= 0:
            return False
        self.total += new
        if self._last_failure_at is None or at - self._last_failure_at >= self.quiet_s:
            log.warning(
                "engine %s failed %d KV pull(s) without failing the request (vllm:nixl_num_failed_transfers; "
                "kv_load_failure_policy recompute): the prefill workers' work for them was lost and this worker "
                "prefilled them itself; routers stop sending it remote prefills for a while. The vLLM logs of this "
                "engine and the prefill engines say why: a failed NIXL read, or an expired KV lease (a prefill engine "
                "frees unpulled KV after --kv-transfer-config's kv_connector_extra_config.kv_lease_duration, 30 s by "
                "default, set alike on both sides, unless this engine's heartbeats reach its NIXL side channel, "
                "VLLM_NIXL_SIDE_CHANNEL_HOST and VLLM_NIXL_SIDE_CHANNEL_PORT)",
                self.engine or "?",
                new,
            )
        self._last_failure_at = at
        return True
