"""Where a rank is in each process group's sequence of collectives, for deadlock checks.

torch numbers the operations of every process group in the backend itself
(``ProcessGroup._get_sequence_number_for_group``): the count goes up as an
operation is issued, whoever issues it (Python, DDP's reducer and buffer
broadcast in C++, FSDP, a device mesh's subgroups), for gloo and NCCL alike,
and reading it costs well under a microsecond. Collectives are called by every
member of a group, so two members' counts can be compared; point-to-point
operations are not (gloo counts them too, on the two ranks involved only), so a
group that carried one since it was formed is marked and never judged
(:func:`install` wraps torch's send/recv functions to see them; NCCL's count
leaves them out, but the mark is kept for both). The pool compares the counts
(:mod:`nbddp.pool.deadlock`); this module only reads them.

Only the main thread's operations are counted. A thread of the cell's keeps issuing
after the cell has ended (``torch.distributed.checkpoint.async_save``'s, a metrics
thread's all_reduce), so a finished rank's backend count is not final: the pool
would take a peer whose thread is one operation ahead for one left behind. The
collectives' Python functions count what other threads issue, per group, and
:func:`positions` says the backend's count less those; a group a thread is issuing
on at that moment is not comparable for that sample (marked like a point-to-point
one). What threads issue from C++ alone (DDP's reducer on CUDA's autograd threads,
within the main thread's ``backward``) is counted as the main thread's.
"""

from __future__ import annotations

import functools
import inspect
import threading
import weakref
from types import FrameType

import torch.distributed as dist

__all__ = ["Position", "call_group", "call_shape", "install", "positions", "thread_ops"]

# (group name, its members' global ranks, () for the default group; operations the main
#  thread issued; True when not comparable: a point-to-point operation went through it,
#  or a thread was issuing on it as it was read)
Position = tuple[str, tuple[int, ...], int, bool]

# torch's point-to-point functions, and where each takes its group (None: in its ops)
_P2P = {
    "send": 2, "recv": 2, "isend": 2, "irecv": 2, "send_object_list": 2,
    "recv_object_list": 2, "batch_isend_irecv": None, "monitored_barrier": 0,
}  # fmt: skip
_p2p_groups: weakref.WeakSet = weakref.WeakSet()

# the collectives that issue one operation each (the object ones call these)
_ONE_OP = (
    "all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
    "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
    "gather", "scatter", "barrier",
)  # fmt: skip
_lock = threading.Lock()
_issued: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # group -> by threads
_busy: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # group -> threads in one now
_main: threading.Thread | None = None


def _mark(fn, group_arg: int | None):
    @functools.wraps(fn)
    def p2p(*args, **kwargs):
        if group_arg is None:  # batch_isend_irecv: a list of P2POp, each with its group
            for op in args[0] if args else kwargs.get("p2p_op_list", ()):
                _p2p_groups.add(getattr(op, "group", None) or dist.group.WORLD)
        else:
            group = kwargs.get("group", args[group_arg] if len(args) > group_arg else None)
            _p2p_groups.add(group or dist.group.WORLD)
        return fn(*args, **kwargs)

    return p2p


def _counted(fn):
    """``fn`` (a collective of one operation) counting what threads but the main one issue."""
    names = list(inspect.signature(fn).parameters)
    at = names.index("group") if "group" in names else None
    main = _main

    @functools.wraps(fn)
    def collective(*args, **kwargs):
        if threading.current_thread() is main:
            return fn(*args, **kwargs)
        group = kwargs.get("group", args[at] if at is not None and len(args) > at else None)
        pg = group if group is not None else dist.group.WORLD
        with _lock:  # counted before the backend's count moves, and marked busy until then
            _issued[pg] = _issued.get(pg, 0) + 1
            _busy[pg] = _busy.get(pg, 0) + 1
        try:
            return fn(*args, **kwargs)
        finally:
            with _lock:
                _busy[pg] -= 1

    return collective


def install() -> None:
    """See every point-to-point operation a cell issues (its group is then not judged),
    and every collective a thread other than this one (the rank's main) issues."""
    global _main
    _main = threading.current_thread()
    c10d = dist.distributed_c10d
    shims = [(name, lambda real, g=g: _mark(real, g)) for name, g in _P2P.items()]
    for name, make in shims + [(name, _counted) for name in _ONE_OP]:
        real = getattr(c10d, name, None)
        if real is None or getattr(real, "_nbddp_seq", False):
            continue
        shim = make(real)
        shim._nbddp_seq = True  # type: ignore[attr-defined]
        for module in (dist, c10d):
            if getattr(module, name, None) is real:
                setattr(module, name, shim)


def thread_ops() -> int:
    """Operations threads other than the main one have issued, on every group: a cell
    that changed it issued collectives, though not from its own thread."""
    with _lock:
        return sum(_issued.values())


def _by_threads(pg) -> tuple[int, bool]:
    with _lock:
        return _issued.get(pg, 0), _busy.get(pg, 0) > 0


def positions() -> tuple[Position, ...]:
    """This rank's count of operations issued on each group it belongs to (none when no
    group is up). Read from any thread: a few calls into the backend, no Python stack."""
    if not dist.is_initialized():
        return ()
    world, out = dist.group.WORLD, []
    for pg, name in list(dist.distributed_c10d._world.pg_names.items()):
        members = dist.distributed_c10d._world.pg_group_ranks.get(pg)
        before, busy = _by_threads(pg)
        try:
            seq = int(pg._get_sequence_number_for_group())
        except Exception:  # a backend that keeps no count, a group torn down meanwhile
            continue
        after, busy_after = _by_threads(pg)
        # (a thread's operation counted on one side of the backend's read only: not exact)
        unsure = busy or busy_after or after != before
        if members:
            ranks = () if pg is world else tuple(sorted(members))
            out.append((str(name), ranks, seq - before, pg in _p2p_groups or unsure))
    return tuple(out)


# collectives whose tensor must be the same size and dtype on every member, and the
# argument that holds it (all_to_all, gather, scatter... may differ by design: not read)
_SAME_SHAPE = {
    "all_reduce": "tensor", "broadcast": "tensor", "reduce": "tensor", "all_gather": "tensor",
    "all_gather_into_tensor": "input_tensor", "reduce_scatter_tensor": "input",
}  # fmt: skip


def _c10d_frame(frame: FrameType | None) -> FrameType | None:
    while frame is not None and not frame.f_code.co_filename.endswith("distributed_c10d.py"):
        frame = frame.f_back
    return frame


def call_group(frame: FrameType | None) -> str | None:
    """The group the torch.distributed call innermost in ``frame``'s stack is on (a
    thread's frame, read from another thread), or None when it is in none."""
    frame = _c10d_frame(frame)
    if frame is None:
        return None
    group = frame.f_locals.get("group", None)
    pg = group if group is not None else dist.group.WORLD
    name = dist.distributed_c10d._world.pg_names.get(pg)
    return None if name is None else str(name)


def call_shape(frame: FrameType | None) -> tuple[int, str] | None:
    """(elements, dtype) of the tensor the torch.distributed call innermost in ``frame``'s
    stack passes, for the calls that need the same on every member; read only when a
    sample finds the rank in one (nothing on the collective's own path)."""
    frame = _c10d_frame(frame)
    arg = _SAME_SHAPE.get(frame.f_code.co_name) if frame is not None else None
    tensor = frame.f_locals.get(arg) if arg else None
    try:
        return int(tensor.numel()), str(tensor.dtype).removeprefix("torch.")
    except Exception:  # not a tensor (a wrapper, a subclass that refuses): not judged
        return None
