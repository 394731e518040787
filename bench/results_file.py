"""A benchmark's JSON results, written as each one lands.

A live run of `compare`, `overhead` or `chaos` takes minutes per phase; one that failed at its last
phase (a peer that would not start, an aiperf crash, Ctrl-C) used to write nothing, and every phase
measured before was lost. Here the file is rewritten whole after each result (through a temporary
file and a rename, so a reader never sees half a file), and a run that stops says how many results
it kept and where.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Generic, TypeVar

import msgspec

__all__ = ["ResultsFile", "check_out_dir", "fresh_path", "stamp"]

T = TypeVar("T")


def check_out_dir(flag: str, out_dir: Path) -> None:
    """A directory written into after the run: created, or refused, before it."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise ValueError(f"{flag} {out_dir}: not a directory") from None
    except OSError as exc:
        raise ValueError(f"{flag} {out_dir}: cannot create it: {exc.strerror or exc}") from None
    if not os.access(out_dir, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {out_dir}: not writable")


def stamp() -> str:
    """A run's time in the names of what it writes (results, logs): local time, to the second."""
    return time.strftime("%Y%m%d-%H%M%S")


def fresh_path(directory: Path, prefix: str, suffix: str) -> Path:
    """`directory/prefix-<stamp><suffix>`, a name no other run has: created empty here, so that two
    runs started in the same second (the stamp's resolution) do not write one file, the second
    silently replacing the first's results. A name taken gets `-2`, `-3`, ... after the stamp."""
    now = stamp()
    directory.mkdir(parents=True, exist_ok=True)
    for n in itertools.count(1):
        path = directory / f"{prefix}-{now}{'' if n == 1 else f'-{n}'}{suffix}"
        try:
            path.open("xb").close()
        except FileExistsError:
            continue
        return path
    raise AssertionError("unreachable")


class ResultsFile(Generic[T]):
    def __init__(self, path: Path, *, indent: int = 0) -> None:
        self.path = path
        self.items: list[T] = []
        self._indent = indent

    def add(self, item: T) -> None:
        self.items.append(item)
        self.write()

    def write(self) -> None:
        body = msgspec.json.encode(self.items)
        if self._indent:
            body = msgspec.json.format(body, indent=self._indent)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_bytes(body)
        os.replace(tmp, self.path)

    @contextlib.contextmanager
    def kept_on_failure(self, what: str) -> Iterator[None]:
        """Around the measuring: on any exit by exception, say what was kept before it propagates."""
        try:
            yield
        except BaseException:
            n = len(self.items)
            kept = f"{n} results measured before the failure are in {self.path}" if n else "nothing was measured"
            if not n:
                self.path.unlink(missing_ok=True)  # the name fresh_path reserved
            print(f"{what} stopped early: {kept}", file=sys.stderr, flush=True)
            raise
