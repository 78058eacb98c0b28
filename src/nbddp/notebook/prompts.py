"""What the notebook says around a cell's events: a rank's pdb asking in the input box,
and hints when a failure looks like a framework's own launcher."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading

from IPython.core.error import StdinNotImplementedError

from ..wire import protocol as P

__all__ = ["debug_prompt", "launcher_hints"]


def debug_prompt(event: P.RankDebug) -> str | None:
    """A rank's pdb wants a line: show what it said, ask in the input box, return the line.

    None when there is no input box (nbclient, papermill) or it was closed: that
    rank's session ends, nothing waits for a line that cannot come. The stop button
    raises KeyboardInterrupt here (the driver passes it on to the ranks).
    """
    if event.output:
        sys.stdout.write(event.output if event.output.endswith("\n") else event.output + "\n")
        sys.stdout.flush()
    try:
        with _ctrl_c_raises():  # (during a cell the pool turns Ctrl-C into a request)
            return input(event.prompt)
    except StdinNotImplementedError:
        print(
            f"nbddp: rank {event.rank} stopped in pdb, but this front end has no input box "
            "(stdin): its debugger was closed"
        )
    except EOFError:
        pass
    return None


@contextlib.contextmanager
def _ctrl_c_raises():
    """Ctrl-C (the stop button) raises KeyboardInterrupt inside: what ends an input() that
    waits for a line (the pool's own handler only asks the ranks to stop)."""
    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGINT) if main else None
    if previous is not None:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


# Frameworks that start processes of their own inside a rank fail obscurely; say why.
LAUNCHER_HINTS = (
    (
        ("notebook_launcher",),
        "accelerate's notebook_launcher starts processes of its own, but in %%ddp the ranks "
        "already run: call the training function directly in the cell, or run "
        "nbddp.ranch(N, fn, *args) from the notebook",
    ),
    (
        ("ddp_notebook", "ddp_spawn", "To spawn processes with the `DDPStrategy`"),
        "Lightning's spawning strategies (ddp_spawn, ddp_notebook) start processes of their "
        'own: use strategy="ddp" in %%ddp, which attaches to the running ranks',
    ),
    (
        ("torch.multiprocessing.spawn", "mp.spawn("),
        "torch.multiprocessing.spawn starts processes of its own: in %%ddp, run the function "
        "on every rank directly",
    ),
)


def launcher_hints(end: P.CellEnd) -> list[str]:
    """One line for each framework launcher found in the failed ranks' tracebacks."""
    text = "\n".join(e.traceback + e.message for e in end.errors.values())
    return [hint for needles, hint in LAUNCHER_HINTS if any(n in text for n in needles)]
