"""API keys for the router's front door: `Authorization: Bearer <key>`.

Keys live in a file of UTF-8 text, one per line (blank lines, `#` comments and a leading byte order
mark ignored), so they rotate without a restart: the file is re-read when its inode, modification
time, change time or size changes, checked at most once a second. A file that becomes unreadable,
not UTF-8 or empty keeps the last good keys and logs an ERROR (a rotation half-done must not lock
every client out, nor let everyone in). One that could not be read is tried again at every check
(logged once per change), so the chmod or chown that fixes it, or a passing EMFILE, brings the new
keys in.

Comparison is constant-time per key (hmac.compare_digest), and every key is compared, so neither
timing nor position tells a caller how close a guess was. Keys are never logged.
"""

from __future__ import annotations

import hmac
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["ApiKeys", "ApiKeysError"]

log = logging.getLogger(__name__)

_NEVER = object()


class ApiKeysError(ValueError):
    pass


class ApiKeys:
    def __init__(self, path: str | Path, *, clock: Callable[[], float] = time.monotonic, check_every_s: float = 1.0):
        self.path = Path(path)
        self._clock = clock
        self._check_every_s = check_every_s
        self._checked_at = clock()
        self._stamp = self._stat()
        self._unreadable: object = _NEVER  # the stamp of the file last found unreadable
        keys = self._read()
        if not keys:
            raise ApiKeysError(f"{self.path}: no API key in it (one key per line)")
        self._keys = keys
        self.reloads = 0

    def _stat(self) -> tuple[int, int, int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size)

    def _read(self) -> list[bytes]:
        try:
            text = self.path.read_text(encoding="utf-8-sig")  # -sig: a BOM (Windows editors) is no part of a key
        except OSError as exc:
            raise ApiKeysError(f"{self.path}: cannot read the API keys file: {exc.strerror}") from exc
        except UnicodeDecodeError as exc:  # the line number only: its bytes may be a key
            line = exc.object[: exc.start].count(b"\n") + 1
            raise ApiKeysError(f"{self.path}: the API keys file is not UTF-8 text (line {line})") from exc
        keys = [line.strip() for line in text.splitlines()]
        return [k.encode() for k in keys if k and not k.startswith("#")]

    def _maybe_reload(self) -> None:
        now = self._clock()
        if now - self._checked_at < self._check_every_s:
            return
        self._checked_at = now
        stamp = self._stat()
        if stamp == self._stamp:
            return
        try:
            keys = self._read()
        except ApiKeysError as exc:
            if stamp != self._unreadable:
                log.error("%s; keeping the %d keys read before", exc, len(self._keys))
                self._unreadable = stamp
            return
        self._stamp = stamp
        if not keys:
            log.error("%s is empty now; keeping the %d keys read before", self.path, len(self._keys))
            return
        self._keys = keys
        self.reloads += 1
        log.info("API keys reloaded from %s: %d keys", self.path, len(keys))

    def allows(self, authorization: str | None) -> bool:
        """Whether an `Authorization` header value carries one of the keys."""
        self._maybe_reload()
        if authorization is None:
            return False
        scheme, _, presented = authorization.partition(" ")
        if scheme.lower() != "bearer" or not presented:
            return False
        # The key is what follows "Bearer ", exactly, as vLLM compares it: `Bearer  key` is refused.
        # Never raises: aiohttp hands a byte that is not UTF-8 over as a lone surrogate, which no key equals.
        candidate = presented.encode("utf-8", "surrogatepass")
        ok = False
        for key in self._keys:
            ok |= hmac.compare_digest(candidate, key)
        return ok
