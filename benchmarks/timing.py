"""The benchmarks' one way to time a step: the median of ``repeat`` runs."""

from __future__ import annotations

import statistics
import time


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
