"""What torchrun starts for a rank of an attached pool: a holder that forks the rank.

torchrun's agent ends every worker of its node when one exits (and, with
``--max-restarts``, starts them all again): the survivors' state would be lost
with the one that died. So under torchrun, ``python -m nbddp.worker`` (the same
command) is a holder: it has imported torch once, and it forks the rank. When the
rank dies, the holder forks a new one at once, which connects and waits until the
notebook takes it in the dead one's place (the group re-formed with it, every
other rank keeping its namespace, as on a local pool). torchrun sees its worker
live on, so it tears nothing down.

The holder ends when its rank ended by the pool's word: stopped (0), could not
reach the notebook (2), refused (3, 4: a pool that lost a rank it could not
replace takes no new one). It ends with its launcher: torchrun starts it in a
session of its own, so a SIGKILL to torchrun's process group misses it, and
re-parented it would fork ranks for ever; the parent-death signal (set first,
then the launcher's pid checked, for a launcher that died before) ends it. And
it ends when MISSES ranks in a row were never taken into the pool (the notebook
is gone, whatever each one's exit said). A rank is killed with its holder (the
parent-death signal, its holder's pid checked the same way), and torchrun's
SIGTERM is passed on to the rank, through a pidfd: never a reaped pid's new owner.
``NBDDP_HOLD=0`` in the environment turns the holder off (the rank is torchrun's
worker itself, as before: a death stops the pool).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
from collections.abc import Callable

__all__ = ["FINAL", "MISSES", "hold", "taken_in", "wanted"]

FINAL = frozenset({0, 2, 3, 4})  # a rank's exit codes that end its holder too
MISSES = 3  # ranks in a row never taken into the pool: the notebook is gone
_PR_SET_PDEATHSIG = 1
_taken: int | None = None  # in a rank: the pipe that tells its holder it was taken in


def wanted(tcp: bool, env) -> bool:
    """Ranks torchrun started that attach over TCP are held (NBDDP_HOLD=0: not)."""
    return tcp and "TORCHELASTIC_RUN_ID" in env and env.get("NBDDP_HOLD", "1") != "0"


def taken_in() -> None:
    """The pool took this rank in (a rank calls it; a no-op where no holder forked it)."""
    global _taken
    if _taken is not None:
        with contextlib.suppress(OSError):
            os.write(_taken, b"1")
            os.close(_taken)
        _taken = None


def _die_with(parent: int, signum: int) -> None:
    """``signum`` when ``parent`` ends; at once if it has already (re-parented)."""
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signum)
    if os.getppid() != parent:
        os.kill(os.getpid(), signum)


def hold(run: Callable[[bool], int]) -> int:
    """Fork ``run(renewed)`` as the rank, again each time it dies (``renewed``: it takes a
    dead rank's place); the code of the last one, once it ended by the pool's word."""
    global _taken
    child, pidfd, launcher, me = 0, -1, os.getppid(), os.getpid()

    def pass_on(signum, _frame) -> None:
        with contextlib.suppress(OSError):
            if pidfd >= 0:
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            elif child:  # (no pidfds here)
                os.kill(child, signal.SIGKILL)
        os._exit(128 + signum)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, pass_on)
    _die_with(launcher, signal.SIGTERM)
    renewed, misses = False, 0
    while os.getppid() == launcher:
        told, _taken = os.pipe()
        child = os.fork()
        if child == 0:  # pragma: no cover - the rank; tests see it through the pool
            os.close(told)
            os._exit(_rank(run, renewed, me))
        os.close(_taken)
        _taken = None
        with contextlib.suppress(AttributeError, OSError):  # (not reaped before the waitpid)
            pidfd = os.pidfd_open(child)
        code = os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])
        child = 0
        if pidfd >= 0:
            os.close(pidfd)
            pidfd = -1
        os.set_blocking(told, False)  # (a process the rank forked may hold the pipe open)
        try:
            taken = os.read(told, 1) == b"1"
        except BlockingIOError:
            taken = False
        os.close(told)
        if code in FINAL:
            return code
        misses = 0 if taken else misses + 1
        if misses >= MISSES:
            print(
                f"nbddp.worker: {MISSES} ranks in a row were not taken into the pool: the "
                "notebook is gone; this worker ends",
                file=sys.stderr,
            )
            return 2
        renewed = True
    return 2  # the launcher is gone (its SIGTERM, if it came, ended us already)


def _rank(run: Callable[[bool], int], renewed: bool, holder: int) -> int:  # pragma: no cover
    code = 1
    try:
        _die_with(holder, signal.SIGKILL)  # dies with the holder
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, signal.SIG_DFL)
        code = run(renewed)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    return code
