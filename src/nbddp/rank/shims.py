"""torchrun scripts unchanged: ``init_process_group`` and friends as a script expects them.

With the pool's group up, a compatible ``init_process_group`` goes on with it
and an incompatible one says what differs; after the script destroyed the group
(``destroy_process_group``), it is formed again, through the notebook, on a new
store. A cell that ends with the group destroyed gets it re-formed by the pool
(``Done.needs_group``). Subgroups a cell makes open sockets of their own: they
are remembered too, so an abort frees a collective blocked on them.
"""

from __future__ import annotations

import time

import torch.distributed as dist

from .ddp import differences
from .group import GroupKeeper, open_sockets

__all__ = ["install"]


def install(keeper: GroupKeeper) -> None:
    """Replace torch.distributed's group functions, for the rank ``keeper`` keeps."""
    c10d = dist.distributed_c10d
    init_process_group = _init_shim(keeper, c10d.init_process_group)
    destroy_process_group = _destroy_shim(keeper, c10d.destroy_process_group)
    for module in (dist, c10d):
        module.init_process_group = init_process_group
        module.destroy_process_group = destroy_process_group
    c10d._new_process_group_helper = _helper_shim(keeper, c10d._new_process_group_helper)


def _init_shim(keeper: GroupKeeper, real_init):
    def init_process_group(
        backend=None,
        init_method=None,
        timeout=None,
        world_size=-1,
        rank=-1,
        store=None,
        group_name="",
        pg_options=None,
        device_id=None,
        **kwargs,
    ):
        if keeper.joining:
            return real_init(
                backend,
                init_method,
                timeout,
                world_size,
                rank,
                store,
                group_name,
                pg_options,
                device_id,
                **kwargs,
            )
        if not dist.is_initialized():
            keeper.join(fresh=True)
            keeper.old_groups = []  # the script's own new group: nothing to bind anew
            return None
        _refuse_differences(keeper, backend, world_size, rank, device_id)
        return None

    init_process_group.__doc__ = real_init.__doc__
    return init_process_group


def _refuse_differences(keeper: GroupKeeper, backend, world_size, rank, device_id) -> None:
    ctx = keeper.ctx
    found = differences(
        ctx.backend,
        ctx.world_size,
        ctx.rank,
        ctx.device,
        backend,
        world_size,
        rank,
        device_id,
    )
    if found:
        raise ValueError(
            "init_process_group: this rank is already in the pool's process group, "
            f"and the call asks for {'; '.join(found)} (restart the pool to match: "
            "%ddp start ...)"
        )


def _destroy_shim(keeper: GroupKeeper, real_destroy):
    def destroy_process_group(group=None):
        if group is None and dist.is_initialized() and not keeper.old_groups:
            keeper.old_groups = keeper.groups()  # the re-form binds their DDP models anew
        # gloo's worker threads drop finished work under the GIL; a group freed later
        # (with its DDP model) joins them while holding the GIL, and would wait forever
        # for one still dropping work (torch; under torchrun the process exits instead).
        time.sleep(0.05)  # releases the GIL: they finish now
        return real_destroy(group)

    destroy_process_group.__doc__ = real_destroy.__doc__
    return destroy_process_group


def _helper_shim(keeper: GroupKeeper, real_helper):
    def _new_process_group_helper(*args, **kwargs):
        before = open_sockets()
        try:
            return real_helper(*args, **kwargs)
        finally:
            keeper.sockets.update(
                (fd, ino) for fd, ino in open_sockets().items() if before.get(fd) != ino
            )

    return _new_process_group_helper
