"""An attached pool in a detached supervisor beside one in the kernel, in one run:
``python benchmarks/bench_attach_detached.py``.

Simulated ranks (tests/simranks.py: processes that speak nbddp's protocol over the
connections torchrun ranks open, through nbddp's relay, 8 ranks to a simulated host)
attach to an in-kernel pool (``%ddp attach``) and to a detached one (``%ddp attach
--detached``), at 8 and 1,024 ranks. For each: a trivial cell's round trip (``x = 1``,
median of the alternating rounds), the notebook's own CPU per cell
(``time.process_time`` of this process, which plays the kernel), and for the detached
pool its supervisor's CPU per cell (where the pool's core now works). Targets
(DESIGN.md): at 1,024 ranks a trivial cell's p50 <= 50 ms and the notebook's CPU
<= 10 ms per cell.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import simranks  # noqa: E402
from nbddp.detached import client as D  # noqa: E402
from nbddp.detached import messages as W  # noqa: E402
from nbddp.notebook import remote  # noqa: E402
from nbddp.pool.facade import Pool  # noqa: E402


def cells(pool, reps: int) -> list[tuple[float, float]]:
    """``reps`` trivial cells: (wall s, this process's CPU s) of each."""
    out = []
    for _ in range(reps):
        c0, t0 = time.process_time(), time.perf_counter()
        for _event in pool.run("x = 1"):
            pass
        out.append((time.perf_counter() - t0, time.process_time() - c0))
    return out


def in_kernel(n: int, procs: int) -> tuple[Pool, list]:
    token = secrets.token_bytes(16)
    pool = Pool(n, listen=("127.0.0.1", 0), token=token, start_timeout=300)
    sims = simranks.start(pool.listen(), token, n, procs=min(procs, n), relay=True)
    pool.start()
    return pool, sims


def detached(n: int, procs: int, token_file: str) -> tuple[object, list, psutil.Process]:
    token = remote.read_or_create_token(token_file)
    sims: list = []

    def watch(folder: str) -> None:  # the ranks, once its supervisor listens
        path = os.path.join(folder, W.ADDRESS)
        if not sims and os.path.exists(path):
            with open(path) as f:
                sims.extend(simranks.start(f.read(), token, n, procs=min(procs, n), relay=True))

    name = f"bench{n}"
    pool = D.start(
        name,
        n,
        timeout=400,
        attach={"token_file": token_file, "tls": False},
        watch=watch,
        listen=("127.0.0.1", 0),
        start_timeout=300,
    )
    with open(os.path.join(W.folder_of(name), "info.json")) as f:
        supervisor = psutil.Process(json.load(f)["pid"])
    return pool, sims, supervisor


def compare(n: int, args, token_file: str) -> dict:
    local, sims_a = in_kernel(n, args.procs)
    far, sims_b, supervisor = detached(n, args.procs, token_file)
    runs: dict[str, list] = {"in-kernel": [], "detached": []}
    sup_cpu = 0.0
    try:
        cells(local, 5), cells(far, 5)  # warm both
        for _ in range(args.rounds):
            runs["in-kernel"] += cells(local, args.reps)
            s0 = sum(supervisor.cpu_times()[:2])
            runs["detached"] += cells(far, args.reps)
            sup_cpu += sum(supervisor.cpu_times()[:2]) - s0
    finally:
        local.stop()
        far.stop()
        for s in sims_a + sims_b:
            s.wait(60)
    row = {}
    for kind, got in runs.items():
        row[kind] = {
            "round_trip_ms": 1e3 * statistics.median(w for w, _ in got),
            "notebook_cpu_ms": 1e3 * statistics.median(c for _, c in got),
        }
    row["detached"]["supervisor_cpu_ms"] = 1e3 * sup_cpu / len(runs["detached"])
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="8,1024")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=20, help="cells per round and pool")
    parser.add_argument("--procs", type=int, default=4, help="processes serving simulated ranks")
    parser.add_argument("--json")
    args = parser.parse_args()
    home = tempfile.mkdtemp(prefix="nbddp-bench-")
    os.environ["NBDDP_HOME"] = home
    token_file = os.path.join(home, "token")
    results = {}
    for n in [int(x) for x in args.ranks.split(",") if x]:
        results[n] = compare(n, args, token_file)
        print(n, results[n], flush=True)
    print("\nranks  pool        round trip ms  notebook CPU ms  supervisor CPU ms")
    for n, row in results.items():
        for kind, r in row.items():
            sup = r.get("supervisor_cpu_ms")
            print(
                f"{n:>5}  {kind:<10} {r['round_trip_ms']:14.1f} {r['notebook_cpu_ms']:16.2f} "
                f"{'' if sup is None else f'{sup:17.2f}'}"
            )
        ratio = row["detached"]["round_trip_ms"] / row["in-kernel"]["round_trip_ms"]
        print(f"       detached / in-kernel round trip: {ratio:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
