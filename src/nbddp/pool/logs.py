"""``--log-dir``: every rank's output and errors in files, written as they arrive.

Folders are made 0700 and files 0600 (:mod:`nbddp.wire.private`); a rank's folder must
be a private folder of this user, and no file is opened through a symlink. A log
that cannot be written (refused, disk full) is said once in the cell's notes and
skipped from then on; the cell and the ranks' state go on.
"""

from __future__ import annotations

import json
import os
import time

from ..wire import protocol as P
from ..wire.private import append_private, make_folder, private_folder, write_private

__all__ = ["LogDir"]


class LogDir:
    """``DIR/{rank}/{stream}.log`` and ``DIR/{rank}/error.json``."""

    def __init__(self, path: str, note=None) -> None:
        self.path = path
        self._files: dict[tuple[int, str], object] = {}  # (rank, stream) -> open log file
        self._note = note or (lambda line: None)  # says a log that cannot be written, once
        self._failed: set[tuple[int, str]] = set()

    def _folder(self, rank: int) -> str:
        return private_folder(os.path.join(make_folder(self.path), str(rank)))

    def text(self, rank: int, stream: str, text: str) -> None:
        key = (rank, stream)
        if key in self._failed:
            return
        try:
            if key not in self._files:
                path = os.path.join(self._folder(rank), f"{stream}.log")
                self._files[key] = append_private(path)
            self._files[key].write(text)
        except OSError as exc:
            self._fail(key, f"{stream}.log", exc)

    def _fail(self, key: tuple[int, str], name: str, exc: OSError) -> None:
        self._failed.add(key)
        self._note(f"--log-dir: rank {key[0]}'s {name} is not written: {exc}")

    def error(self, rank: int, pid: int, error: P.ErrorInfo) -> None:
        """A rank whose cell failed."""
        record = {
            "rank": rank,
            "pid": pid,
            "exc_type": error.exc_type,
            "message": error.message,
            "traceback": error.traceback,
            "timestamp": time.time(),
        }
        try:
            path = os.path.join(self._folder(rank), "error.json")
            write_private(path, json.dumps(record, indent=2).encode())
        except OSError as exc:
            if (rank, "error") not in self._failed:
                self._fail((rank, "error"), "error.json", exc)

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()
