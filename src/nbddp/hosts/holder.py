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
replace takes no new one). A rank that dies with the holder is killed with it
(the parent-death signal), and torchrun's SIGTERM is passed on to the rank.
``NBDDP_HOLD=0`` in the environment turns the holder off (the rank is torchrun's
worker itself, as before: a death stops the pool).
"""

from __future__ import annotations

import ctypes
import os
import signal
from collections.abc import Callable

__all__ = ["FINAL", "hold", "wanted"]

FINAL = frozenset({0, 2, 3, 4})  # a rank's exit codes that end its holder too
_PR_SET_PDEATHSIG = 1


def wanted(tcp: bool, env) -> bool:
    """Ranks torchrun started that attach over TCP are held (NBDDP_HOLD=0: not)."""
    return tcp and "TORCHELASTIC_RUN_ID" in env and env.get("NBDDP_HOLD", "1") != "0"


def hold(run: Callable[[bool], int]) -> int:
    """Fork ``run(renewed)`` as the rank, again each time it dies (``renewed``: it takes a
    dead rank's place); the code of the last one, once it ended by the pool's word."""
    child = 0

    def pass_on(signum, _frame) -> None:
        if child:
            os.kill(child, signal.SIGKILL)
        os._exit(128 + signum)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, pass_on)
    renewed = False
    while True:
        child = os.fork()
        if child == 0:  # pragma: no cover - the rank; tests see it through the pool
            os._exit(_rank(run, renewed))
        code = os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])
        if code in FINAL:
            return code
        renewed = True


def _rank(run: Callable[[bool], int], renewed: bool) -> int:  # pragma: no cover - forked
    code = 1
    try:
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # dies with the holder
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, signal.SIG_DFL)
        code = run(renewed)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    return code
