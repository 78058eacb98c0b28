"""``Pool.copy``: objects from one live rank's namespace to others (``%ddp copy``).

The source rank packs them once (:func:`nbddp.rank.copying.pack`: big tensors
written once to the pool's shared-memory folder, whatever the number of
destinations); the notebook passes the pickle on unopened, and each
destination binds them as it binds ``--need`` objects, tensors on its own
device. With a workspace (``%ddp start/attach --workspace DIR``, a folder every
host mounts) the big tensors go to a new folder there instead, which ranks on any
host read, and the source removes it once they have. So a new rank that took a dead
one's place is healed from a survivor:
``pool.copy(["model", "opt"], 0, [2])``. A DDP wrapper travels as the module it
wraps and its options, and then every rank wraps again together (DDP's constructor
is a collective: :mod:`nbddp.rank.wrap`); an optimizer copied with its model stays
linked to the copied parameters. Other objects bound to the process group (an FSDP
wrapper, a DeviceMesh) are refused in one line that says what to copy instead.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass

from ..wire import payload
from ..wire.carriers import twin
from .drive import drive
from .errors import CaptureError, RankFailed
from .outcome import failures_of, owned_files, raise_for_end

__all__ = ["Copied", "check_names", "copy"]


@dataclass(frozen=True)
class Copied:
    """What :func:`copy` did: for the line a front end says."""

    names: tuple[str, ...]
    src: int
    dst: tuple[int, ...]
    nbytes: int
    seconds: float
    via: str  # "through shared memory", "through the workspace DIR", or "in the message"
    rewrapped: tuple[str, ...] = ()  # DDP wrappers made again on every rank
    notes: tuple[str, ...] = ()  # the pool's notes its steps took (said once)


def check_names(names: list[str]) -> None:
    """CaptureError for ``model.module``: the name to copy is ``model`` (a DDP model
    travels as the module it wraps, and is wrapped again on every rank)."""
    for name in names:
        parts = name.split(".")
        if len(parts) > 1 and all(part.isidentifier() for part in parts):
            raise CaptureError(
                f"not a name: {name!r} (an attribute): copy {parts[0]} (a DDP model travels "
                "as the module it wraps, and is wrapped again on every rank)"
            )


def _targets(pool, names: list[str], src: int, dst: list[int] | None) -> list[int]:
    """The ranks to copy to; CaptureError (one line) for what cannot be."""
    check_names(names)
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
    return targets


def _packed(pool, names: list[str], src: int) -> tuple:
    """What the source packed: (pickle, files, bytes, DDP options by name), and the
    pool's notes that came with it."""
    code = f"__import__('nbddp.rank.copying', fromlist=['pack']).pack(globals(), {names!r}"
    run = pool.run(f"{code}, workspace={pool.workspace!r})", ranks=[src], want_values=True)
    end = drive(pool, run)
    failures = failures_of(end, pool.hosts)
    if failures:  # the source refused (one line), or died
        first = failures[0]
        raise CaptureError(
            f"rank {src}: {first.message}" if isinstance(first, RankFailed) else first.summary
        )
    if src not in end.values:  # interrupted (or nothing came back): nothing was copied
        what = "interrupted" if end.interrupted else "given nothing back"
        raise CaptureError(
            f"the copy was {what} while rank {src} packed {', '.join(names)}: nothing was copied"
        )
    return end.values[src], end.notes


def _bind(pool, data: bytes, files, src: int, targets: list[int], wrapped: dict) -> tuple:
    """Each target binds what came; with DDP wrappers, every rank then wraps again. The
    pool's notes that came meanwhile."""
    ours = [] if pool.workspace else list(owned_files(files, pool.shm_folder))
    shipment = payload.Shipment(data, ours)
    unpack = "__import__('nbddp.rank.copying', fromlist=['unpack']).unpack(globals())"
    try:
        bound = drive(pool, pool.run(unpack, ranks=targets, needs=shipment))
        raise_for_end(bound, pool.hosts)
    finally:
        shipment.remove()
    notes = bound.notes
    if wrapped:
        call = f"rewrap(globals(), {wrapped!r}, {src})"
        rewrap = f"__import__('nbddp.rank.wrap', fromlist=['rewrap']).{call}"
        again = drive(pool, pool.run(rewrap))
        raise_for_end(again, pool.hosts)
        notes += again.notes
    return notes


def copy(pool, names: list[str], src: int, dst: list[int] | None = None) -> Copied:
    """Bind ``names`` from rank ``src``'s namespace in every rank of ``dst`` (all others by
    default). CaptureError (one line) for a name the source lacks or cannot send, or a
    copy interrupted while the source packs."""
    t0 = time.monotonic()
    names = list(dict.fromkeys(names))
    targets = _targets(pool, names, src, dst)
    workspace = pool.workspace
    (data, files, nbytes, wrapped), notes = _packed(pool, names, src)
    try:
        notes += _bind(pool, data, files, src, targets, wrapped)
    finally:
        if workspace and files:  # the source removes its folder (the notebook may not see it)
            folder = os.path.dirname(files[0])
            remove = f"__import__('nbddp.rank.copying', fromlist=['remove']).remove({folder!r})"
            with contextlib.suppress(Exception):  # (the source died: the copy's error says)
                drive(pool, pool.run(remove, ranks=[src]))
    took = time.monotonic() - t0
    rewrapped = tuple(sorted(wrapped))
    return Copied(
        tuple(names), src, tuple(targets), nbytes, took, _via(pool, files), rewrapped, notes
    )


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
