"""``Pool.copy``: objects from one live rank's namespace to others (``%ddp copy``).

The source rank packs them once (:func:`nbddp.worker_copy.pack`: big tensors
written once to the pool's shared-memory folder, whatever the number of
destinations); the notebook passes the pickle on unopened, and each
destination binds them as it binds ``--need`` objects, tensors on its own
device. With a workspace (``%ddp start/attach --workspace DIR``, a folder every
host mounts) the big tensors go to a new folder there instead, which ranks on any
host read, and the source removes it once they have. So a new rank that took a dead
one's place is healed from a survivor:
``pool.copy(["model", "opt"], 0, [2])``. An object bound to the process group
(a DDP or FSDP wrapper, a DeviceMesh) is refused in one line that says what to
copy instead.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass

from . import payload
from .carriers import twin
from .drive import drive
from .errors import CaptureError, RankFailed
from .outcome import failures_of, owned_files, raise_for_end

__all__ = ["Copied", "copy"]


@dataclass(frozen=True)
class Copied:
    """What :func:`copy` did: for the line a front end says."""

    names: tuple[str, ...]
    src: int
    dst: tuple[int, ...]
    nbytes: int
    seconds: float
    via: str  # "through shared memory", "through the workspace DIR", or "in the message"
    notes: tuple[str, ...] = ()  # the pool's notes its two steps took (said once)


def copy(pool, names: list[str], src: int, dst: list[int] | None = None) -> Copied:
    """Bind ``names`` from rank ``src``'s namespace in every rank of ``dst`` (all others by
    default). CaptureError (one line) for a name the source lacks or cannot send."""
    t0 = time.monotonic()
    names = list(dict.fromkeys(names))
    bad = [n for n in names if not n.isidentifier()]
    if not names or bad:
        raise CaptureError(f"not a name: {bad[0]!r}" if bad else "name the objects to copy")
    n = pool.world_size
    targets = [r for r in range(n) if r != src] if dst is None else sorted(set(dst))
    for rank in [src, *targets]:
        if not 0 <= rank < n:
            raise CaptureError(f"no rank {rank} in a pool of {n}")
    if src in targets:
        raise CaptureError(f"rank {src} is the source: copy to the others")
    if not targets:
        raise CaptureError("no rank to copy to")
    workspace = pool.workspace
    code = f"__import__('nbddp.worker_copy', fromlist=['pack']).pack(globals(), {names!r}"
    end = drive(pool, pool.run(f"{code}, workspace={workspace!r})", ranks=[src], want_values=True))
    failures = failures_of(end, pool.hosts)
    if failures:  # the source refused (one line), or died
        first = failures[0]
        raise CaptureError(
            f"rank {src}: {first.message}" if isinstance(first, RankFailed) else first.summary
        )
    data, files, nbytes = end.values[src]
    ours = [] if workspace else list(owned_files(files, pool.shm_folder))
    shipment = payload.Shipment(data, ours)
    notes = end.notes
    try:
        bound = drive(pool, pool.run("", ranks=targets, needs=shipment))
        notes += bound.notes
        raise_for_end(bound, pool.hosts)
    finally:
        shipment.remove()
        if workspace and files:  # the source removes its folder (the notebook may not see it)
            folder = os.path.dirname(files[0])
            remove = f"__import__('nbddp.worker_copy', fromlist=['remove']).remove({folder!r})"
            with contextlib.suppress(Exception):  # (the source died: the copy's error says)
                drive(pool, pool.run(remove, ranks=[src]))
    took = time.monotonic() - t0
    return Copied(tuple(names), src, tuple(targets), nbytes, took, _via(pool, files), notes)


def _via(pool, files) -> str:
    """How the big tensors went: a workspace, shared memory, a private folder on disk
    (shared memory had no room), or nowhere but the message."""
    if not files:
        return "in the message"
    if pool.workspace:
        return f"through the workspace {pool.workspace}"
    disk = twin(pool.shm_folder or "")
    if disk and any(os.path.dirname(f) == disk for f in files):
        return "through a private folder on disk"
    return "through shared memory"
