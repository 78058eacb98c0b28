"""Ctrl-C and the stop button while a cell runs: an interrupt request, not an exception.

A front end (the magics, ``ranch``, :meth:`nbddp.Pool.execute`) drives a cell's
events inside :func:`interrupts_cell`, so that SIGINT asks the pool to interrupt
the ranks instead of raising KeyboardInterrupt wherever the notebook happens to
be (a half-handled message, a half-sent Run). If the pool itself does not answer
(the cell still runs the grace period + 5 s after an interrupt), the next Ctrl-C
raises KeyboardInterrupt as usual. Outside the main thread nothing is installed
(signals reach only the main thread).
"""

from __future__ import annotations

import contextlib
import signal
import threading

__all__ = ["interrupts_cell"]


@contextlib.contextmanager
def interrupts_cell(pool):
    """Inside, SIGINT calls ``pool.interrupt()`` (see the module's docstring)."""
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.getsignal(signal.SIGINT)

    def on_sigint(_signum, _frame) -> None:
        if pool.interrupt_stuck():
            raise KeyboardInterrupt
        pool.interrupt()

    if previous is not None:  # (None: a handler not set from Python: left alone)
        signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
