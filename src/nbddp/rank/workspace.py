"""A folder the hosts share (NFS), for what shared memory cannot carry between hosts.

:class:`Workspace` is modelopt's ``NFSWorkspace``: each rank writes its config and
weights to ``PATH/rank_{rank}_state.pth`` and any rank reads another's. Nothing in it
is collective: the caller synchronizes (a barrier between the writes and the reads),
as the seed documents. Unlike the seed, a file is written beside its name and renamed
over it, so a reader racing a writer gets the old file or the whole new one, never a
part; it is 0600 in a 0700 folder, and a folder another user could write in is refused
in one line (:func:`nbddp.wire.private.workspace_folder`).

:func:`write_bundle` and :func:`read_bundle` are the other use: one object (pickled
with :mod:`nbddp.wire.payload`, big tensors as files beside it) in a fresh private folder,
for :func:`nbddp.gather_objects` and ``%ddp copy`` through a folder, on one host
(shared memory) or many (a workspace).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import tempfile

import torch
import torch.distributed as dist

from ..wire import payload
from ..wire.carriers import full, twin
from ..wire.private import (
    UnsafeFile,
    is_private_folder,
    open_private,
    replace_private,
    workspace_folder,
)

__all__ = ["Workspace", "new_folder", "read_bundle", "remove_bundle", "write_bundle"]

_PICKLE = "object.pkl"


def _this_rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


class Workspace:
    """Configs and weights by rank in a folder every host mounts at ``path``.

    Made like modelopt's: the folder (0700, with its parents) if missing, and this
    rank's state file of an earlier run removed. ``rank``: this process's (by default
    the process group's rank, else ``$RANK``, else 0).
    """

    def __init__(self, path: str | os.PathLike, rank: int | None = None) -> None:
        self.path = workspace_folder(os.fspath(path))
        self.rank = _this_rank() if rank is None else int(rank)
        self._remove_own()

    def state_file(self, rank: int) -> str:
        return os.path.join(self.path, f"rank_{int(rank)}_state.pth")

    def write(self, config: object, weights: object) -> None:
        """This rank's state (``torch.save``), replacing its last one in one rename."""
        state = {"config": config, "weights": weights}
        replace_private(self.state_file(self.rank), lambda f: torch.save(state, f), sync=True)

    def read(self, rank: int) -> tuple[object, object]:
        """``(config, weights)`` that ``rank`` wrote last, tensors on the CPU; ``(None,
        None)`` if it wrote none. Loaded with ``weights_only=True``: plain containers,
        numbers, strings and tensors (what ``torch.save`` of a state dict holds)."""
        path = self.state_file(rank)
        try:
            f = open_private(path, "workspace file")
        except FileNotFoundError:
            return None, None
        with f:
            try:
                state = torch.load(f, map_location="cpu", weights_only=True)
            except pickle.UnpicklingError as exc:
                first = (str(exc).strip() or type(exc).__name__).splitlines()[0]
                raise ValueError(
                    f"cannot read {path}: torch.load(weights_only=True) refuses it ({first}); "
                    "keep configs to dicts, lists, numbers and strings"
                ) from None
        if not isinstance(state, dict) or set(state) != {"config", "weights"}:
            raise ValueError(f"{path} is not a workspace state file")
        return state["config"], state["weights"]

    def _remove_own(self) -> None:
        """This rank's state file, and its half-written ones, from an earlier run."""
        name = os.path.basename(self.state_file(self.rank))
        for entry in os.listdir(self.path):
            if entry == name or entry.startswith(f".{name}."):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(self.path, entry))

    def __repr__(self) -> str:
        return f"Workspace({self.path!r}, rank={self.rank})"


# ---------------------------------------------------------------- one object in a folder


def new_folder(path: str | os.PathLike, prefix: str) -> str:
    """A new private folder ``PREFIX-XXXX`` in the workspace at ``path`` (checked)."""
    return tempfile.mkdtemp(prefix=f"{prefix}-", dir=workspace_folder(os.fspath(path)))


def write_bundle(obj: object, folder: str, shared: bool = False) -> int:
    """``obj`` in ``folder`` (new, private): its pickle, and each big tensor as a file
    beside it, written once, which the reader maps (``shared``, a folder of a workspace:
    reads into memory, as NFS may not keep a removed file's pages). Its size in bytes.
    What does not fit in a shared-memory folder goes to its twin on disk (the pickle
    too: :mod:`nbddp.wire.carriers`)."""
    shipment = payload.dumps(obj, folder, read=shared)
    try:
        _write_pickle(folder, shipment.data)
    except OSError as exc:
        disk = twin(folder)
        if not (full(exc) and disk and os.path.isdir(disk)):
            shipment.remove()
            raise
        _write_pickle(disk, shipment.data)
    return shipment.nbytes


def _write_pickle(folder: str, data: bytes) -> None:
    path = os.path.join(folder, _PICKLE)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise


def read_bundle(folder: str) -> object:
    """The object :func:`write_bundle` left in ``folder`` (or its twin on disk), if that
    is a private folder of this user (its tensors mapped from their files, private to
    this process)."""
    if not is_private_folder(os.lstat(folder)):
        raise UnsafeFile(f"refusing to read {folder}: not a private folder of this user")
    path, disk = os.path.join(folder, _PICKLE), twin(folder)
    if not os.path.exists(path) and disk and is_private_folder(os.lstat(disk)):
        path = os.path.join(disk, _PICKLE)
    with open_private(path, "bundle file") as f:
        return payload.loads(f.read())


def remove_bundle(folder: str) -> None:
    """Remove a bundle's folder and its twin on disk (if private folders of this user)."""
    for path in (folder, twin(folder)):
        with contextlib.suppress(OSError, TypeError):
            if is_private_folder(os.lstat(path)):
                shutil.rmtree(path, ignore_errors=True)
