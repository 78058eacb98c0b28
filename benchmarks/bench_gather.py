"""Gathering to one rank, side by side: ``python benchmarks/bench_gather.py [--ranks 4]
[--mb 64] [--repeat 5]``.

Every rank holds a config and ``--mb`` MB of weights; all of them go to rank 0, which
reads every page of what it got (so lazily mapped pages are counted). Timed inside the
ranks, from a barrier to a barrier, median of ``--repeat``:

1. ``nbddp.gather_objects`` through shared memory (one host, the default);
2. the same through a workspace folder (``--workspace``, a temporary folder on this
   machine's disk by default: give an NFS path to measure a real share);
3. the same through the process group (the path across hosts without a workspace);
4. torch's own ``dist.gather_object``, the peer (what 3 costs without nbddp);
5. the floor: rank 0 copying the other ranks' weights once in its own memory.

Then ``gather_tensors`` of ``--mb`` MB tensors through shared memory and a workspace,
beside ``dist.gather`` (gloo), and ``Pool.copy`` of ``--mb`` MB to every other rank
through shared memory and through a workspace.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

SETUP = """
import os, time, statistics, torch, torch.distributed as dist
from nbddp import gather_objects, gather_tensors

def timed(call, repeat):
    times = []
    for _ in range(repeat + 1):  # the first is a warm-up
        dist.barrier()
        t0 = time.perf_counter()
        call()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])

def touch(out):  # read every page rank 0 got
    for o in out:
        w = o["w"] if isinstance(o, dict) else o
        float(w[:: 1024].sum())

def via_group(call):
    os.environ["LOCAL_WORLD_SIZE"] = "1"
    try:
        return call()
    finally:
        os.environ["LOCAL_WORLD_SIZE"] = str(world_size)

obj = {"config": {"layer": rank, "dims": [4096, 4096]}, "w": torch.full((NUMEL,), float(rank))}
"""

CASES = {
    "gather_objects, shared memory": "touch(gather_objects(obj))",
    "gather_objects, workspace": "touch(gather_objects(obj, workspace=WS))",
    "gather_objects, process group": "touch(via_group(lambda: gather_objects(obj)))",
    "torch dist.gather_object (peer)": (
        "out = [None] * world_size if rank == 0 else None\n"
        "    dist.gather_object(obj, out, dst=0)\n"
        "    touch(out or [])"
    ),
    "floor: rank 0 copies the others' weights": (
        "touch([obj['w'].clone() for _ in range(world_size - 1)] if rank == 0 else [])"
    ),
    "gather_tensors, shared memory": "touch(gather_tensors(obj['w']))",
    "gather_tensors, workspace": "touch(gather_tensors(obj['w'], workspace=WS))",
    "torch dist.gather (gloo, peer)": (
        "out = [torch.empty_like(obj['w']) for _ in range(world_size)] if rank == 0 else None\n"
        "    dist.gather(obj['w'], out, dst=0)\n"
        "    touch(out or [])"
    ),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--mb", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--workspace", help="a folder (default: a temporary one on disk)")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    from nbddp import Pool

    numel = args.mb * 2**20 // 4
    base = args.workspace or tempfile.mkdtemp(prefix="bench-gather-", dir=os.getcwd())
    ws = os.path.join(base, "ws")
    figures: dict[str, float] = {}
    with Pool(args.ranks) as pool:
        pool.execute(f"WS = {ws!r}\nNUMEL = {numel}\n" + SETUP)
        for name, code in CASES.items():
            seconds = pool.execute(f"def call():\n    {code}\ntimed(call, {args.repeat})")[0]
            figures[name] = seconds
        pool.execute(f"big = torch.full(({numel},), float(rank))")
        for name, workspace in (("copy, shared memory", None), ("copy, workspace", ws)):
            pool.workspace = workspace
            times = []
            for _ in range(args.repeat + 1):
                t0 = time.perf_counter()
                pool.copy(["big"], 0)
                times.append(time.perf_counter() - t0)
            figures[name] = sorted(times[1:])[len(times[1:]) // 2]
        pool.workspace = None
    if not args.workspace:
        import shutil

        shutil.rmtree(base, ignore_errors=True)
    peer = figures["torch dist.gather_object (peer)"]
    floor = figures["floor: rank 0 copies the others' weights"]
    print(f"{args.ranks} ranks, {args.mb} MB each, to rank 0 (median of {args.repeat})")
    print(f"{'':44} {'seconds':>9} {'÷ peer':>8} {'÷ floor':>8}")
    for name, s in figures.items():
        print(f"{name:44} {s:9.3f} {s / peer:8.2f} {s / floor:8.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ranks": args.ranks, "mb": args.mb, "seconds": figures}, f, indent=1)


if __name__ == "__main__":
    main()
