"""DDP wrappers in ``%ddp copy`` and ``--heal``: unwrapped to be copied, wrapped again.

A ``DistributedDataParallel`` wrapper is bound to its rank's process group, so
it cannot travel; the module it wraps can. The source sends the module and the
wrapper's construction options (:func:`ddp_options`: plain data); then every rank
wraps again together (:func:`rewrap`), because DDP's constructor is a collective
(it checks the parameters' shapes across ranks and broadcasts rank 0's state):
the targets wrap the module they received, every other rank its own wrapper's
module (the same parameters, so its optimizer stays linked; after a re-formed
group its old wrapper was stale anyway). In DDP every rank holds the same
weights, so rank 0's broadcast changes nothing. An optimizer copied with its
model holds the copied parameters (one pickle keeps them the same objects), so
it stays linked to them inside the new wrapper.

A wrapper over a subgroup, with a communication hook or mixed precision, is
refused in one line (its group or hook cannot be made again here).
"""

from __future__ import annotations

import inspect
import warnings

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

__all__ = ["DDP", "cannot_remake", "ddp_options", "options_of", "rewrap", "wrap"]


def _refuse(name: str, why: str) -> TypeError:
    return TypeError(
        f"cannot copy {name!r}: its DistributedDataParallel wrapper {why}; copy the model it "
        f"wraps ({name}.module) and wrap it again on each rank"
    )


def ddp_options(name: str, ddp) -> dict:
    """The options ``ddp`` was made with, as plain data (TypeError: it cannot be re-made)."""
    if ddp.process_group.size() != dist.get_world_size():
        size = f"{ddp.process_group.size()} of {dist.get_world_size()}"
        raise _refuse(name, f"is over a subgroup ({size} ranks)")
    why = cannot_remake(ddp)
    if why:
        raise _refuse(name, why)
    return options_of(ddp)


def cannot_remake(ddp) -> str:
    """Why ``ddp`` cannot be made again from :func:`options_of` ('' when it can): what it
    has beyond them (a hook, mixed precision, delayed all-reduces)."""
    if getattr(ddp, "_comm_hooks", None):
        return "has a communication hook (register_comm_hook)"
    if getattr(ddp, "mixed_precision", None) is not None or getattr(
        ddp, "_delay_all_reduce_params", None
    ):
        return "has mixed precision or delayed all-reduces"
    return ""


def options_of(ddp) -> dict:
    """The options ``ddp`` was made with, as plain data, its group left out."""
    default_cap = getattr(ddp, "bucket_bytes_cap_default", False)
    caps = list(getattr(ddp, "bucket_bytes_cap_list", ()) or ())
    options = {
        "device_ids": "own" if ddp.device_ids else None,
        "dim": ddp.dim,
        "broadcast_buffers": getattr(ddp, "forward_sync_buffers", None),
        "bucket_cap_mb": None if default_cap else ddp.bucket_bytes_cap / 2**20,
        "bucket_cap_mb_list": [c / 2**20 for c in caps] if len(caps) > 1 else None,
        "find_unused_parameters": ddp.find_unused_parameters,
        "gradient_as_bucket_view": ddp.gradient_as_bucket_view,
        "static_graph": bool(ddp.static_graph),
        "skip_all_reduce_unused_params": getattr(ddp, "skip_all_reduce_unused_params", None),
    }
    if options["broadcast_buffers"] is None:  # an older torch: the attribute of that name
        options["broadcast_buffers"] = getattr(ddp, "broadcast_buffers", True)
    accepted = inspect.signature(type(ddp).__init__).parameters
    return {k: v for k, v in options.items() if k in accepted and v is not None}


def wrap(module: torch.nn.Module, options: dict, group=None):
    """A new DDP around ``module`` over ``group`` (the default group: None), made without
    a collective where torch allows (``init_sync=False``): the caller syncs, if needed."""
    options = dict(options)
    if options.get("device_ids") == "own":  # this rank's device, not the source's
        device = next(module.parameters()).device
        options["device_ids"] = [device.index if device.index is not None else 0]
    if "init_sync" in inspect.signature(DDP.__init__).parameters:
        options["init_sync"] = False  # synced from the source already (_sync_from)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # broadcast_buffers, as it was given
        return DDP(module, process_group=group, **options)


def _module_of(obj: object) -> torch.nn.Module | None:
    """The module a rank wraps again: its wrapper's, or a plain module."""
    if isinstance(obj, DDP):
        return obj.module
    return obj if isinstance(obj, torch.nn.Module) else None


def _shapes(namespace: dict, name: str) -> list | str:
    """The state's names and shapes of the module a rank would wrap, or what it has."""
    if name not in namespace:
        return "nothing"
    module = _module_of(namespace[name])
    if module is None:
        return f"a {type(namespace[name]).__name__}"
    return [(k, tuple(v.shape)) for k, v in module.state_dict().items()]


def _agree(namespace: dict, wrapped: dict, src: int) -> None:
    """Every rank can wrap every name, with the source's shapes, or each raises the same
    one line (no rank is left waiting in a collective for a rank that cannot join it)."""
    mine = {name: _shapes(namespace, name) for name in wrapped}
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    said = []
    for r, shapes in enumerate(every):
        for name, got in shapes.items():
            if isinstance(got, str):
                said.append(f"rank {r} has {got} as {name!r}")
            elif got != every[src][name]:
                said.append(f"rank {r}'s {name} has other parameters than rank {src}'s")
    if said:
        raise RuntimeError(
            f"cannot wrap {', '.join(wrapped)} again on every rank: {'; '.join(said)}"
        )


def _sync_from(module: torch.nn.Module, src: int, buffers: bool) -> None:
    """The source's parameters (and buffers, when DDP broadcasts them) on every rank."""
    with torch.no_grad():
        for tensor in module.parameters():
            dist.broadcast(tensor.data, src)
        for tensor in module.buffers() if buffers else ():
            dist.broadcast(tensor, src)


def rewrap(namespace: dict, wrapped: dict[str, dict], src: int) -> list[str]:
    """On every rank together: each name in ``wrapped`` (name -> DDP options) wrapped
    again in a new DDP over the default group, with rank ``src``'s weights (which in
    DDP every rank holds already); the old wrapper's hooks are removed."""
    _agree(namespace, wrapped, src)
    for name, options in wrapped.items():
        old = namespace[name]
        if isinstance(old, DDP) and hasattr(old, "reducer"):
            old._remove_autograd_hooks()  # (an alias of the old wrapper syncs nothing now)
        module = _module_of(old)
        _sync_from(module, src, options.get("broadcast_buffers", True))
        namespace[name] = wrap(module, options)
        del old  # (its hooks removed, the old wrapper and its reducer go with it: no cycle)
    return sorted(wrapped)
