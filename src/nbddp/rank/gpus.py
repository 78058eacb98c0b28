"""Which GPU each rank on a host uses, and which backend the group uses: decided once.

The notebook decides it for a local pool before any rank starts (:func:`pool_plan`)
and passes it in each rank's environment (``NBDDP_BACKEND``, ``NBDDP_GPU``,
``CUDA_VISIBLE_DEVICES``); :class:`~nbddp.rank.ddp.DDPContext` decides it the same way
for itself under torchrun. More ranks on a host than GPUs share them round-robin
(rank ``r`` on ``cuda:r % G``) over gloo, since NCCL refuses two ranks on one GPU
(ncclInvalidUsage; NVIDIA/nccl#418); ``--gpus 0,0,1,1`` asks for a sharing by hand.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

__all__ = ["GpuPlan", "devices_line", "gpu_notes", "plan", "pool_plan", "visible_gpus"]


@dataclass(frozen=True)
class GpuPlan:
    """The group's backend and each local rank's CUDA device (``cuda:<gpu>``)."""

    backend: str  # "nccl" or "gloo"
    gpus: tuple[int, ...] = ()  # local rank -> CUDA index as the rank sees it; () not CUDA
    visible: str | None = None  # CUDA_VISIBLE_DEVICES for the ranks (None: as it is)
    note: str = ""  # the one line said when the pool starts ("" when nothing to say)

    def gpu(self, local_rank: int) -> int | None:
        """The CUDA index of ``local_rank`` (None: the rank is not on CUDA)."""
        if not self.gpus:
            return None
        return self.gpus[local_rank % len(self.gpus)]

    @property
    def shared(self) -> bool:
        """More than one rank on one GPU."""
        return len(set(self.gpus)) < len(self.gpus)


def visible_gpus() -> int:
    """How many CUDA GPUs this process sees (0: none), without initialising CUDA."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def on_cuda(backend: str | None, device: str | None, count: int) -> bool:
    """The ranks use CUDA: ``--device gpu``, ``--backend nccl``, or, with neither
    ``--device`` nor ``--backend`` given, wherever a GPU is visible (an explicit
    ``--backend gloo`` alone keeps the ranks on the CPU, as before)."""
    if device is not None:
        return device == "gpu"
    return backend == "nccl" or (backend is None and count > 0)


def plan(
    n: int,
    *,
    backend: str | None = None,
    device: str | None = None,
    gpus: list[int] | None = None,
    count: int = 0,
) -> GpuPlan:
    """``n`` ranks on one host with ``count`` visible GPUs (``gpus``: those named, in rank
    order, repeats allowed): round-robin on CUDA; nccl only where each rank has its own
    GPU and no backend was asked for."""
    if not on_cuda(backend, device, count):
        return GpuPlan(backend or "gloo")
    visible = None
    if gpus is not None:
        distinct = list(dict.fromkeys(gpus[:n]))
        visible = ",".join(map(str, distinct))
        index = tuple(distinct.index(g) for g in gpus[:n])
    else:
        index = tuple(r % count for r in range(n)) if count else tuple(range(n))
    shared = len(set(index)) < len(index)
    chosen = backend or ("gloo" if shared else "nccl")
    note = sharing_line(n, len(set(index)), asked=backend is not None) if shared else ""
    return GpuPlan(chosen, index, visible, note)


def sharing_line(n: int, gpus: int, asked: bool) -> str:
    """``4 ranks share 1 GPU: gloo, since NCCL needs a GPU per rank``."""
    head = f"{n} ranks share {gpus} GPU{'s' * (gpus != 1)}"
    return f"{head} (gloo)" if asked else f"{head}: gloo, since NCCL needs a GPU per rank"


def pool_plan(pool) -> GpuPlan | None:
    """The plan of a local pool at its present size (None: ranks started elsewhere)."""
    if pool.attached:
        return None
    return plan(
        pool.world_size,
        backend=pool.backend,
        device=pool.device,
        gpus=pool.gpus,
        count=visible_gpus(),
    )


def gpu_notes(pool) -> list[str]:
    """The one line a local pool whose ranks share GPUs says when it starts (or is
    resized to share them); [] otherwise."""
    chosen = pool_plan(pool)
    return [chosen.note] if chosen is not None and chosen.note else []


def devices_line(devices: list[str]) -> str:
    """The dashboard header's devices: ``cpu``, ``cuda:0 x4``, ``cuda:0 x2, cuda:1 x2``,
    ``4 devices``, or ``8 devices, 2 ranks each``."""
    counts = Counter(d for d in devices if d)
    if len(counts) <= 2:
        shown = sorted(counts.items())
        return ", ".join(d if k == 1 or d == "cpu" else f"{d} x{k}" for d, k in shown)
    each = set(counts.values())
    if len(each) == 1 and next(iter(each)) > 1:
        return f"{len(counts)} devices, {next(iter(each))} ranks each"
    return f"{len(counts)} devices"
