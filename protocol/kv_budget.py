"""The KV event budget every router gives a sender on `{ns}.kv.{worker}` by default, and the pace
a shim keeps under it. Two processes need the numbers: the router drops (and quarantines) a sender
past its budget before decoding (router.sender_budget, its --kv-budget-* flags), and a shim paces
what it publishes there (worker_shim.kv_pace) so that its bulk sends, a registration's snapshot of
a warm cache and a ring of batches held through a NATS stall, never read as a flood.

The shim's pace is half the default budget, rates and bursts alike: a router whose loop stalls
reads what queued meanwhile at once, and the half left holds a stall of up to
KV_MIB_BURST / KV_PACE_MIB_PER_S = 2 s at the pace (the bucket refills at twice the pace).
"""

from __future__ import annotations

__all__ = [
    "KV_BATCHES_PER_S",
    "KV_BATCH_BURST",
    "KV_MIB_BURST",
    "KV_MIB_PER_S",
    "KV_PACE_BATCHES_PER_S",
    "KV_PACE_BATCH_BURST",
    "KV_PACE_MIB_BURST",
    "KV_PACE_MIB_PER_S",
]

# KV batches: a shim seals one every 5 ms (200 a second) or sooner when 256 events, 20,000 hashes
# or a payload's bytes are pending (worker_shim.kv_publisher). An engine's events come a few per
# scheduler step, so 200 a second is its steady most; 1,000 is five times that, and a burst of
# 5,000 holds five seconds of it read at once after a stall.
KV_BATCHES_PER_S = 1000.0
KV_BATCH_BURST = 5000.0
# A batch holds at most 20,000 hashes, 8 bytes each packed: 160 KB. 4 MiB a second is 500,000
# hashes, 20 times the blocks an engine prefilling 200,000 tokens a second at 16 tokens a block
# stores and evicts (25,000); a burst of 4 MiB is 25 of the largest batches. Every batch within the
# budget is decoded (a 469 KB one of listed hashes took ~10 ms), and the other workers' batches wait
# behind them until the quarantine is in: with bursts of 32 MiB nats-server cut the connection
# first, and with 8 MiB the honest worker of tests/router/test_e2e_faults.py waited past its 1 s
# grace on a loaded box.
KV_MIB_PER_S = 4.0
KV_MIB_BURST = 4.0
# A shim's pace: half of each. The batch burst is the rate's second (not half the 5,000): a router
# may be run with a burst as low as its rate, and the pace must pass the least a router allows.
KV_PACE_BATCHES_PER_S = KV_BATCHES_PER_S / 2
KV_PACE_BATCH_BURST = KV_PACE_BATCHES_PER_S
KV_PACE_MIB_PER_S = KV_MIB_PER_S / 2
KV_PACE_MIB_BURST = KV_MIB_BURST / 2
