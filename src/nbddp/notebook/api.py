"""The function API on the same pool as the magics (mpify's ``ranch`` and friends).

>>> import nbddp
>>> nbddp.ranch(2, lambda x: x * 10, 3)                 # on ranks 0 and 1
[30, 30]
>>> nbddp.in_torchddp(2, train, model, epochs=3)        # rank 0's result
"""

from __future__ import annotations

import sys

from ..dashboard.metric_store import CellMetrics
from ..dashboard.view import TextSink
from ..pool import capture
from ..pool.drive import drive
from ..pool.facade import raise_for_end
from ..wire import protocol as P
from .session import SESSION

__all__ = ["in_torchddp", "ranch"]

CALL = """\
try:
    if __nbddp_ctx is None:
        __nbddp_out = __nbddp_fn(*__nbddp_args, **__nbddp_kwargs)
    else:
        with __nbddp_ctx:
            __nbddp_out = __nbddp_fn(*__nbddp_args, **__nbddp_kwargs)
finally:
    del __nbddp_fn, __nbddp_args, __nbddp_kwargs, __nbddp_ctx
__nbddp_out"""


def ranch(
    nprocs: int,
    fn,
    *args,
    need: str = "",
    imports: str = "",
    ctx=None,
    gather: bool = True,
    caller_rank: int = 0,
    **kwargs,
):
    """Run ``fn(*args, **kwargs)`` on ``nprocs`` ranks of the pool.

    ``need``: names from the caller's globals to bind on the ranks ("a b" or
    "a,b"); ``imports``: import statements run there first (several lines,
    ``from a import (b, c)`` too); ``ctx``: a context manager entered around
    the call on every rank. Returns the results by rank (``gather=True``) or
    rank ``caller_rank``'s. Output is printed as ``[rank N] line``; rank
    errors raise :class:`~nbddp.CellFailed`.
    """
    if not 0 <= caller_rank < nprocs:
        raise ValueError(f"caller_rank {caller_rank} is not a rank of {nprocs}")
    caller = sys._getframe(1).f_globals
    objects = capture.collect(capture.split_names(need), caller)
    objects.update(__nbddp_fn=fn, __nbddp_args=args, __nbddp_kwargs=kwargs, __nbddp_ctx=ctx)
    imports = capture.check_imports(imports)
    pool = SESSION.want_pool(nprocs)  # the magics' pool, started or resized
    needs = capture.pack(objects, pool.shm_folder)
    events = pool.run(CALL, needs=needs, imports=imports, want_values=True)
    # no prompt: a rank's pdb is closed at once, never waited for (no input box here)
    metrics = CellMetrics(SESSION.metrics, _label())  # log_metrics: for %ddp metrics too
    end = drive(pool, events, TextSink(metrics=metrics), shown=_not_a_value)
    raise_for_end(end, pool.hosts)
    values = [end.values.get(r) for r in range(nprocs)]
    return values if gather else values[caller_rank]


def _label() -> str:
    """The run of a call's own metrics: its cell's ``In [N]`` in IPython."""
    shell = sys.modules.get("IPython") and sys.modules["IPython"].get_ipython()
    return f"In [{shell.execution_count}]" if shell else "ranch"


def _not_a_value(event: object) -> bool:
    return not isinstance(event, P.RankResult)  # (the values are returned, not printed)


def in_torchddp(nprocs: int, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` on ``nprocs`` ranks; rank 0's result."""
    return ranch(nprocs, fn, *args, gather=False, caller_rank=0, **kwargs)
