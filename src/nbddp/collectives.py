"""Helpers for use inside ``%%ddp`` cells (or any torch.distributed program)."""

from __future__ import annotations

import itertools
import os
import shutil

import torch
import torch.distributed as dist

from .payload import _write, private_dir, shm_dir

__all__ = ["all_to_all", "gather_tensors"]

_calls = itertools.count()  # every rank calls gather_tensors in the same order


def all_to_all(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Split ``tensor`` along dim 0 into one chunk per rank; chunk i goes to rank i.

    Returns the chunks this rank received, concatenated in rank order.
    """
    world = dist.get_world_size(group)
    if tensor.shape[0] % world:
        raise ValueError(f"dim 0 ({tensor.shape[0]}) does not split into {world} equal chunks")
    out = torch.empty_like(tensor)
    dist.all_to_all_single(out, tensor.contiguous(), group=group)
    return out


def _gather_folder(me: int, dst: int) -> str:
    """Where this call's tensors go: inside the pool's own shared-memory folder (removed
    with the pool, swept if the notebook died); under torchrun without a pool, a private
    folder the lowest rank makes (swept if it dies) and names to the others."""
    n = next(_calls)
    pool_dir = os.environ.get("NBDDP_SHM_DIR")
    if pool_dir:
        folder = os.path.join(private_dir(pool_dir), f"gather-{n}")
        os.makedirs(folder, mode=0o700, exist_ok=True)  # in a folder only we can enter
        return folder
    box = [shm_dir() if me == dst else None]
    dist.broadcast_object_list(box, src=dst)
    return box[0]


def gather_tensors(t: torch.Tensor, ranks: list[int] | None = None) -> list[torch.Tensor]:
    """Gather same-shaped tensors from ``ranks`` (all by default) to the lowest of them.

    Every rank must call it. The lowest rank gets the list (in rank order),
    the others an empty list. When every rank is on this host, the tensors
    travel through shared memory (one write and one mapping each); otherwise
    through the process group.
    """
    world, me = dist.get_world_size(), dist.get_rank()
    ranks = sorted(range(world) if ranks is None else set(ranks))
    dst = ranks[0]
    if int(os.environ.get("LOCAL_WORLD_SIZE", -1)) != world or t.device.type != "cpu":
        everything = [torch.empty_like(t) for _ in range(world)] if me == dst else None
        dist.gather(t.contiguous(), everything, dst=dst)
        return [everything[r] for r in ranks] if me == dst else []
    folder = _gather_folder(me, dst)
    if me in ranks:
        _write(os.path.join(folder, str(me)), t)
    dist.barrier()
    if me != dst:
        return []
    out = [
        torch.from_file(
            os.path.join(folder, str(r)), shared=False, size=t.numel(), dtype=t.dtype
        ).reshape(t.shape)
        for r in ranks
    ]
    shutil.rmtree(folder, ignore_errors=True)
    return out
