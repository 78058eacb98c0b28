"""``%%ddp --profile``: which rank is slow, and where.

Each rank runs the cell under torch's profiler (``--profile``), or under
cProfile (``--profile python``), and reports its wall time, its time inside
torch.distributed collectives (waiting for its peers included), and its top
operations. The notebook prints one line per rank and marks the slowest: the
rank with the most time outside collectives is the one the others wait for.

Collective time is measured around the ``torch.distributed`` functions a cell
calls (``dist.all_reduce(t)``); collectives that run inside C++ (DDP's gradient
buckets) show up in the time of the call that waits for them (``backward``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import time

from ..wire import protocol as P

__all__ = ["COLLECTIVES", "profiled", "report"]

COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "monitored_barrier",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "send",
)
TOP = 5


@contextlib.contextmanager
def _timed_collectives(spent: list[float]):
    """While inside: ``torch.distributed``'s collectives add their wall time to ``spent``."""
    import torch.distributed as dist

    originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

    def timed(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - t0

        return wrapper

    for name, fn in originals.items():
        setattr(dist, name, timed(fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


@contextlib.contextmanager
def _quiet_stderr():
    """File descriptor 2 goes nowhere inside (what C++ code says about itself)."""
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def profiled(kind: str, run):
    """``run()`` under the profiler ``kind`` ("torch" | "python"): (its value, a Profile)."""
    spent = [0.0]
    if kind == "python":
        import cProfile
        import pstats

        prof = cProfile.Profile()
        with _timed_collectives(spent):
            t0 = time.perf_counter()
            prof.enable()
            try:
                value = run()
            finally:
                prof.disable()
                wall = time.perf_counter() - t0
        stats = pstats.Stats(prof).stats  # (file, line, name) -> (cc, calls, tottime, ...)
        rows = [
            (f"{name} ({file.rsplit('/', 1)[-1]}:{line})", s[1], s[2])
            for (file, line, name), s in stats.items()
            if not (name == "wrapper" and file == __file__)
        ]
    else:
        import torch
        from torch.profiler import ProfilerActivity, profile

        gpu = torch.cuda.is_available()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
        prof = profile(activities=activities)
        with _timed_collectives(spent):
            with _quiet_stderr():  # kineto's "profiler_start" line is not the cell's output
                prof.start()
            t0 = time.perf_counter()  # (nor is the profiler's own start in its time)
            try:
                value = run()
            finally:
                wall = time.perf_counter() - t0
                with _quiet_stderr():
                    prof.stop()
        rows = []
        for e in prof.key_averages():
            device = getattr(e, "self_device_time_total", 0) if gpu else 0
            rows.append((e.key, e.count, (device or e.self_cpu_time_total) / 1e6))
    top = tuple(sorted(rows, key=lambda r: r[2], reverse=True)[:TOP])
    return value, P.Profile(kind, wall, spent[0], top)


def report(profiles: dict[int, P.Profile]) -> str:
    """One line per rank: wall time, time in collectives, top operations; the slowest marked."""
    if not profiles:
        return ""
    kind = next(iter(profiles.values())).kind
    slowest = max(profiles, key=lambda r: profiles[r].wall - profiles[r].collectives)
    what = (
        "cProfile, top functions by own time"
        if kind == "python"
        else ("torch profiler, top operations by self time")
    )
    lines = [f"profile ({what}):"]
    for rank, p in sorted(profiles.items()):
        share = 100 * p.collectives / p.wall if p.wall > 0 else 0.0
        top = ", ".join(
            f"{name} {seconds * 1000:.1f} ms x{calls}" for name, calls, seconds in p.top
        )
        mark = (
            f"  <- slowest: {p.wall - p.collectives:.3f} s outside collectives"
            if rank == slowest and len(profiles) > 1
            else ""
        )
        lines.append(
            f"  rank {rank}: {p.wall:.3f} s, in collectives {p.collectives:.3f} s ({share:.0f}%)"
            f"{mark}\n      {top}"
        )
    return "\n".join(lines)
