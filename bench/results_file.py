"""A benchmark's JSON results, written as each one lands.

A live run of `compare`, `overhead` or `chaos` takes minutes per phase; one that failed at its last
phase (a peer that would not start, an aiperf crash, Ctrl-C) used to write nothing, and every phase
measured before was lost. Here the file is rewritten whole after each result (through a temporary
file and a rename, so a reader never sees half a file), and a run that stops says how many results
it kept and where.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Generic, TypeVar

import msgspec

__all__ = ["ResultsFile"]

T = TypeVar("T")


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
            print(f"{what} stopped early: {kept}", file=sys.stderr, flush=True)
            raise
