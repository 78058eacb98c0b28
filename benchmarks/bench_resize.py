"""Pool changes, side by side in one run: ``python benchmarks/bench_resize.py``.

1. A refused change: from the ``%ddp`` line to its one-line refusal, on a running pool
   of 4 (through IPython's magics; the pool is left as it was).
2. A resize to a ready group (the first trivial cell done): 4 -> 8 and 8 -> 4 with
   ``Pool.resize`` (the ranks that stay keep their namespaces), beside a full restart
   of the target size (``Pool.restart``: every rank new, every namespace lost).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from timing import timed

REFUSALS = {
    "--gpus for too few ranks": "%ddp start --gpus 0,1",
    "--mesh that does not fit": "%ddp start -n 4 --mesh dp=3",
    "--log-dir that cannot be made": "%ddp start --log-dir /proc/nbddp-nope/logs",
    "--backend nccl without CUDA": "%ddp start --backend nccl",
    "connect to a mistyped name": "%ddp connect nbddp-no-such-pool",
}


def refusals(repeat: int) -> dict[str, float]:
    """Seconds from each refused line to its refusal; the pool's pids checked unchanged."""
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_cell("%load_ext nbddp")
    shell.run_cell("%%ddp -n 4 --quiet\nw = torch.zeros(3) + rank")
    pool = shell.magics_manager.registry["DDPMagics"].pool
    pids = pool.pids
    out = {}
    for what, line in REFUSALS.items():
        out[what] = timed(lambda line=line: shell.run_cell(line, silent=True), repeat, warm=False)
    assert shell.magics_manager.registry["DDPMagics"].pool.pids == pids, "a refusal moved it"
    shell.run_cell("%ddp stop")
    return out


def resizes(small: int, big: int, repeat: int) -> dict[str, float]:
    """Seconds to a ready group: resize small -> big and back, and restarts at each size."""
    from nbddp import Pool

    grow, shrink = [], []
    with Pool(small) as pool:
        pool.execute("pass")
        for _ in range(repeat):
            t0 = time.perf_counter()
            pool.resize(big)
            pool.execute("pass")
            grow.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            pool.resize(small)
            pool.execute("pass")
            shrink.append(time.perf_counter() - t0)
    out = {"grow": statistics.median(grow), "shrink": statistics.median(shrink)}
    for n, key in ((big, "restart_big"), (small, "restart_small")):
        with Pool(n) as pool:
            pool.execute("pass")

            def once(pool=pool) -> None:
                pool.restart()
                pool.execute("pass")

            out[key] = timed(once, repeat, warm=False)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", type=int, default=4)
    parser.add_argument("--big", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    small, big = args.small, args.big

    refused = refusals(args.repeat)
    sized = resizes(small, big, args.repeat)
    print(f"\nnbddp pool changes, {os.cpu_count()} CPUs (medians of {args.repeat})")
    print("  a refused change, %ddp line to its refusal (pool of 4 kept):")
    for what, seconds in refused.items():
        print(f"    {what:<34} {seconds * 1e3:8.1f} ms")
    rows = [
        (f"resize {small} -> {big}, to a ready group", sized["grow"], sized["restart_big"], big),
        (
            f"resize {big} -> {small}, to a ready group",
            sized["shrink"],
            sized["restart_small"],
            small,
        ),
    ]
    for name, took, restart, n in rows:
        print(
            f"  {name:<36} {took:6.2f} s   restart of {n}: {restart:6.2f} s   "
            f"resize/restart = {took / restart:.2f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"cpus": os.cpu_count(), "small": small, "big": big, **sized, "refusals": refused},
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
