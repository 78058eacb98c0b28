"""Helpers for use inside ``%%ddp`` cells (or any torch.distributed program)."""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist

from ..wire.payload import private_dir, shm_dir
from .workspace import new_folder, read_bundle, remove_bundle, write_bundle

__all__ = ["all_to_all", "gather_objects", "gather_tensors"]


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


def _plan(ranks, group) -> tuple[int, list[int], list[int]]:
    """(this rank, the group's ranks, the listed ranks in their order): one-line errors for
    a list that is empty, repeats a rank, or names one outside the group."""
    me = dist.get_rank()
    members = list(range(dist.get_world_size())) if group is None else _members(group)
    if me not in members:
        raise ValueError(f"rank {me} is not in the group (ranks {members}): only they call")
    listed = list(members) if ranks is None else [int(r) for r in ranks]
    if not listed:
        raise ValueError("ranks is empty: list at least one rank")
    for i, r in enumerate(listed):
        if r not in members:
            raise ValueError(f"rank {r} is not in the group (ranks {members})")
        if r in listed[:i]:
            raise ValueError(f"rank {r} is listed twice")
    return me, members, listed


def _members(group: dist.ProcessGroup) -> list[int]:
    return list(dist.get_process_group_ranks(group))


def _one_host() -> bool:
    return int(os.environ.get("LOCAL_WORLD_SIZE", -1)) == dist.get_world_size()


def _new_folder(workspace) -> str:
    """A new private folder for this rank's object: in the workspace; else in the pool's
    own shared-memory folder (removed with the pool); else (torchrun, no pool) on tmpfs,
    locked while this process lives (swept if it dies before the first rank removes it)."""
    if workspace is not None:
        return new_folder(workspace, "gather")
    pool_dir = os.environ.get("NBDDP_SHM_DIR")
    if pool_dir:
        return tempfile.mkdtemp(prefix="gather-", dir=private_dir(pool_dir))
    return shm_dir()


def _through_folders(obj, me, members, ranks, group, workspace) -> list:
    """Each listed rank but the first writes ``obj`` once to a new folder; the folders'
    names are gathered (the only collective, and the barrier); the first rank reads them
    in the order listed, then removes them. A rank that cannot write says why in its
    place, so every rank raises (none waits in a collective the others left)."""
    dst = ranks[0]
    mine, failed = None, None
    if me in ranks and me != dst:
        try:
            mine = _new_folder(workspace)
            write_bundle(obj, mine, shared=workspace is not None)
        except Exception as exc:  # (a refused workspace, an object that does not pickle)
            if mine is not None:
                remove_bundle(mine)
            mine, failed = f"{type(exc).__name__}: {exc}".splitlines()[0], exc
    names = [None] * len(members) if me == dst else None
    dist.gather_object((mine, failed is not None), names, dst=dst, group=group)
    if failed is not None:
        raise failed
    if me != dst:
        return []
    sent = dict(zip(members, names, strict=True))
    try:
        for r, (what, bad) in sent.items():
            if bad:
                raise RuntimeError(f"rank {r} could not write its object: {what}")
        return [obj if r == dst else read_bundle(sent[r][0]) for r in ranks]
    finally:
        for what, bad in sent.values():
            if isinstance(what, str) and not bad:
                remove_bundle(what)


def _by_rank(everything, members, ranks, me, obj) -> list:
    if me != ranks[0]:
        return []
    got = dict(zip(members, everything, strict=True))
    return [obj if r == me else got[r] for r in ranks]


def gather_objects(
    obj: object,
    ranks: list[int] | None = None,
    group: dist.ProcessGroup | None = None,
    workspace: str | os.PathLike | None = None,
) -> list:
    """Gather any picklable objects of ``ranks`` (the group's, by default) to the first
    rank listed: it gets the list, in the order listed (its own object as it is); the
    others get ``[]``. Every rank of ``group`` (of the world, by default) calls it.

    With ``workspace`` (a folder every host mounts at that path), each object is written
    there once, big tensors as files, and read by the first rank; without it, through
    shared memory when the ranks share one host, else through the process group.
    """
    me, members, ranks = _plan(ranks, group)
    if len(ranks) == 1:
        return [obj] if me == ranks[0] else []
    if workspace is None and not _one_host():
        everything = [None] * len(members) if me == ranks[0] else None
        dist.gather_object(obj if me in ranks else None, everything, dst=ranks[0], group=group)
        return _by_rank(everything, members, ranks, me, obj)
    return _through_folders(obj, me, members, ranks, group, workspace)


def gather_tensors(
    t: torch.Tensor,
    ranks: list[int] | None = None,
    group: dist.ProcessGroup | None = None,
    workspace: str | os.PathLike | None = None,
) -> list[torch.Tensor]:
    """Gather same-shaped tensors of ``ranks`` (the group's, by default) to the first rank
    listed: it gets the list, in the order listed; the others get ``[]``.

    Every rank of ``group`` (of the world, by default) calls it. With ``workspace``,
    through that folder (see :func:`gather_objects`); CPU tensors of ranks on one host
    through shared memory (one write and one mapping each); otherwise through the
    process group (``dist.gather``).
    """
    me, members, ranks = _plan(ranks, group)
    if len(ranks) == 1:
        return [t] if me == ranks[0] else []
    if workspace is None and (not _one_host() or t.device.type != "cpu"):
        everything = [torch.empty_like(t) for _ in members] if me == ranks[0] else None
        dist.gather(t.contiguous(), everything, dst=ranks[0], group=group)
        return _by_rank(everything, members, ranks, me, t)
    return _through_folders(t, me, members, ranks, group, workspace)
