"""After a re-form: the rank's DDP models bound again to the new group, the rest named.

A re-formed group is a new ``ProcessGroup``; every object made over the old one (a
``DistributedDataParallel`` wrapper, a subgroup, a device mesh, a sharded module) still
points at it, and would fail, or wait for ever, in the next cell's first collective.
:func:`rebind` runs on each rank as its re-form ends, before it says Ready:

- each DDP wrapper among the rank's global names, made over the old default group (or
  over one of the pool's own ``--groups``), is made again over the new one, with the
  same options, around the same module (so the optimizers made from its parameters
  stay linked to them, and the weights are the rank's own). The new wrapper is made
  with ``init_sync=False``: its constructor issues no collective, so every rank binds
  its own without waiting for the others, and a rank that took a dead one's place
  (which has no model yet) blocks nobody. Every rank's wrapper is new, so the first
  backward rebuilds the buckets on every rank together, as DDP expects;
- each one bound again is fingerprinted (:func:`fingerprint`): a cell that failed in a
  training step may have ended the step on some ranks only (one rank raised between
  ``backward`` and ``opt.step()``; the abort came as another finished its all_reduce),
  and the pool compares the ranks' fingerprints (:mod:`nbddp.pool.agreeing`);
- what cannot be bound again (a DDP over a subgroup the cell made, with a
  communication hook or mixed precision; a ``ProcessGroup``, a ``DeviceMesh``, a
  ``DTensor``, a module sharded with ``fully_shard`` or holding DTensor parameters) is
  reported as :class:`~nbddp.wire.protocol.Stale`, for the pool's note to name with
  what mends it. The old group's sockets are shut down by the re-form
  (:meth:`nbddp.rank.group.GroupKeeper.reform`), so such an object fails at once if
  used, never waits.

Only the namespace's own names are looked at, not objects inside other objects.
"""

from __future__ import annotations

import hashlib
import inspect
import sys

import torch

from ..wire import protocol as P
from .copying import SHARDED as FULLY_SHARDED
from .copying import bound_to_group, group_types
from .wrap import DDP, cannot_remake, options_of, wrap

__all__ = ["Rebound", "fingerprint", "rebind", "stale_kind"]

# Stale.kind: what the object is, which decides what the pool's note says mends it
SHARDED = "sharded"  # FSDP2 (fully_shard) or DTensor parameters: the shards are per rank
DDP_STUCK = "ddp"  # a DDP wrapper that could not be made again here
GROUP = "group"  # a ProcessGroup, DeviceMesh or DTensor over the old group

_INIT_SYNC = "init_sync" in inspect.signature(DDP.__init__).parameters
FINGERPRINTED = 4096  # elements of each parameter a fingerprint reads (a step moves them all)


class Rebound:
    """What :func:`rebind` did on this rank: the names made again, the names left."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.stale: list[P.Stale] = []
        # (name, fingerprint of its parameters, the optimizers over them: "opt,sched")
        self.weights: list[tuple[str, str, str]] = []


def fingerprint(module: torch.nn.Module) -> str:
    """A digest of ``module``'s parameters (shapes, and the first FINGERPRINTED elements
    of each: an optimizer step moves every one), '' when they cannot be read. Equal on
    two ranks when they hold one model; about 20 us a tensor on CPU (2 ms for 201 M
    parameters in 96 tensors: benchmarks/bench_fingerprint.py)."""
    digest = hashlib.blake2b(digest_size=8)
    try:
        for p in module.parameters():
            head = p.detach().reshape(-1)[:FINGERPRINTED].contiguous()
            digest.update(repr((tuple(p.shape), head.dtype)).encode())
            digest.update(head.view(torch.uint8).cpu().numpy().tobytes())
    except Exception:  # (a meta tensor, a subclass that refuses a view): not compared
        return ""
    return digest.hexdigest()


def _sharded(obj: object) -> bool:
    """A module whose parameters are DTensors (fully_shard, parallelize_module)."""
    if not isinstance(obj, torch.nn.Module):
        return False
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    return isinstance(dtensor, type) and any(isinstance(p, dtensor) for p in obj.parameters())


def stale_kind(obj: object, types: dict) -> tuple[str, str] | None:
    """(kind, what it is) for an object bound to a process group, else None."""
    what = bound_to_group(obj, {cls: w for cls, w in types.items() if cls is not DDP})
    if what == FULLY_SHARDED or (what is None and _sharded(obj)):
        return SHARDED, what or "a module with DTensor parameters"
    if what is not None:
        return GROUP, what
    return None


def _why_not(ddp: DDP, groups: dict) -> str:
    """Why ``ddp`` cannot be made again here ('' when it can)."""
    if ddp.process_group not in groups:
        return "a DDP wrapper over a process group the cell made"
    if why := cannot_remake(ddp):
        return f"a DDP wrapper that {why}"
    if not _INIT_SYNC:
        return "a DDP wrapper (this torch wraps only with a collective)"
    return ""


def rebind(namespace: dict, groups: dict) -> Rebound:
    """Bind the DDP wrappers among ``namespace``'s names again, each over the group
    ``groups`` maps its old group to; report what is still bound to an old group."""
    done = Rebound()
    types = group_types()
    made: dict[int, DDP] = {}  # old wrapper id -> new (two names for one wrapper)
    for name, obj in list(namespace.items()):
        if name.startswith("_") and name != "_":
            continue
        if isinstance(obj, DDP):
            why = "" if id(obj) in made else _why_not(obj, groups)
            if why:
                done.stale.append(P.Stale(name, DDP_STUCK, why))
                continue
            if id(obj) not in made:
                try:
                    made[id(obj)] = _again(obj, groups[obj.process_group])
                except Exception as exc:  # (the re-form itself stands: said, not raised)
                    done.stale.append(P.Stale(name, DDP_STUCK, f"a DDP wrapper ({exc})"))
                    continue
            namespace[name] = made[id(obj)]
            done.names.append(name)
            module = obj.module
            done.weights.append((name, fingerprint(module), _optimizers(namespace, module)))
        elif (found := stale_kind(obj, types)) is not None and name not in ("group", "mesh"):
            done.stale.append(P.Stale(name, *found))
    return done


def _optimizers(namespace: dict, module: torch.nn.Module) -> str:
    """The names of the namespace's optimizers over ``module``'s parameters: "opt"."""
    params = {id(p) for p in module.parameters()}
    return ",".join(
        name
        for name, obj in namespace.items()
        if isinstance(obj, torch.optim.Optimizer)
        and not name.startswith("_")
        and any(id(p) in params for g in obj.param_groups for p in g["params"])
    )


def _again(old: DDP, group) -> DDP:
    """A new wrapper over ``group`` around ``old``'s module; ``old`` syncs nothing now."""
    options = options_of(old)
    if hasattr(old, "reducer"):
        old._remove_autograd_hooks()
    return wrap(old.module, options, group)
