"""From an event to the next training cell's first step: ``python benchmarks/bench_keep_training.py
[--ranks 2 4 8] [--repeat 3]``.

A DDP model (six 256-wide layers) and SGD are trained on every rank
(``Pool(heal=["model", "opt"])``). Then an event, and the same training cell again; the
figure is the seconds from the event (the time a rank printed as it failed or died, or
the notebook's call of ``resize``) to the end of the first step of the next training
cell on rank 0 (the time it printed). Side by side, in one run, for each event:

- ``bare``: the same event on a pool holding nothing; the next cell's first step is one
  ``all_reduce`` (a bare re-form: the floor);
- ``keep``: nbddp as it is: the group re-formed, the DDP model bound to it again on every
  rank (a replaced or added rank healed from rank 0, then re-running what it can), and
  the training goes on with the same weights;
- ``restart``: what a user without it does: ``%ddp restart``, the model built again (its
  weights lost), then the first step.

Events: ``error`` (rank 1 raises while the others wait in ``all_reduce``: an abort and
re-form), ``death`` (rank N-1 SIGKILLs itself there: a replacement), ``resize`` (N -> N+1:
a rank added). The median of ``--repeat`` runs; ``keep / bare`` and ``keep / restart``
are printed. Results go to ``benchmarks/results/keep-training-<cores>cpu.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from nbddp import Pool
from nbddp.pool.errors import NbddpError
from nbddp.wire import protocol as P

MODEL = """
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(6)]))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
"""
TRAIN = """
import time
for step in range(3):
    opt.zero_grad()
    loss = model(torch.ones(8, 256) * (rank + 1)).pow(2).mean()
    loss.backward()
    opt.step()
    if step == 0 and rank == 0:
        print('FIRST_STEP', time.time(), flush=True)
"""
BARE = (
    "import time\nimport torch.distributed as dist\ndist.all_reduce(torch.ones(1))\n"
    "if rank == 0:\n    print('FIRST_STEP', time.time(), flush=True)"
)
EVENTS = {
    "error": (
        "import time\nif rank == 1:\n    print('EVENT_AT', time.time(), flush=True)\n"
        "    raise ValueError('bad batch')\ntorch.distributed.all_reduce(torch.ones(1))"
    ),
    "death": (
        "import os, time\nif rank == world_size - 1:\n"
        "    print('EVENT_AT', time.time(), flush=True)\n    os.kill(os.getpid(), 9)\n"
        "torch.distributed.all_reduce(torch.ones(1))"
    ),
}


def _stamp(pool, code: str, word: str) -> float | None:
    """Run ``code``; the time a rank printed after ``word`` (None: none printed it)."""
    at = None
    for event in pool.run(code):
        if isinstance(event, P.Output) and word in event.text:
            at = float(event.text.split(word)[1].split()[0])
    return at


def _event(pool, event: str) -> float:
    """Make ``event`` happen; its time."""
    if event == "resize":
        at = time.time()
        pool.resize(pool.world_size + 1)
        return at
    return _stamp(pool, EVENTS[event], "EVENT_AT")


def one(n: int, event: str, mode: str) -> float:
    """Seconds from ``event`` to the first step of the next cell, for ``mode``."""
    heal = ["model", "opt"] if mode == "keep" else None
    with Pool(n, grace=2.0, heal=heal) as pool:
        work = BARE if mode == "bare" else TRAIN
        if mode != "bare":
            pool.execute(MODEL)
        pool.execute(work)
        at = _event(pool, event)
        if mode == "restart":
            pool.restart()
            pool.execute(MODEL)
        first = _stamp(pool, work, "FIRST_STEP")
        if first is None:
            raise NbddpError(f"{mode} after {event} at {n} ranks: the next cell took no step")
        return first - at


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--events", nargs="+", default=["error", "death", "resize"])
    args = parser.parse_args()
    rows = []
    for n in args.ranks:
        for event in args.events:
            row = {"ranks": n, "event": event}
            for mode in ("bare", "keep", "restart"):
                runs = [one(n, event, mode) for _ in range(args.repeat)]
                row[mode] = round(statistics.median(runs), 3)
            row["keep/bare"] = round(row["keep"] / row["bare"], 2)
            row["keep/restart"] = round(row["keep"] / row["restart"], 2)
            rows.append(row)
            print(json.dumps(row), flush=True)
    out = os.path.join(os.path.dirname(__file__), "results")
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"keep-training-{os.cpu_count()}cpu.json")
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)
    print(
        f"{'ranks':>5} {'event':>7} {'bare s':>7} {'keep s':>7} {'restart s':>9} "
        f"{'keep/bare':>9} {'keep/restart':>12}"
    )
    for r in rows:
        print(
            f"{r['ranks']:>5} {r['event']:>7} {r['bare']:>7.2f} {r['keep']:>7.2f} "
            f"{r['restart']:>9.2f} {r['keep/bare']:>9.2f} {r['keep/restart']:>12.2f}"
        )


if __name__ == "__main__":
    main()
