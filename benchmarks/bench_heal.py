"""``--heal`` figures: ``python benchmarks/bench_heal.py [--ranks 4 8] [--mb 100]``.

Every rank holds a DDP model of about ``--mb`` MB and its Adam optimizer (after one
step: two more tensors per parameter, so 3x the model's bytes in all). Rank N-2 (rank 1
of 2: never rank 0, the heal's source) prints the time and SIGKILLs itself while the
others wait in ``all_reduce``. For each world size, side by side:

- ``replace``: the pool without ``--heal`` (a new process takes the dead rank's
  place, fresh: the model and optimizer are gone on it);
- ``heal``: ``Pool(heal=["model", "opt"])``: the same, then the new rank gets rank
  0's model and optimizer and every rank wraps the model in DDP again, before the
  cell ends.

Figures: seconds from the death to the cell's end in the notebook (the group is
ready, healed or not, when the cell ends), the heal's own seconds (as its note says),
and seconds of the next cell (one DDP training step on every rank), whose weights
are checked equal on every rank. For ``replace``, the same heal by hand, in its
parts: the new rank's ``import torch._dynamo`` (torch imports it to build any DDP
wrapper: most of a heal's time), then ``Pool.copy(["model", "opt"], 0, [N-2])``. Results go to
``benchmarks/results/heal-<ranks>ranks-<cores>cpu.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time

from nbddp import Pool
from nbddp.wire import protocol as P

MODEL = """
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
width = {width}
model = DDP(torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(6)]))
opt = torch.optim.Adam(model.parameters(), lr=1e-4)
"""
STEP = (  # (a healed rank has model and opt, not width: the step names the size itself)
    "loss = model(torch.ones(4, {width}) * (rank + 1)).pow(2).mean()\nloss.backward()\n"
    "opt.step()\nopt.zero_grad()\n"
)
DIE = (
    "import os, time\nt = torch.ones(1)\n"
    "if rank == {bad}:\n    print('DIED_AT', time.time(), flush=True)\n"
    "    os.kill(os.getpid(), 9)\ndist.all_reduce(t)"
)
HEALED = re.compile(r"healed from rank \d+ in ([\d.]+) s")


def _width(mb: float) -> int:
    """Six square layers of about ``mb`` MB in all (float32, with biases)."""
    return int((mb * 2**20 / 4 / 6) ** 0.5)


def one(n: int, heal: bool, mb: float) -> dict:
    width = _width(mb)
    with Pool(n, grace=2.0, heal=["model", "opt"] if heal else None) as pool:
        step = STEP.format(width=width)
        pool.execute(MODEL.format(width=width) + step)
        size = pool.execute("sum(p.numel() * 4 for p in model.parameters()) / 2**20")[0]
        bad = max(n - 2, 1)  # (not rank 0: the heal's source)
        died, end = None, None
        for event in pool.run(DIE.format(bad=bad)):
            if isinstance(event, P.Output) and "DIED_AT" in event.text:
                died = float(event.text.split()[1])
            if isinstance(event, P.CellEnd):
                end = event
        ended = time.time()
        took = [float(m.group(1)) for note in end.notes if (m := HEALED.search(note))]
        row = {
            "ranks": n,
            "mode": "heal" if heal else "replace",
            "model_mb": round(size, 1),
            "death_to_ready_s": round(ended - died, 3),
            "heal_s": took[0] if took else None,
            "notes": list(end.notes),
        }
        t0 = time.monotonic()
        if not heal:  # the same heal by hand, in its parts: torch._dynamo, then the copy
            pool.execute("import torch._dynamo", ranks=[bad])
            row["dynamo_import_s"] = round(time.monotonic() - t0, 3)
            row["copy_s"] = round(pool.copy(["model", "opt"], 0, [bad]).seconds, 3)
            t0 = time.monotonic()
        weights = pool.execute(step + "[p.detach().sum().item() for p in model.parameters()]")
        assert len({tuple(w) for w in weights}) == 1, "the ranks' weights differ"
        row["next_cell_s"] = round(time.monotonic() - t0, 3)
        return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--mb", type=float, default=100.0)
    args = parser.parse_args()
    if min(args.ranks) < 2:
        parser.error("--ranks: 2 or more each (rank 0 is the heal's source, another one dies)")
    rows = []
    for n in args.ranks:
        for heal in (False, True):
            row = one(n, heal, args.mb)
            rows.append(row)
            print(
                f"{n} ranks  {row['mode']:8} model {row['model_mb']:.0f} MB  death -> ready "
                f"{row['death_to_ready_s']:.2f} s  heal {row['heal_s']}  by hand: dynamo "
                f"{row.get('dynamo_import_s')} s, copy {row.get('copy_s')} s  next cell "
                f"(a DDP step) {row['next_cell_s']:.2f} s",
                flush=True,
            )
    cores = os.cpu_count()
    name = f"heal-{'-'.join(map(str, args.ranks))}ranks-{cores}cpu.json"
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", name)
    with open(path, "w") as f:
        json.dump({"cores": cores, "rows": rows}, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
