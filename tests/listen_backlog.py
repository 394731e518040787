"""How many connections a server's listening socket takes while its event loop is busy: the kernel
completes each handshake into the socket's accept queue, up to its listen backlog, with no help
from the process."""

from __future__ import annotations

import socket
import time
from concurrent.futures import ThreadPoolExecutor

__all__ = ["connected_while_blocked"]


def connected_while_blocked(host: str, port: int, count: int, timeout_s: float = 0.2) -> int:
    """Of `count` connections opened from a thread while the calling thread (the server's event
    loop) sleeps, how many completed their handshake within `timeout_s` each."""

    def connect_all() -> int:
        done, socks = 0, []
        try:
            for _ in range(count):
                s = socket.socket()
                socks.append(s)
                s.settimeout(timeout_s)
                try:
                    s.connect((host, port))
                    done += 1
                except OSError:
                    pass
        finally:
            for s in socks:
                s.close()
        return done

    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(connect_all)
        while not future.done():
            time.sleep(0.05)  # the loop stays blocked: nothing accepts
        return future.result()
