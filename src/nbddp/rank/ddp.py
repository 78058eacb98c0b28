"""DDPContext: the process group, device, seed, subgroups and mesh of one rank.

The worker uses it to join its pool's group; a script run under ``torchrun``
can use it on its own::

    with DDPContext(seed=0, mesh="dp=2,tp=2") as ddp:   # env:// from torchrun
        model = DDP(model.to(ddp.device))
        tp_group = ddp.mesh["tp"].get_group()
"""

from __future__ import annotations

import os
import random
from datetime import timedelta

import torch
import torch.distributed as dist

from .gpus import plan, visible_gpus

__all__ = [
    "DDPContext",
    "default_backend",
    "differences",
    "parse_groups",
    "parse_mesh",
    "seed_everything",
    "set_threads",
    "threads_for",
]

DEVICES = ("cpu", "gpu", "mps")


def default_backend(device: str | None = None, ranks: int = 1) -> str:
    """nccl when each of the host's ``ranks`` ranks has a CUDA GPU of its own, else gloo
    (ranks that share a GPU, or CPU ranks): :func:`nbddp.rank.gpus.plan`."""
    return plan(ranks, device=device, count=visible_gpus()).backend


def check_device(device: str | None) -> None:
    """A clear error when ``--device`` asks for hardware this machine lacks."""
    if device not in (None, *DEVICES):
        raise ValueError(f"unknown device {device!r} (choose cpu, gpu or mps)")
    if device == "gpu" and not torch.cuda.is_available():
        raise ValueError("--device gpu: no CUDA GPU is visible here")
    if device == "mps" and not (
        hasattr(torch.backends, "mps") and torch.backends.mps.is_available()
    ):
        raise ValueError("--device mps: Apple's Metal (MPS) is not available here")


def seed_everything(seed: int) -> None:
    """Seed Python's ``random``, numpy (if installed) and torch (CPU and CUDA)."""
    random.seed(seed)
    try:
        import numpy

        numpy.random.seed(seed)
    except ImportError:
        pass
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def parse_groups(text: str | None) -> list[list[int]]:
    """``"0,2;1,3"`` -> ``[[0, 2], [1, 3]]``."""
    if not text:
        return []
    groups = []
    for part in text.split(";"):
        try:
            groups.append([int(r) for r in part.split(",") if r.strip()])
        except ValueError:
            raise ValueError(f"groups look like '0,2;1,3', not {text!r}") from None
    return groups


def parse_mesh(text: str | None) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """``"dp=2,tp=2"`` -> ``(("dp", "tp"), (2, 2))``."""
    if not text:
        return (), ()
    names, sizes = [], []
    for part in text.split(","):
        name, _, size = part.partition("=")
        if not name.strip().isidentifier() or not size.strip().isdigit() or int(size) < 1:
            raise ValueError(f"a mesh looks like 'dp=2,tp=2', not {text!r}")
        names.append(name.strip())
        sizes.append(int(size))
    return tuple(names), tuple(sizes)


class DDPContext:
    """Sets up the default process group and this rank's device; tears them down on exit.

    Without ``store`` the group is formed from torchrun's environment
    (``env://``). With a ``store`` (a ``TCPStore``), ``rank`` and ``world_size``
    must be given. On CUDA the current device becomes ``cuda:<gpu>``: the one the pool
    chose (``gpu``), else ``cuda:LOCAL_RANK``, round-robin over the GPUs when the host
    has more ranks (``LOCAL_WORLD_SIZE``) than GPUs (then the default backend is gloo).
    ``seed`` seeds every generator; ``groups`` ("0,2;1,3") makes subgroups
    (``.group`` is this rank's); ``mesh`` ("dp=2,tp=2") makes a DeviceMesh.
    """

    def __init__(
        self,
        backend: str | None = None,
        *,
        store: dist.Store | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        timeout: float | None = None,
        device: str | None = None,
        seed: int | None = None,
        groups: str | None = None,
        mesh: str | None = None,
        gpu: int | None = None,
    ) -> None:
        check_device(device)
        self.device_kind = device
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        local = int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or self.local_rank + 1
        mine = plan(local, backend=backend, device=device, count=visible_gpus())
        self.backend = backend or mine.backend
        self.gpu = mine.gpu(self.local_rank) if gpu is None else gpu
        self.store = store
        self.rank = int(os.environ.get("RANK", 0)) if rank is None else rank
        self.world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
        self.timeout = timeout
        self.seed = seed
        self.group_spec, self.mesh_spec = groups, mesh
        self.device = self._pick_device()
        self.group: dist.ProcessGroup | None = None
        self.groups: list = []
        self.mesh = None

    def _pick_device(self) -> torch.device:
        if self.device_kind == "mps":
            return torch.device("mps")
        if self.gpu is not None:
            return torch.device("cuda", self.gpu)
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
        self.setup()
        return self

    def setup(self) -> None:
        """Seed, subgroups and mesh over the current default group (again after a re-form)."""
        if self.seed is not None:
            seed_everything(self.seed)
        self.groups = [dist.new_group(g) for g in parse_groups(self.group_spec)]
        mine = [
            g
            for g, ranks in zip(self.groups, parse_groups(self.group_spec), strict=True)
            if self.rank in ranks
        ]
        self.group = mine[0] if mine else None
        names, sizes = parse_mesh(self.mesh_spec)
        if names:
            from torch.distributed.device_mesh import init_device_mesh

            self.mesh = init_device_mesh(self.device.type, sizes, mesh_dim_names=names)

    def __exit__(self, *exc: object) -> None:
        # Dropped first: a DeviceMesh still alive after destroy_process_group takes the
        # process down at interpreter exit ("terminate called without an active
        # exception", torch 2.13): 5 of 25 torchrun runs of a DDPContext script on a busy
        # machine, 0 of 25 with the mesh dropped first. A mesh the script kept in a
        # variable of its own is its to drop.
        self.mesh, self.groups, self.group = None, [], None
        if dist.is_initialized():
            dist.destroy_process_group()


def differences(
    pool_backend: str,
    world_size: int,
    rank: int,
    device: torch.device,
    backend: str | None = None,
    world_size_asked: int | None = -1,
    rank_asked: int | None = -1,
    device_id: torch.device | int | None = None,
) -> list[str]:
    """How an ``init_process_group(...)`` call differs from the group a rank already has.

    Empty when the call is compatible, so a torchrun script can go on with the
    pool's group. ``backend`` may name one backend or map devices to backends
    (``"cpu:gloo,cuda:nccl"``); the init method, store and timeout do not matter.
    """
    found = []
    if backend:
        names = {part.rpartition(":")[2].strip().lower() for part in backend.split(",")}
        if pool_backend not in names and "undefined" not in names:
            found.append(f"backend {backend!r}, but the pool's group is {pool_backend}")
    if world_size_asked not in (None, -1) and world_size_asked != world_size:
        found.append(f"world_size={world_size_asked}, but the pool has {world_size} ranks")
    if rank_asked not in (None, -1) and rank_asked != rank:
        found.append(f"rank={rank_asked}, but this is rank {rank}")
    if device_id is not None:
        asked = torch.device("cuda", device_id) if isinstance(device_id, int) else device_id
        asked = torch.device(asked)
        if asked.index is None and asked.type == device.type:
            asked = device
        if asked != device:
            found.append(f"device_id={asked}, but this rank's device is {device}")
    return found


def threads_for(local_world_size: int, asked: str | None, user_omp: str | None) -> int | None:
    """Intra-op threads per rank, as torchrun sets them; None: leave torch's default.

    ``asked`` (``%ddp start --threads``): a number, or ``auto`` (the host's cores
    divided by its ranks). Else the user's own ``OMP_NUM_THREADS`` wins; else, as
    torchrun does, 1 when more than one rank shares the host.
    """
    if asked:
        if asked == "auto":
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
            return max(1, (cores or os.cpu_count() or 1) // max(1, local_world_size))
        return int(asked)
    if user_omp:  # the fork server read its own environment: apply the rank's
        return int(user_omp) if user_omp.strip().isdigit() else None
    return 1 if local_world_size > 1 else None


def set_threads(asked: str | None) -> int | None:
    """``%ddp start --threads`` on a running pool (:mod:`nbddp.pool.inplace` calls it on
    every rank): this rank's intra-op threads as ``asked`` now, and at a resize (the worker
    reads NBDDP_THREADS again). None: torchrun's default; what torch was left with is
    returned (None: left as torch had them)."""
    env = os.environ
    if asked:
        env["NBDDP_THREADS"] = str(asked)
    else:
        env.pop("NBDDP_THREADS", None)
    local = int(env.get("LOCAL_WORLD_SIZE") or env.get("WORLD_SIZE") or 1)
    n = threads_for(local, env.get("NBDDP_THREADS"), env.get("NBDDP_USER_OMP"))
    if n is not None:
        env["OMP_NUM_THREADS"] = str(n)
        torch.set_num_threads(n)
    return n
