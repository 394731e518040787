"""`kvswitch router`: a setting refused at startup is one line naming its flag, before NATS or etcd."""

from __future__ import annotations

import subprocess
import sys


def test_a_tokenizer_that_cannot_be_loaded_is_refused_naming_the_flag() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvswitch", "router", "--tokenizer", "/nonexistent",
         "--nats-servers", "nats://127.0.0.1:1", "--etcd-endpoints", "http://127.0.0.1:1"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith(
        "kvswitch router: invalid tokenizer (--tokenizer, KVSWITCH_TOKENIZER) = '/nonexistent': "
    )
    assert "NATS" not in out.stderr
