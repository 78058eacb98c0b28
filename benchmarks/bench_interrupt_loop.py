"""Interrupts of a loop of collectives, before and after, side by side in one run:
``python benchmarks/bench_interrupt_loop.py [--before REV] [--ranks 2 3 4] [--times 30]``.

Each version (``REV``'s sources, by default the commit before the out-of-step
re-form, and this checkout's) runs on a pool of its own, at each world size,
``--times`` times: a cell looping ``dist.all_reduce`` on 64K floats, interrupted
0, 10 or 50 ms after it is sent, then a cell ``dist.all_reduce(torch.ones(1))``.
Printed per version: the median seconds from the interrupt to the cell's end, and
to the next all_reduce's result (the group ready again); how many interrupts left
the ranks out of step (re-formed by the fixed version); how many cost a rank (a
process replaced, its namespace lost). Then the ratios after/before.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BEFORE = "7f76f1a"  # the last commit before the out-of-step re-form
LOOP = "x = torch.zeros(1 << 16)\nwhile True:\n    x.add_(1)\n    dist.all_reduce(x)"
CHECK = "t = torch.ones(1)\ndist.all_reduce(t)\nt.item()"
DELAYS = (0.0, 0.01, 0.05)


def _interrupt(pool, sent: list[float]) -> None:
    sent.append(time.perf_counter())
    pool.interrupt()


def measure(n: int, times: int) -> dict:
    """In this process (its nbddp is the version under test): the figures at ``n`` ranks."""
    from nbddp import Pool
    from nbddp.wire import protocol as P

    ends, readies, lost, skewed = [], [], 0, 0
    with Pool(n, grace=3.0, device="cpu") as pool:
        pool.execute("import torch.distributed as dist")
        for i in range(times):
            pids = list(pool.pids)
            sent: list[float] = []
            timer = threading.Timer(DELAYS[i % 3], _interrupt, (pool, sent))
            events = pool.run(LOOP)
            timer.start()
            *_, end = (ev for ev in events if isinstance(ev, P.CellEnd))  # (read to its end)
            ended = time.perf_counter()
            timer.join()
            skewed += any("out of step" in note for note in end.notes)
            try:
                pool.execute(CHECK)
            except Exception:
                pass  # a rank died in it (the version before): counted below
            ends.append(ended - sent[0])
            readies.append(time.perf_counter() - sent[0])
            if pool.needs_restart:
                pool.restart()
                pool.execute("import torch.distributed as dist")
            lost += list(pool.pids) != pids
    return {
        "end_s": statistics.median(ends),
        "ready_s": statistics.median(readies),
        "lost": lost,
        "skewed": skewed,
        "times": times,
    }


def _sources(rev: str, into: Path) -> Path:
    data = subprocess.run(
        ["git", "archive", rev, "src"], cwd=ROOT, capture_output=True, check=True
    ).stdout
    with tarfile.open(fileobj=BytesIO(data)) as tar:
        tar.extractall(into, filter="data")
    return into / "src"


def _run(src: Path, n: int, times: int) -> dict:
    env = dict(os.environ, PYTHONPATH=f"{src}{os.pathsep}{ROOT / 'benchmarks'}")
    out = subprocess.run(
        [sys.executable, __file__, "--child", str(n), str(times)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def _line(name: str, r: dict) -> str:
    return (
        f"  {name:<7} interrupt -> end {r['end_s']:.3f} s, -> ready {r['ready_s']:.3f} s; "
        f"out of step {r['skewed']}/{r['times']}, a rank lost {r['lost']}/{r['times']}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default=BEFORE)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--times", type=int, default=30)
    parser.add_argument("--child", type=int, nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(*args.child)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        before = _sources(args.before, Path(tmp))
        for n in args.ranks:
            old = _run(before, n, args.times)
            new = _run(ROOT / "src", n, args.times)
            print(f"{n} ranks, gloo, {args.times} interrupts of a loop of all_reduce (64K floats):")
            print(_line(args.before, old))
            print(_line("this", new))
            print(
                f"  after/before: to end x{new['end_s'] / old['end_s']:.2f}, "
                f"to ready x{new['ready_s'] / old['ready_s']:.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
