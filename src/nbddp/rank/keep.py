"""A rank's snapshot of named objects, and putting it back (issue 48, the rank's side).

For ``--keep`` (the pool's wiring comes with it): each rank copies the *local* state of the
named objects, as they are at the end of a clean cell, to host memory that outlives the
process (a file in the pool's shared-memory folder, ``keep-RANK.pt``), and puts it back
into the live objects on demand (a rollback) or into a new process's objects after a
death. What a rank holds of each kind:

- a module (DDP-wrapped, FSDP2-sharded with ``fully_shard``, tensor-parallel): its
  ``state_dict()``, each DTensor as its local shard;
- an optimizer: its state per parameter (Adam's ``exp_avg``... local shards too) and each
  param group's hyperparameters (a scheduler's ``lr``); an optimizer that has not stepped
  since (a new process's) gets its state made again, as DTensors where its parameters are;
- a tensor or DTensor (its local shard); a plain value of numbers, strings, lists, dicts.

Everything is copied to the CPU (a snapshot never holds GPU memory) and back into the
live tensors in place, so references to them (an optimizer's to its parameters, a
scheduler's to its optimizer) stay valid. The file is written next to the last one and
renamed over it, so a rank that dies while writing leaves the previous snapshot whole.
It is read with ``torch.load(weights_only=True)``: tensors and plain data, nothing run.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass, field

import torch

__all__ = ["KeepError", "Kept", "here", "path_of", "restore", "restore_here", "take", "take_here"]

PLAIN = (int, float, str, bool, type(None))
_LAST: dict[str, tuple] = {}  # path -> (marks, weak references, bytes) of its last snapshot


class KeepError(Exception):
    """A snapshot that cannot be taken or put back, in one line."""


@dataclass
class Kept:
    """What :func:`take` kept: the names, their bytes on this rank, and what it could not."""

    names: list[str] = field(default_factory=list)
    nbytes: int = 0
    missing: dict[str, str] = field(default_factory=dict)  # name -> why
    unchanged: bool = False  # nothing was written to since the last snapshot: not written


def path_of(folder: str, rank: int) -> str:
    return os.path.join(folder, f"keep-{rank}.pt")


def here() -> str:
    """This rank's snapshot file, in its pool's shared-memory folder."""
    return path_of(os.environ["NBDDP_SHM_DIR"], int(os.environ["RANK"]))


def take_here(namespace: dict, names: list[str]) -> Kept:
    """:func:`take` into this rank's own file (the pool's snapshot, after a clean cell)."""
    return take(namespace, names, here())


def restore_here(namespace: dict) -> list[str]:
    """:func:`restore` everything this rank's own file holds (the pool's rollback)."""
    return restore(namespace, None, here())


def take(namespace: dict, names: list[str], path: str) -> Kept:
    """Copy each of ``names``' local state to ``path`` (atomically: a new file renamed over
    the last one). Nothing is written when no kept tensor was written to since the last
    snapshot here (each tensor's version counter, which every in-place change moves) and
    the plain values are equal: a cell that only read the model costs nothing."""
    kept, objects = Kept(), {}
    for name in names:
        if name not in namespace:
            kept.missing[name] = "not defined on this rank"
        elif (why := _not_kept(namespace[name])) is not None:
            kept.missing[name] = why
        else:
            objects[name] = namespace[name]
    kept.names = list(objects)
    refs: list = []
    marks = [(name, _marks(obj, refs)) for name, obj in objects.items()]
    last = _LAST.get(path)
    same = last is not None and last[0] == marks and all(r() is not None for r in last[1])
    if same and os.path.exists(path):
        kept.nbytes, kept.unchanged = last[2], True
        return kept
    snap = {name: _snapshot(obj) for name, obj in objects.items()}
    kept.nbytes = sum(_nbytes(v) for v in snap.values())
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
        torch.save(snap, f)
    os.replace(tmp, path)
    _LAST[path] = (marks, refs, kept.nbytes)
    return kept


def restore(namespace: dict, names: list[str] | None, path: str) -> list[str]:
    """Put the snapshot at ``path`` back into the live objects of ``names`` (all it holds
    when None); the names put back. KeepError if there is none, or an object changed shape
    since (said with the name)."""
    try:
        snap = torch.load(path, weights_only=True)
    except FileNotFoundError:
        raise KeepError("no snapshot was taken on this rank yet") from None
    done = []
    for name in snap if names is None else names:
        if name not in snap:
            raise KeepError(f"{name} is not in the snapshot (it holds {', '.join(snap)})")
        saved = snap[name]
        try:
            namespace[name] = _put_back(namespace.get(name), saved)
        except (KeyError, RuntimeError, ValueError, IndexError) as exc:
            raise KeepError(f"{name} cannot take its snapshot back: {exc}") from None
        done.append(name)
    return done


# ------------------------------------------------------------ taking


def _not_kept(obj) -> str | None:
    """Why ``obj`` cannot be kept, or None."""
    if isinstance(obj, (torch.nn.Module, torch.optim.Optimizer, torch.Tensor)) or _is_plain(obj):
        return None
    return f"a {type(obj).__name__}: only modules, optimizers, tensors and plain values are kept"


def _snapshot(obj) -> dict:
    if isinstance(obj, torch.nn.Module):
        return {"kind": "module", "state": _local(obj.state_dict())}
    if isinstance(obj, torch.optim.Optimizer):
        return {"kind": "optimizer", "state": _local(obj.state_dict())}
    if isinstance(obj, torch.Tensor):
        return {"kind": "tensor", "state": _local(obj)}
    return {"kind": "value", "state": obj}


def _marks(obj, refs: list) -> list:
    """What tells whether ``obj`` changed: each tensor by identity (``refs`` gets a weak
    reference to each: a tensor made anew at a freed one's address is told apart by the
    old one being gone) and version counters (an in-place change moves them: an
    optimizer's step, a copy_), and the plain values."""
    found: list = []

    def walk(v) -> None:
        if isinstance(v, torch.Tensor):
            inner = getattr(v, "_local_tensor", v)  # (a DTensor's shard, no new object)
            refs.append(weakref.ref(v))
            found.append((id(v), v._version, inner._version, tuple(v.shape)))
        elif isinstance(v, dict):
            for key, x in v.items():
                found.append(key if isinstance(key, PLAIN) else type(key).__name__)
                walk(x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)
        else:
            found.append(v if isinstance(v, PLAIN) else type(v).__name__)

    if isinstance(obj, torch.optim.Optimizer):
        walk(obj.state_dict())
    elif isinstance(obj, torch.nn.Module):
        walk(dict(obj.named_parameters()))  # (the live tensors: a state_dict may be views)
        walk(dict(obj.named_buffers()))
    else:
        walk(obj)
    return found


def _local(v):
    """``v`` with every tensor a CPU copy of its local part (a DTensor's shard)."""
    if isinstance(v, torch.Tensor):
        local = v.to_local() if _is_dtensor(v) else v
        return local.detach().to("cpu", copy=True)
    if isinstance(v, dict):
        return {k: _local(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return type(v)(_local(x) for x in v)
    return v


def _is_plain(v) -> bool:
    if isinstance(v, PLAIN):
        return True
    if isinstance(v, (list, tuple)):
        return all(map(_is_plain, v))
    if isinstance(v, dict):
        return all(isinstance(k, PLAIN) and _is_plain(x) for k, x in v.items())
    return False


def _nbytes(v) -> int:
    if isinstance(v, torch.Tensor):
        return v.numel() * v.element_size()
    if isinstance(v, dict):
        return sum(_nbytes(x) for x in v.values())
    if isinstance(v, (list, tuple)):
        return sum(_nbytes(x) for x in v)
    return 0


def _is_dtensor(v) -> bool:
    return type(v).__name__ == "DTensor" and hasattr(v, "to_local")


# ------------------------------------------------------------ putting back


def _put_back(live, saved: dict):
    kind, state = saved["kind"], saved["state"]
    if kind == "module":
        if not isinstance(live, torch.nn.Module):
            raise KeepError("is no longer a module on this rank")
        _module(live, state)
        return live
    if kind == "optimizer":
        if not isinstance(live, torch.optim.Optimizer):
            raise KeepError("is no longer an optimizer on this rank")
        _optimizer(live, state)
        return live
    if kind == "tensor":
        if isinstance(live, torch.Tensor) and _local_of(live).shape == state.shape:
            with torch.no_grad():
                _local_of(live).copy_(state)
            return live
        return state  # (rebound since, or never made here: the snapshot's own)
    return state


def _local_of(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if _is_dtensor(t) else t


def _module(live: torch.nn.Module, state: dict) -> None:
    now = live.state_dict()
    if set(now) != set(state):
        changed = sorted(set(now) ^ set(state))
        raise KeyError(f"its parameters changed since the snapshot ({', '.join(changed[:4])})")
    for key, t in now.items():  # (copy_ would broadcast a smaller one without a word)
        if _local_of(t).shape != state[key].shape:
            was, has = tuple(state[key].shape), tuple(_local_of(t).shape)
            raise ValueError(f"{key} changed shape since the snapshot ({was} then, {has} now)")
    with torch.no_grad():
        for key, t in now.items():
            _local_of(t).copy_(state[key])


def _optimizer(live: torch.optim.Optimizer, state: dict) -> None:
    params = [p for group in live.param_groups for p in group["params"]]
    groups = state["param_groups"]
    if [len(g["params"]) for g in groups] != [len(g["params"]) for g in live.param_groups]:
        raise ValueError("its parameter groups changed since the snapshot")
    for group, saved in zip(live.param_groups, groups, strict=True):
        group.update({k: v for k, v in saved.items() if k != "params"})
    ids = [i for g in groups for i in g["params"]]  # the snapshot's parameter ids, in order
    saved_state = state["state"]
    was = {p: dict(s) for p, s in live.state.items()}  # (where each value lived)
    live.state.clear()  # (state the snapshot did not have goes: it had not stepped then)
    for index, param in zip(ids, params, strict=True):
        if index in saved_state:
            old = was.get(param, {})
            live.state[param] = {
                k: _like(param, v, old.get(k)) for k, v in saved_state[index].items()
            }


def _like(param: torch.Tensor, saved, old=None):
    """One saved optimizer state value, made live for ``param``: a tensor shaped like the
    parameter's local shard becomes a DTensor where the parameter is one; scalars (Adam's
    ``step``) go where the optimizer kept them (``old``), else stay on the CPU."""
    if not isinstance(saved, torch.Tensor):
        return saved
    local = _local_of(param)
    if saved.dim() == 0 or saved.shape != local.shape:
        device = old.device if isinstance(old, torch.Tensor) else saved.device
        return saved.to(device, copy=True)
    value = saved.to(local.device, dtype=saved.dtype, copy=True)
    if _is_dtensor(param):
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(
            value, param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
        )
    return value
