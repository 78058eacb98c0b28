"""A detached pool beside an in-kernel one, in one run: ``python benchmarks/bench_detached.py``.

- round trip: a trivial cell (``rank``, its values back) at 4 ranks, the two
  pools measured in alternating rounds (median of each, and the difference;
  target: at most 0.5 ms more detached);
- ``--need`` of a 512 MB CPU tensor to 4 ranks, each pool in turn (target: the
  same within noise: the tensor goes through shared memory, not the supervisor);
- connect: ``Pool.connect(NAME)`` to a detached pool of 8 ranks, to the first
  cell's result (target: at most 1 s);
- a stop while a cell runs (4 ranks, default grace of 3 s): ``stop(NAME)`` from
  another connection, to its answer and to every process gone, for a cell that
  comes back from the interrupt (``time.sleep``) and for one that does not (its
  ranks are killed after the grace period);
- a kernel that stops reading while its cell prints 10 MB: ``listing()`` and a
  takeover (``connect --force``), each timed (target: well under a second; they
  waited forever before).

Pools live in a temporary ``NBDDP_HOME``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import psutil

DEAF = "while True:\n    try:\n        time.sleep(0.1)\n    except KeyboardInterrupt:\n        pass"


def _round_trips(pool, n: int) -> list[float]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        pool.execute("rank")
        times.append(time.perf_counter() - t0)
    return times


def _need(pool, tensor) -> float:
    t0 = time.perf_counter()
    pool.execute("big.shape[0]", needs={"big": tensor})
    return time.perf_counter() - t0


def _stop_running(D, ranks: int, cell: str) -> tuple[float, float]:
    """(s to stop()'s answer, s until every process of the pool is gone) while ``cell`` runs."""
    pool = D.start("benchstop", ranks)
    with open(os.path.join(os.environ["NBDDP_HOME"], "pools", "benchstop", "info.json")) as f:
        supervisor = psutil.Process(json.load(f)["pid"])
    family = [supervisor, *supervisor.children(recursive=True)]
    events = pool.run("import time\nprint('go', flush=True)\n" + cell)
    next(e for e in events if type(e).__name__ == "Output")
    t0 = time.perf_counter()
    D.stop("benchstop")
    answered = time.perf_counter() - t0
    psutil.wait_procs(family, timeout=60)
    return answered, time.perf_counter() - t0


def _deaf_kernel(D, ranks: int) -> tuple[float, float]:
    """(s for listing(), s for connect --force) while the connected kernel reads nothing."""
    pool = D.start("benchdeaf", ranks)
    pool.run("any(print('x' * 200) for _ in range(50_000))")  # never read
    time.sleep(1.0)  # (its socket fills)
    t0 = time.perf_counter()
    assert "benchdeaf" in [p["name"] for p in D.listing()]
    listed = time.perf_counter() - t0
    t0 = time.perf_counter()
    other = D.connect("benchdeaf", force=True)
    taken = time.perf_counter() - t0
    pool.disconnect()
    other.stop()
    return listed, taken


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--cells", type=int, default=200, help="cells per round")
    parser.add_argument("--need-mb", type=int, default=512)
    parser.add_argument("--need-tries", type=int, default=6)
    parser.add_argument("--connect-ranks", type=int, default=8)
    parser.add_argument("--json")
    args = parser.parse_args()
    os.environ["NBDDP_HOME"] = tempfile.mkdtemp(prefix="nbddp-bench-")

    import torch

    from nbddp import Pool
    from nbddp.detached import client as D

    results: dict = {}
    local = Pool(args.ranks).start()
    detached = D.start("bench", args.ranks)
    try:
        _round_trips(local, 50), _round_trips(detached, 50)  # warm both
        rt = {"in-kernel": [], "detached": []}
        for _ in range(args.rounds):
            rt["in-kernel"] += _round_trips(local, args.cells)
            rt["detached"] += _round_trips(detached, args.cells)
        results["round_trip_ms"] = {k: 1e3 * statistics.median(v) for k, v in rt.items()}
        big = torch.ones(args.need_mb * 2**20 // 4)
        need = {"in-kernel": [], "detached": []}
        pools = {"in-kernel": local, "detached": detached}
        for i in range(args.need_tries):  # ABBA: neither always goes first
            for kind in sorted(pools, reverse=i % 2 == 1):
                need[kind].append(_need(pools[kind], big))
        results["need_all_s"] = need
        results["need_s"] = {k: statistics.median(v) for k, v in need.items()}
        results["need_min_s"] = {k: min(v) for k, v in need.items()}
    finally:
        local.stop()
        detached.stop()

    eight = D.start("bench8", args.connect_ranks)
    eight.execute("x = rank")
    eight.disconnect()
    t0 = time.perf_counter()
    again = Pool.connect("bench8")
    values = again.execute("x")
    results["connect_s"] = time.perf_counter() - t0
    assert values == list(range(args.connect_ranks)), values
    again.stop()

    for kind, cell in (("comes back", "time.sleep(600)"), ("does not", DEAF)):
        results[f"stop_running_{kind.replace(' ', '_')}_s"] = _stop_running(D, args.ranks, cell)
    results["deaf_kernel_s"] = _deaf_kernel(D, args.ranks)

    rtt, need = results["round_trip_ms"], results["need_s"]
    print(f"trivial cell round trip, {args.ranks} ranks (median of {args.rounds} x {args.cells}):")
    print(
        f"  in-kernel {rtt['in-kernel']:.3f} ms   detached {rtt['detached']:.3f} ms   "
        f"difference {rtt['detached'] - rtt['in-kernel']:+.3f} ms (target <= +0.5 ms)"
    )
    print(f"--need of {args.need_mb} MB to {args.ranks} ranks (median of {args.need_tries}):")
    print(
        f"  in-kernel {need['in-kernel']:.3f} s   detached {need['detached']:.3f} s   "
        f"ratio {need['detached'] / need['in-kernel']:.2f}"
    )
    print(
        f"connect to a detached pool of {args.connect_ranks} ranks, to the first cell's "
        f"result: {results['connect_s']:.3f} s (target <= 1 s)"
    )
    for kind in ("comes_back", "does_not"):
        answer, gone = results[f"stop_running_{kind}_s"]
        print(
            f"stop while a cell runs ({kind.replace('_', ' ')} from the interrupt): answered in "
            f"{answer:.2f} s, every process gone in {gone:.2f} s"
        )
    listed, taken = results["deaf_kernel_s"]
    print(f"a kernel that stops reading: listing {listed:.3f} s, takeover {taken:.3f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
