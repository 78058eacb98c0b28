"""A rank's side of ``%ddp copy``: its objects packed once, for every other rank.

:func:`pack` runs on the source rank (as a cell's last expression): it pickles
the named objects with :mod:`nbddp.payload`, big tensors written once to the
pool's shared-memory folder, and returns the pickle and the files, which the
notebook ships to the destinations unopened (the notebook may not be able to
load them: CUDA tensors, classes only the ranks can import). Each destination
loads them as ``--need`` objects, tensors on its own device.

With ``%ddp start/attach --workspace DIR``, the files go to a new folder in DIR (a
folder every host mounts) instead, and the source removes it once every destination
has loaded: ranks on other hosts read them there, and the notebook passes only the
pickle.

Objects bound to the process group cannot be copied (the destination's group
is its own): a DDP or FSDP wrapper, a DeviceMesh, a ProcessGroup, a DTensor.
"""

from __future__ import annotations

import os
import shutil
import sys

import torch

from . import payload
from .workspace import new_folder

__all__ = ["bound_to_group", "pack", "remove"]


_GROUP_TYPES = (
    ("torch.nn.parallel", "DistributedDataParallel", "a DistributedDataParallel wrapper"),
    ("torch.distributed", "ProcessGroup", "a ProcessGroup"),
    ("torch.distributed.fsdp", "FullyShardedDataParallel", "an FSDP wrapper"),
    ("torch.distributed.fsdp", "FSDPModule", "a module sharded with fully_shard"),
    ("torch.distributed.device_mesh", "DeviceMesh", "a DeviceMesh"),
    ("torch.distributed.tensor", "DTensor", "a DTensor"),
)


def _group_types() -> dict[type, str]:
    """The classes bound to a group, of the modules imported (no object of a class whose
    module was never imported can exist, and importing FSDP costs half a second)."""
    found = {}
    for module, name, what in _GROUP_TYPES:
        cls = getattr(sys.modules.get(module), name, None)
        if isinstance(cls, type):
            found[cls] = what
    return found


def bound_to_group(obj: object, types: dict[type, str] | None = None) -> str | None:
    """What ``obj`` is, if it is bound to the process group (else None)."""
    for cls, what in (types or _group_types()).items():
        if isinstance(obj, cls):
            return what
    return None


def _refusal(name: str, obj: object, what: str, inside: bool) -> str:
    if inside:
        return f"cannot copy {name!r}: it holds {what}, which is bound to this rank's process group"
    if isinstance(getattr(obj, "module", None), torch.nn.Module):
        return (
            f"cannot copy {name!r}: it is {what}, bound to this rank's process group; copy "
            f"the model it wraps ({name}.module: `net = {name}.module`, then copy net) "
            "and wrap it again on each rank"
        )
    return f"cannot copy {name!r}: it is {what}, bound to this rank's process group"


def pack(namespace: dict, names: list[str], workspace: str | None = None) -> tuple:
    """The named objects of ``namespace``, pickled once: (pickle, files, size in bytes).
    Big tensors go to files in the pool's shared-memory folder, or with ``workspace`` (a
    folder the hosts share) in a new ``copy-XXXX`` folder there."""
    missing = [n for n in names if n not in namespace]
    if missing:
        raise NameError(f"name {missing[0]!r} is not defined on this rank")
    types = _group_types()
    for name in names:
        what = bound_to_group(namespace[name], types)
        if what is not None:
            raise TypeError(_refusal(name, namespace[name], what, inside=False))
    objects = {n: namespace[n] for n in names}
    if workspace is not None:
        folder = new_folder(workspace, "copy")
    else:
        folder = os.environ.get("NBDDP_SHM_DIR") or None
    try:
        shipment = payload.dumps(
            objects, folder, refuse=lambda o: bound_to_group(o, types), read=workspace is not None
        )
    except payload.Refused as exc:  # inside one of them: which (pickled again, rarely)
        for name in names:
            try:
                payload.dumps(namespace[name], refuse=lambda o: bound_to_group(o, types))
            except payload.Refused:
                raise TypeError(_refusal(name, namespace[name], str(exc), True)) from None
        raise
    finally:
        if workspace is not None and not os.listdir(folder):
            os.rmdir(folder)  # nothing big: all in the pickle
    return shipment.data, shipment.files, shipment.nbytes


def remove(folder: str) -> None:
    """A ``copy-XXXX`` folder :func:`pack` made in a workspace, once every rank loaded."""
    if os.path.basename(folder).startswith("copy-"):
        shutil.rmtree(folder, ignore_errors=True)
