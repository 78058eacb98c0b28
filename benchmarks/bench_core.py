"""Core figures, side by side in one run: ``python benchmarks/bench_core.py [--ranks 4]``.

1. Trivial cell round trip on a warm pool, through IPython magics:
   ``%%ddp --quiet`` vs ipyparallel's ``%%px`` on as many engines (its
   controller given ``--HeartMonitor.period=500``, as is fair), plus the
   bare ``Pool.execute`` round trip.
2. Cold start to first result vs the floor: N processes that each start
   Python, import torch and join a gloo group (the least any launcher does).
3. ``%ddp restart`` to first result.

Needs the ``bench`` extra (ipyparallel); without it, step 1 reports nbddp alone.
``--ranks 1 2 4 --round-trip-only``: step 1 alone at each size (on a GPU machine the
pool's ranks are on the GPU: NCCL at one rank, sharing it over gloo beyond).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

FLOOR_RANK = """
import os, sys, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1); dist.all_reduce(t)
print(time.time())
dist.destroy_process_group()
"""


def median_ms(fn, repeat: int, warmup: int = 10) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def round_trips(n: int, repeat: int) -> dict:
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_cell("%load_ext nbddp")
    shell.run_cell(f"%ddp start -n {n}")
    try:
        return {**nbddp_round_trips(shell, repeat), **px_round_trip(shell, n, repeat)}
    finally:
        shell.run_cell("%ddp stop")


def nbddp_round_trips(shell, repeat: int) -> dict:
    pool = shell.magics_manager.registry["DDPMagics"].pool
    return {
        "nbddp_pool_execute_ms": median_ms(lambda: pool.execute("pass"), repeat),
        "nbddp_magic_ms": median_ms(lambda: shell.run_cell("%%ddp --quiet\npass"), repeat),
    }


def px_round_trip(shell, n: int, repeat: int) -> dict:
    try:
        import ipyparallel as ipp
    except ImportError:
        print("ipyparallel is not installed (pip install -e '.[bench]'): no %%px figure")
        return {}
    cluster = ipp.Cluster(n=n, controller_args=["--HeartMonitor.period=500"], log_level=40)
    rc = cluster.start_and_connect_sync(activate=True)
    try:
        rc.wait_for_engines(n, timeout=120)
        px = median_ms(lambda: shell.run_cell("%%px --block\npass"), repeat)
        return {"ipyparallel_px_ms": px}
    finally:
        rc.close()
        cluster.stop_cluster_sync()


def restart_to_first_result(n: int, repeat: int) -> float:
    from nbddp import Pool

    with Pool(n) as pool:

        def once():
            pool.restart()
            pool.execute("rank")

        return median_ms(once, repeat, warmup=1)


COLD = """
import sys, time
t0 = time.time()
from nbddp import Pool
pool = Pool(int(sys.argv[1])).start()
pool.execute("rank")
print(time.time() - t0)
pool.stop()
"""


def cold_start(n: int) -> float:
    """A new process that has torch imported (as a notebook would) starts a pool."""
    code = "import torch, nbddp.pool.facade\n" + COLD
    out = subprocess.run([sys.executable, "-c", code, str(n)], capture_output=True, text=True)
    return float(out.stdout.strip().splitlines()[-1])


def floor(n: int) -> float:
    """N x (python + import torch + gloo init + one all_reduce), started together."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.time()
    procs = []
    for rank in range(n):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE=str(n),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", FLOOR_RANK], env=env, stdout=subprocess.PIPE, text=True
            )
        )
    ends = [float(p.communicate()[0].strip()) for p in procs]
    return max(ends) - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[4])
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--round-trip-only", action="store_true", help="step 1 alone")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    every = {n: sized(n, args.repeat, args.round_trip_only) for n in args.ranks}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(every[args.ranks[0]] if len(every) == 1 else every, f, indent=2)


def sized(n: int, repeat: int, round_trip_only: bool) -> dict:
    """Every figure at ``n`` ranks, printed as a table."""
    results: dict = {"ranks": n, "cpus": os.cpu_count(), "device": device_name()}
    results.update(round_trips(n, repeat))
    if not round_trip_only:
        cold = [cold_start(n) for _ in range(3)]
        floors = [floor(n) for _ in range(3)]
        results["cold_start_s"] = statistics.median(cold)
        results["floor_s"] = statistics.median(floors)
        results["restart_ms"] = restart_to_first_result(n, 10)
    print(f"\nnbddp core benchmarks, {n} ranks, {results['device']}")
    for name, value, note in rows(results):
        print(f"  {name:<36} {value:>10}   {note}")
    return results


def device_name() -> str:
    """Where the ranks run: this machine's CPUs, or the GPUs the pool puts them on."""
    import torch

    if not torch.cuda.is_available():
        return f"{os.cpu_count()} CPUs"
    return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"


def rows(results: dict) -> list[tuple[str, str, str]]:
    out = [
        ("trivial cell, Pool.execute", f"{results['nbddp_pool_execute_ms']:.2f} ms", ""),
        ("trivial cell, %%ddp --quiet", f"{results['nbddp_magic_ms']:.2f} ms", ""),
    ]
    if "ipyparallel_px_ms" in results:
        ratio = results["nbddp_magic_ms"] / results["ipyparallel_px_ms"]
        results["ratio_vs_px"] = ratio
        out.append(
            (
                "trivial cell, ipyparallel %%px",
                f"{results['ipyparallel_px_ms']:.2f} ms",
                f"nbddp/px = {ratio:.3f} (target <= 0.2)",
            )
        )
    if "cold_start_s" not in results:
        return out
    ratio = results["cold_start_s"] / results["floor_s"]
    results["ratio_cold_vs_floor"] = ratio
    return [
        *out,
        (
            "cold start to first result",
            f"{results['cold_start_s']:.2f} s",
            f"nbddp/floor = {ratio:.2f} (target <= 1.2)",
        ),
        ("floor: N x python+torch+gloo init", f"{results['floor_s']:.2f} s", ""),
        ("restart to first result", f"{results['restart_ms']:.0f} ms", "target <= 500 ms"),
    ]


if __name__ == "__main__":
    main()
