"""Sinks: where a cell's events are shown. A sink renders; it never steers the pool.

``TextSink`` prints each line as ``[rank N] line`` as it arrives (terminal
IPython, ``--text``), or nothing unless a rank fails (``--quiet``). Output is
bounded per rank: past ``head`` lines only the last ``tail`` are kept, and the
number dropped is said.
"""

from __future__ import annotations

import sys
from collections import deque
from typing import Protocol, TextIO

from . import protocol as P

__all__ = ["Sink", "TextSink"]


class Sink(Protocol):
    def handle(self, event: object) -> None: ...

    def close(self, end: P.CellEnd | None) -> None: ...


class _RankLog:
    """One rank's lines in one cell: the first ``head`` shown live, then a bounded tail."""

    def __init__(self, head: int, tail: int) -> None:
        self.partial = {"stdout": "", "stderr": ""}
        self.shown = 0
        self.head = head
        self.tail: deque[tuple[str, str]] = deque(maxlen=tail)
        self.total = 0


class TextSink:
    """Lines as ``[rank N] text``, live; bounded; ``quiet`` holds them back unless a rank fails."""

    def __init__(
        self,
        *,
        quiet: bool = False,
        head: int = 5000,
        tail: int = 1000,
        stdout: TextIO | None = None,
        stderr: TextIO | None = None,
    ) -> None:
        self.quiet = quiet
        self._head, self._tail = (0, head + tail) if quiet else (head, tail)
        self._out = stdout
        self._err = stderr
        self._logs: dict[int, _RankLog] = {}

    def _stream(self, name: str) -> TextIO:
        if name == "stderr":
            return self._err or sys.stderr
        return self._out or sys.stdout

    def _log(self, rank: int) -> _RankLog:
        if rank not in self._logs:
            self._logs[rank] = _RankLog(self._head, self._tail)
        return self._logs[rank]

    def handle(self, event: object) -> None:
        if isinstance(event, P.Output):
            self._text(event.rank, event.stream, event.text)
        elif isinstance(event, P.RankResult) and event.value_repr is not None and not self.quiet:
            self._flush_partial(event.rank)
            lines = event.value_repr.splitlines() or [""]
            self._stream("stdout").write(
                "".join(
                    f"[rank {event.rank}] {'Out: ' if i == 0 else '     '}{line}\n"
                    for i, line in enumerate(lines)
                )
            )

    def _text(self, rank: int, stream: str, text: str) -> None:
        log = self._log(rank)
        *lines, log.partial[stream] = (log.partial[stream] + text).split("\n")
        for line in lines:
            self._line(rank, log, stream, line)

    def _line(self, rank: int, log: _RankLog, stream: str, line: str) -> None:
        if "\r" in line:  # a progress bar: its last state is the line
            line = line.rstrip("\r").rsplit("\r", 1)[-1]
        log.total += 1
        if log.shown < log.head:
            log.shown += 1
            self._stream(stream).write(f"[rank {rank}] {line}\n")
        else:
            log.tail.append((stream, line))

    def _flush_partial(self, rank: int) -> None:
        log = self._log(rank)
        for stream, rest in log.partial.items():
            if rest:
                log.partial[stream] = ""
                self._line(rank, log, stream, rest)

    def close(self, end: P.CellEnd | None) -> None:
        failed = set() if end is None else set(end.errors) | set(end.exits)
        for rank in sorted(self._logs):
            self._flush_partial(rank)
            log = self._logs[rank]
            if self.quiet and rank not in failed:
                continue
            dropped = log.total - log.shown - len(log.tail)
            if dropped:
                self._stream("stderr").write(f"[rank {rank}] ... {dropped} lines not shown ...\n")
            for stream, line in log.tail:
                self._stream(stream).write(f"[rank {rank}] {line}\n")
            log.tail.clear()
        for out in (self._stream("stdout"), self._stream("stderr")):
            out.flush()
