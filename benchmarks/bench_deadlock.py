"""Deadlocks, side by side: ``python benchmarks/bench_deadlock.py [--ranks 2 4 8]``.

1. For each pattern (nbddp.pool.deadlock), at each world size, on gloo: seconds from the
   moment the deadlock is certain to the cell's end in the notebook (the abort, the
   re-form and the error included). Every rank prints ``time.time()`` just before its
   last statement; the deadlock is certain once every rank has got there (the latest
   of those times), so the figure is an upper bound. Goal: <= 2 s.
2. What the bookkeeping costs, with detection on and off (``NBDDP_DEADLOCKS=0``) in
   the same run: the trivial cell's round trip at 4 ranks, and the DDP step of
   ``bench_step.py`` against torchrun (target <= 1.02).
3. A soak: ``--soak`` mixed trivial cells with random delays at 3 ranks; aborts counted
   (must be 0).
4. At ``--simulated`` simulated ranks (tests/simranks.py, through host relays), the
   notebook's cost per cell, detection on and off, interleaved: a trivial cell, and a
   cell whose ranks finish 0.3 s apart (the finished ranks are then asked for their
   counts every 0.25 s): wall ms and the notebook's own CPU ms.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from bench_step import in_pool, script_args, under_torchrun

SETUP = (
    "import time, torch, torch.distributed as dist\n"
    "from torch.nn.parallel import DistributedDataParallel as DDP\n"
    "model = DDP(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)))\n"
    "x = torch.randn(8, 4)\n"
)
AT = "print('AT', time.time(), flush=True)\n"
PATTERNS = {  # name: (cell, ranks: all but the last when "subset")
    "skipped all_reduce": (AT + "if rank != 1:\n    dist.all_reduce(torch.ones(2))\n", False),
    "extra barrier": (AT + "if rank == 0:\n    dist.barrier()\n", False),
    "broadcast vs all_reduce": (
        AT + "if rank == 0:\n    dist.broadcast(torch.ones(2), 0)\n"
        "else:\n    dist.all_reduce(torch.ones(2))\n",
        False,
    ),
    "DDP forward on rank 0": (AT + "if rank == 0:\n    model(x)\n", False),
    "shapes that differ": (AT + "dist.all_reduce(torch.ones(1 + rank))\n", False),
    "subgroup, one skips": (
        "_g = dist.new_group([0, 1])\n" + AT + "if rank == 0:\n"
        "    dist.all_reduce(torch.ones(2), group=_g)\n",
        False,
    ),
    "--ranks leaves one out": (AT + "dist.all_reduce(torch.ones(2))\n", True),
}
AT_LINE = re.compile(r"AT (\d+\.\d+)")


def one(pool, code: str, ranks) -> float:
    """Seconds from the deadlock being certain to the cell's end."""
    from nbddp.wire import protocol as P

    ats, end_at = [], None
    for event in pool.run(code, ranks=ranks):
        if isinstance(event, P.Output):
            ats += [float(m) for m in AT_LINE.findall(event.text)]
        elif isinstance(event, P.CellEnd):
            end_at = time.time()
            assert event.deadlock, event
    return end_at - max(ats)


def patterns(sizes: list[int], repeat: int) -> dict:
    from nbddp import Pool

    out: dict = {}
    for n in sizes:
        with Pool(n) as pool:
            pool.execute(SETUP)
            for name, (code, subset) in PATTERNS.items():
                ranks = list(range(n - 1)) if subset else None
                times = []
                for _ in range(repeat):
                    if name.startswith("DDP"):
                        pool.execute(SETUP)  # the re-form left the DDP model stale
                    times.append(one(pool, code, ranks))
                out.setdefault(name, {})[n] = statistics.median(times)
    print(f"\nseconds from a certain deadlock to the cell's end (median of {repeat}), gloo")
    print(f"  {'pattern':<26}" + "".join(f"{n:>4} ranks" for n in sizes))
    for name, by_n in out.items():
        print(f"  {name:<26}" + "".join(f"{by_n[n]:>8.2f} s" for n in sizes))
    return out


def _trivial(pool, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        pool.execute("1")
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def costs(repeat: int, steps: int) -> dict:
    """Trivial round trip at 4 ranks and the DDP step at 2, detection on and off."""
    from nbddp import Pool

    out: dict = {"trivial ms, 4 ranks": {}, "DDP step ms, 2 ranks": {}}
    with Pool(4) as four, Pool(2) as two:
        for pool in (four, two):
            pool.execute("1")
        args = script_args(steps, "cpu", "gloo")
        in_pool(two, script_args(10, "cpu", "gloo"), False)
        runs: dict = {k: {"on": [], "off": []} for k in out}
        torchrun = []
        for _ in range(repeat):  # interleaved, so drift hits every column alike
            for mode in ("on", "off"):
                os.environ["NBDDP_DEADLOCKS"] = "1" if mode == "on" else "0"
                runs["trivial ms, 4 ranks"][mode].append(_trivial(four, 200))
                runs["DDP step ms, 2 ranks"][mode].append(in_pool(two, args, False))
            torchrun.append(under_torchrun(2, args))
        os.environ.pop("NBDDP_DEADLOCKS")
    for key, modes in runs.items():
        out[key] = {m: statistics.median(v) for m, v in modes.items()}
    out["DDP step ms, 2 ranks"]["torchrun"] = statistics.median(torchrun)
    print(f"\nwhat the bookkeeping costs (median of {repeat}), on / off (NBDDP_DEADLOCKS=0)")
    for key, by in out.items():
        on, off = by["on"], by["off"]
        line = f"  {key:<22} on {on:7.3f}   off {off:7.3f}   on/off {on / off:.3f}"
        if "torchrun" in by:
            t = by["torchrun"]
            line += f"   torchrun {t:7.3f}   on/torchrun {on / t:.3f}   off/torchrun {off / t:.3f}"
        print(line)
    return out


def soak(cells: int) -> dict:
    from test_deadlock import _soak_cell

    from helpers import collect
    from nbddp import Pool

    rng, aborts, t0 = random.Random(37), 0, time.monotonic()
    with Pool(3) as pool:
        pool.execute("import time, torch, torch.distributed as dist")
        for _ in range(cells):
            _, _, end = collect(pool.run(_soak_cell(rng, 3)))
            aborts += bool(end.deadlock or end.errors or end.notes)
    took = time.monotonic() - t0
    print(f"\nsoak: {cells} mixed cells at 3 ranks in {took:.1f} s: {aborts} aborts")
    return {"cells": cells, "aborts": aborts, "seconds": took}


def simulated(n: int, repeat: int, procs: int = 8) -> dict:
    """Per-cell cost at ``n`` simulated ranks, detection on and off, interleaved."""
    from bench_scale import cell
    from bench_scale import simulated as start

    cells = {"trivial": "x = 1", "apart": "import time\nif rank == 0:\n    time.sleep(0.3)"}
    runs = {(c, m): [] for c in cells for m in ("on", "off")}
    pool, sims, _ = start(n, procs)
    try:
        for _ in range(3):
            cell(pool, "x = 1")
        for _ in range(repeat):
            for mode in ("on", "off"):
                os.environ["NBDDP_DEADLOCKS"] = "1" if mode == "on" else "0"
                for name, code in cells.items():
                    runs[name, mode].append(cell(pool, code))
        os.environ.pop("NBDDP_DEADLOCKS")
    finally:
        pool.stop()
        for sim in sims:
            sim.wait(30)
    out: dict = {}
    print(f"\nat {n} simulated ranks (median of {repeat}), on / off (NBDDP_DEADLOCKS=0)")
    for name in cells:
        on, off = runs[name, "on"], runs[name, "off"]
        wall = [1e3 * statistics.median(r[0] for r in x) for x in (on, off)]
        cpu = [1e3 * statistics.median(r[1] for r in x) for x in (on, off)]
        out[name] = {"wall_ms": wall, "notebook_cpu_ms": cpu}
        print(
            f"  {name:<8} wall on {wall[0]:8.2f} off {wall[1]:8.2f} ({wall[0] / wall[1]:.2f})"
            f"   notebook CPU on {cpu[0]:7.2f} off {cpu[1]:7.2f} ({cpu[0] / cpu[1]:.2f})"
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--soak", type=int, default=1000)
    parser.add_argument("--simulated", type=int, default=1024)
    parser.add_argument("--parts", nargs="+", default=["patterns", "costs", "soak", "simulated"])
    parser.add_argument("--json")
    args = parser.parse_args()
    os.environ.pop("OMP_NUM_THREADS", None)
    results: dict = {"cpus": os.cpu_count()}
    if "patterns" in args.parts:
        results["patterns"] = patterns(args.ranks, args.repeat)
    if "costs" in args.parts:
        results["costs"] = costs(args.repeat, args.steps)
    if "soak" in args.parts and args.soak:
        results["soak"] = soak(args.soak)
    if "simulated" in args.parts:
        results["simulated"] = simulated(args.simulated, args.repeat)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
