"""nbddp: distributed PyTorch from a notebook.

``%load_ext nbddp``, then ``%%ddp -n 4`` runs a cell on 4 ranks of one
torch.distributed process group that persist across cells.
"""

from __future__ import annotations

from .detached.client import connect as connect_detached
from .notebook.api import in_torchddp, ranch
from .pool.errors import (
    CaptureError,
    CellDeadlocked,
    CellFailed,
    CellInterrupted,
    NbddpError,
    PoolClosedError,
    PoolStartError,
    RankDied,
    RankFailed,
)
from .pool.facade import Pool, RankStatus
from .rank.collectives import all_to_all, gather_objects, gather_tensors
from .rank.ddp import DDPContext
from .rank.metrics import log_metrics
from .rank.rich import progress
from .rank.workspace import Workspace

# ``nbddp.Pool.connect(NAME)``: the detached pool NAME, as it was (docs/detached.md).
# Given here, above both: the pool core knows no detached pools, they are built on it.
Pool.connect = staticmethod(connect_detached)  # type: ignore[attr-defined]

__version__ = "0.1.0"

__all__ = [
    "CaptureError",
    "CellDeadlocked",
    "CellFailed",
    "CellInterrupted",
    "DDPContext",
    "NbddpError",
    "Pool",
    "PoolClosedError",
    "PoolStartError",
    "RankDied",
    "RankFailed",
    "RankStatus",
    "Workspace",
    "__version__",
    "all_to_all",
    "gather_objects",
    "gather_tensors",
    "in_torchddp",
    "load_ipython_extension",
    "log_metrics",
    "progress",
    "ranch",
    "unload_ipython_extension",
]


def load_ipython_extension(ipython) -> None:
    from .notebook.magics import load

    load(ipython)


def unload_ipython_extension(ipython) -> None:
    from .notebook.magics import unload

    unload(ipython)
