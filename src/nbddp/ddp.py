"""DDPContext: the process group and device of one rank.

The worker uses it to join its pool's group; a script run under ``torchrun``
can use it on its own::

    with DDPContext() as ddp:          # reads RANK, WORLD_SIZE, MASTER_ADDR, ... (env://)
        model = DDP(model.to(ddp.device))
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["DDPContext", "default_backend"]


def default_backend() -> str:
    """nccl when this process sees a CUDA device, else gloo."""
    return "nccl" if torch.cuda.is_available() else "gloo"


class DDPContext:
    """Sets up the default process group and this rank's device; tears them down on exit.

    Without ``store`` the group is formed from torchrun's environment
    (``env://``). With a ``store`` (a ``TCPStore``), ``rank`` and ``world_size``
    must be given. On CUDA the current device becomes ``cuda:LOCAL_RANK``.
    """

    def __init__(
        self,
        backend: str | None = None,
        *,
        store: dist.Store | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        timeout: float | None = None,
    ) -> None:
        self.backend = backend or default_backend()
        self.store = store
        self.rank = int(os.environ.get("RANK", 0)) if rank is None else rank
        self.world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.timeout = timeout
        self.device = self._pick_device()

    def _pick_device(self) -> torch.device:
        if self.backend == "nccl":
            return torch.device("cuda", self.local_rank)
        return torch.device("cpu")

    def __enter__(self) -> DDPContext:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        kwargs = {} if self.timeout is None else {"timeout": timedelta(seconds=self.timeout)}
        if self.store is not None:
            kwargs.update(store=self.store, rank=self.rank, world_size=self.world_size)
        else:
            kwargs.update(init_method="env://")
        if not dist.is_initialized():
            dist.init_process_group(self.backend, **kwargs)
        return self

    def __exit__(self, *exc: object) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
