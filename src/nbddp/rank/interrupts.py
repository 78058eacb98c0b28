"""A cell's interrupts on a rank: which cell one is for (:class:`CellInterrupts`), and the
SIGINT that raises KeyboardInterrupt in the main thread (:class:`MainSigint`)."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable

__all__ = ["RESEND_EVERY", "CellInterrupts", "MainSigint"]

RESEND_EVERY = 0.05  # s a SIGINT may go unhandled before it is sent again (for 2 s at most)


class CellInterrupts:
    """Which cell an interrupt is for, in whatever order Run, Interrupt and the cell's end
    come: the receiver thread calls :meth:`request`, the main thread :meth:`start` and
    :meth:`end`. An interrupt for a cell not started yet waits for it; one for a cell
    that has ended is dropped."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.running: int | None = None  # the cell the main thread runs
        self.ended = 0  # the newest cell that has ended here
        self.pending: int | None = None  # an interrupt for a cell still to come

    def request(self, cell: int) -> bool:
        """True: the main thread runs ``cell`` now; interrupt it."""
        with self._lock:
            if cell == self.running:
                return True
            if cell > self.ended:
                self.pending = max(self.pending or 0, cell)
            return False

    def start(self, cell: int) -> bool:
        """The main thread starts ``cell``; True when it was interrupted already."""
        with self._lock:
            self.running = cell
            hit = self.pending == cell
            if self.pending is not None and self.pending <= cell:
                self.pending = None
            return hit

    def end(self, cell: int) -> None:
        with self._lock:
            self.running = None
            self.ended = max(self.ended, cell)


class MainSigint:
    """SIGINT to the main thread, sent again until its handler has run.

    CPython runs a signal's handler between bytecodes; a blocking C call (``time.sleep``,
    a lock, a socket) wakes for a signal that arrives while it waits, not for one that
    arrived just before it began. Such a SIGINT was lost: the cell slept on, and the rank
    was stopped with the pool after the grace period (3 of 15 interrupts sent right after
    ``run()`` at 8 ranks). So it is sent again, every RESEND_EVERY s, while ``wanted()``
    holds and the handler (which counts in :attr:`handled`) has not run since.
    """

    def __init__(self) -> None:
        self.handled = 0  # SIGINTs the main thread's handler has run for

    def send(self, wanted: Callable[[], bool]) -> None:
        seen = self.handled
        _to_main()
        threading.Thread(
            target=self._again, args=(seen, wanted), daemon=True, name="nbddp-sigint"
        ).start()

    def _again(self, seen: int, wanted: Callable[[], bool]) -> None:
        for _ in range(int(2.0 / RESEND_EVERY)):
            time.sleep(RESEND_EVERY)
            if self.handled != seen or not wanted():
                return
            _to_main()


def _to_main() -> None:
    """SIGINT to the main thread itself (one to the process may go to another thread)."""
    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
