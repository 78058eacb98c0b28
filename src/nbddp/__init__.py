"""nbddp: distributed PyTorch from a notebook.

``%load_ext nbddp``, then ``%%ddp -n 4`` runs a cell on 4 ranks of one
torch.distributed process group that persist across cells.
"""

from __future__ import annotations

from .api import in_torchddp, ranch
from .collectives import all_to_all, gather_objects, gather_tensors
from .ddp import DDPContext
from .errors import (
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
from .metrics import log_metrics
from .pool import Pool, RankStatus
from .rich import progress
from .workspace import Workspace

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
    from .magics import load

    load(ipython)


def unload_ipython_extension(ipython) -> None:
    from .magics import unload

    unload(ipython)
