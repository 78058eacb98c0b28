"""Folding's cost per line, before and after issue 38: ``python benchmarks/bench_fold.py``.

The Folder of commit 461c31c (``fold_baseline.py``, kept as it was) and today's, side by
side in one run, at 8, 64 and 1,024 ranks, on the notebook's CPU (``time.process_time``).
Two cells, each ~80,000 lines fed as the pool gives them (one read per rank per step,
the ranks in a different order at each step, 0.1 ms of clock between reads, ``due`` after
each read as the sinks call it, ``flush`` at the end):

- ``training``: each rank prints its own loss line and then a shared line
  (``rank 3 step 7 loss 0.4121``, ``step 7 done``) -- the cell of the issue;
- ``shared``: every rank prints the same line;
- ``burst``: each rank prints its lines in a loop that the pool reads 1,000 lines at a
  time (``line 0`` ... ``line 9999``), one rank after the other: like lines from one
  rank that all wait at once (before the fix of this case, each line searched every
  waiting line of its shape: 1,500 lines from one rank took 23 s).

It also counts the lines shown: the baseline shows every own line apart and, in the
training cell, every shared line once per rank; today's shows one line per step each.

Then the live tqdm bars (today's only: the baseline had none): each rank's bar updated
200 times through ``Folder.output`` (the floor beside it: the same chunks through a
``Lines`` alone), and ``Folder.bars`` (the one folded bar a render draws) per call.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fold_baseline

from nbddp.dashboard.fold import Folder, Lines
from nbddp.wire import protocol as P

LINES = 80_000


def cell(kind: str, ranks: int, seed: int = 0):
    """The reads of one cell: (rank, lines) per read, steps in a shuffled rank order."""
    rng = random.Random(seed)
    if kind == "burst":
        each = LINES // ranks
        return [
            (rank, [f"line {i}" for i in range(start, min(each, start + 1000))])
            for rank in range(ranks)
            for start in range(0, each, 1000)
        ]
    per_step = 2 if kind == "training" else 1
    steps = max(2, LINES // (ranks * per_step))
    reads = []
    for step in range(steps):
        order = list(range(ranks))
        rng.shuffle(order)
        for rank in order:
            if kind == "training":
                loss = f"{rng.random():.4f}"
                reads.append((rank, [f"rank {rank} step {step} loss {loss}", f"step {step} done"]))
            else:
                reads.append((rank, [f"step {step} done"]))
    return reads


def measure(folder_class, reads, ranks: int) -> dict:
    f = folder_class(range(ranks))
    now, shown, fed = 0.0, 0, 0
    t0 = time.process_time()
    for rank, lines in reads:
        now += 0.0001
        shown += len(f.feed_lines(rank, "stdout", lines, now))
        shown += len(f.due(now))
        fed += len(lines)
    shown += len(f.flush())
    took = time.process_time() - t0
    return {"us_per_line": 1e6 * took / fed, "lines": fed, "shown": shown}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 64, 1024])
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    rows = []
    print(f"{'cell':>9} {'ranks':>6} {'before us/line':>15} {'after us/line':>14} {'ratio':>6}"
          f" {'shown before':>13} {'shown after':>12}")  # fmt: skip
    for kind in ("training", "shared", "burst"):
        for ranks in args.ranks:
            reads = cell(kind, ranks)
            before = measure(fold_baseline.Folder, reads, ranks)
            after = measure(Folder, reads, ranks)
            rows.append({"cell": kind, "ranks": ranks, "before": before, "after": after})
            print(
                f"{kind:>9} {ranks:>6} {before['us_per_line']:>15.2f} "
                f"{after['us_per_line']:>14.2f} "
                f"{after['us_per_line'] / before['us_per_line']:>6.2f} "
                f"{before['shown']:>13} {after['shown']:>12}"
            )
    print(f"\n{'bars':>9} {'ranks':>6} {'output us/chunk':>16} {'floor us':>9} {'bars() ms':>10}")
    for ranks in args.ranks:
        bars = measure_bars(ranks)
        rows.append({"cell": "bars", "ranks": ranks, **bars})
        print(
            f"{'bars':>9} {ranks:>6} {bars['us_per_chunk']:>16.2f} {bars['floor_us']:>9.2f} "
            f"{bars['bars_ms']:>10.3f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


def measure_bars(ranks: int, updates: int = 200) -> dict:
    """Every rank's tqdm bar updated ``updates`` times, rank by rank; ``bars()`` after each
    round, as a render would call it."""
    chunks = [
        f"\rtrain: {u // 2:>3}%|{'#' * (u // 20):<10}| {u}/{updates} [00:01<00:01, 9.8it/s]"
        for u in range(updates)
    ]
    events = [P.Output(rank, "stderr", chunk) for chunk in chunks for rank in range(ranks)]
    floor = {rank: Lines() for rank in range(ranks)}
    t0 = time.process_time()
    for event in events:
        floor[event.rank].feed(event.text)
    floor_took = time.process_time() - t0
    f, took, drawn, calls = Folder(range(ranks)), 0.0, 0.0, 0
    for i in range(0, len(events), ranks):
        t0 = time.process_time()
        for event in events[i : i + ranks]:
            f.output(event)
        t1 = time.process_time()
        f.bars()
        took, drawn, calls = took + t1 - t0, drawn + time.process_time() - t1, calls + 1
    return {
        "us_per_chunk": 1e6 * took / len(events),
        "floor_us": 1e6 * floor_took / len(events),
        "bars_ms": 1e3 * drawn / calls,
    }


if __name__ == "__main__":
    main()
