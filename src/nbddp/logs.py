"""``--log-dir``: every rank's output and errors in files, written as they arrive."""

from __future__ import annotations

import json
import os
import time

from . import protocol as P

__all__ = ["LogDir"]


class LogDir:
    """``DIR/{rank}/{stream}.log`` and ``DIR/{rank}/error.json``."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._files: dict[tuple[int, str], object] = {}  # (rank, stream) -> open log file

    def _folder(self, rank: int) -> str:
        folder = os.path.join(self.path, str(rank))
        os.makedirs(folder, exist_ok=True)
        return folder

    def text(self, rank: int, stream: str, text: str) -> None:
        key = (rank, stream)
        if key not in self._files:
            path = os.path.join(self._folder(rank), f"{stream}.log")
            self._files[key] = open(path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115
        self._files[key].write(text)

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
        with open(os.path.join(self._folder(rank), "error.json"), "w") as f:
            json.dump(record, f, indent=2)

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()
