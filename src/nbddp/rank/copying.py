"""A rank's side of ``%ddp copy``: its objects packed once, for every other rank.

:func:`pack` runs on the source rank (as a cell's last expression): it pickles
the named objects with :mod:`nbddp.wire.payload`, big tensors written once to the
pool's shared-memory folder, and returns the pickle and the files, which the
notebook ships to the destinations unopened (the notebook may not be able to
load them: CUDA tensors, classes only the ranks can import). Each destination
loads them as ``--need`` objects, tensors on its own device.

With ``%ddp start/attach --workspace DIR``, the files go to a new folder in DIR (a
folder every host mounts) instead, and the source removes it once every destination
has loaded: ranks on other hosts read them there, and the notebook passes only the
pickle.

A DDP wrapper travels as the module it wraps and its options; every rank then
wraps again together (:mod:`nbddp.rank.wrap`). Other objects bound to the process
group cannot be copied (the destination's group is its own): an FSDP wrapper, a
DeviceMesh, a ProcessGroup, a DTensor, or a DDP wrapper inside another object. A
module sharded with ``fully_shard`` (FSDP2) is one model of which each rank holds a
shard: between live ranks a copy would give each rank back its own shard, and a
dead rank's shard is gone with it, so it is refused with that reason (a checkpoint
is the way to bring it back).

The destinations bind what they receive with :func:`unpack`, as their own (not as
the notebook's: automatic capture never replaces a copied object).
"""

from __future__ import annotations

import os
import shutil
import sys

import torch

from ..wire import payload
from .user_code import adopt
from .workspace import new_folder
from .wrap import DDP, ddp_options

__all__ = ["bound_to_group", "group_types", "pack", "remove", "unpack"]

CARRIER = "__nbddp_copy__"  # the one name a copy is bound under, until unpack binds each
SHARDED = "a module sharded with fully_shard"


_GROUP_TYPES = (
    ("torch.nn.parallel", "DistributedDataParallel", "a DistributedDataParallel wrapper"),
    ("torch.distributed", "ProcessGroup", "a ProcessGroup"),
    ("torch.distributed.fsdp", "FullyShardedDataParallel", "an FSDP wrapper"),
    ("torch.distributed.fsdp", "FSDPModule", SHARDED),
    ("torch.distributed.device_mesh", "DeviceMesh", "a DeviceMesh"),
    ("torch.distributed.tensor", "DTensor", "a DTensor"),
)


def group_types() -> dict[type, str]:
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
    for cls, what in (types or group_types()).items():
        if isinstance(obj, cls):
            return what
    return None


def _refusal(name: str, obj: object, what: str, inside: bool) -> str:
    if what == SHARDED and not inside:  # FSDP2: one model, a shard on each rank
        return (
            f"cannot copy {name!r}: it is {what}: each rank holds only its own shard of the "
            "one model (a copy between live ranks would change nothing, and a dead rank's "
            "shard died with it); save a checkpoint (torch.distributed.checkpoint) and load "
            "it on every rank"
        )
    if inside:
        return f"cannot copy {name!r}: it holds {what}, which is bound to this rank's process group"
    if isinstance(getattr(obj, "module", None), torch.nn.Module):
        return (
            f"cannot copy {name!r}: it is {what}, bound to this rank's process group; copy "
            f"the model it wraps ({name}.module: `net = {name}.module`, then copy net) "
            "and wrap it again on each rank"
        )
    return f"cannot copy {name!r}: it is {what}, bound to this rank's process group"


def _unwrapped(namespace: dict, names: list[str]) -> tuple[dict, dict]:
    """(name -> what travels, name -> the DDP options of those unwrapped)."""
    types = group_types()
    objects, wrapped = {}, {}
    for name in names:
        obj = namespace[name]
        if isinstance(obj, DDP):
            obj, wrapped[name] = obj.module, ddp_options(name, obj)
        what = bound_to_group(obj, types)
        if what is not None:
            raise TypeError(_refusal(name, obj, what, inside=False))
        objects[name] = obj
    return objects, wrapped


def pack(namespace: dict, names: list[str], workspace: str | None = None) -> tuple:
    """The named objects of ``namespace``, pickled once: (pickle, files, size in bytes,
    the DDP options of those unwrapped). Big tensors go to files in the pool's
    shared-memory folder, or with ``workspace`` (a folder the hosts share) in a new
    ``copy-XXXX`` folder there."""
    missing = [n for n in names if n not in namespace]
    if missing:
        raise NameError(f"name {missing[0]!r} is not defined on this rank")
    objects, wrapped = _unwrapped(namespace, names)
    types = group_types()
    if workspace is not None:
        folder = new_folder(workspace, "copy")
    else:
        folder = os.environ.get("NBDDP_SHM_DIR") or None
    try:
        shipment = payload.dumps(
            {CARRIER: objects},
            folder,
            refuse=lambda o: bound_to_group(o, types),
            read=workspace is not None,
        )
    except payload.Refused as exc:  # inside one of them: which (pickled again, rarely)
        for name, obj in objects.items():
            try:
                payload.dumps(obj, refuse=lambda o: bound_to_group(o, types))
            except payload.Refused:
                raise TypeError(_refusal(name, obj, str(exc), True)) from None
        raise
    finally:
        if workspace is not None and not os.listdir(folder):
            os.rmdir(folder)  # nothing big: all in the pickle
    return shipment.data, shipment.files, shipment.nbytes, wrapped


def unpack(namespace: dict) -> None:
    """On a destination: bind what :func:`pack` sent (bound under ``CARRIER`` as the cell
    began) under each name, as this rank's own."""
    for name, obj in namespace.pop(CARRIER, {}).items():
        namespace[name] = adopt(obj, namespace)


def remove(folder: str) -> None:
    """A ``copy-XXXX`` folder :func:`pack` made in a workspace, once every rank loaded."""
    if os.path.basename(folder).startswith("copy-"):
        shutil.rmtree(folder, ignore_errors=True)
