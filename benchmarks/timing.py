"""The benchmarks' one way to time a step (the median of ``repeat`` runs), and to leave
out a peer that is not installed."""

from __future__ import annotations

import importlib.util
import statistics
import time


def without(peer: str, skipped: bool) -> bool:
    """Whether to run without ``peer`` (a package compared with): asked (``--no-PEER``), or
    not installed here (said in one line, and the rest runs)."""
    if skipped:
        return True
    if importlib.util.find_spec(peer) is None:
        print(f"{peer} is not installed: its figures are left out", flush=True)
        return True
    return False


def timed(fn, repeat: int, warm: bool = True) -> float:
    """Seconds ``fn()`` takes, the median of ``repeat`` runs (after one warm-up run:
    first allocations, first cell, unless ``warm`` is False)."""
    if warm:
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
