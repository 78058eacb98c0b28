"""Moving data, side by side: ``python benchmarks/bench_data.py [--ranks 4] [--mb 512]``.

1. ``--need`` of a CPU tensor to N ranks (nbddp's shared-memory path), beside
   ipyparallel's ``push`` of the same data (as a numpy array, its zero-copy
   path) to N engines, and the floor: one plain copy of the tensor
   (``clone``, allocation included). Timed twice: until every rank has it
   bound, and until every rank has also read it once (so lazily mapped pages
   are counted).
2. ``pull --all`` of a ``--pull-mb`` tensor from every rank, beside
   ipyparallel's ``pull``.
"""

from __future__ import annotations

import argparse
import json

import torch
from timing import timed, without


def nbddp_figures(n: int, t: torch.Tensor, pull_numel: int, repeat: int) -> dict:
    from nbddp import Pool
    from nbddp.pool.capture import pack

    out = {}
    with Pool(n) as pool:

        def need(code):
            def go():
                pool.execute(code, needs=pack({"x": t}))

            return go

        out["need_bound_s"] = timed(need("pass"), repeat)
        out["need_read_s"] = timed(need("float(x[::1024].sum())"), repeat)
        pool.execute(f"y = torch.ones({pull_numel})")
        out["pull_all_s"] = timed(lambda: pool.execute("y"), repeat)
    return out


def ipp_figures(n: int, t: torch.Tensor, pull_numel: int, repeat: int) -> dict:
    import ipyparallel as ipp

    arr = t.numpy()
    cluster = ipp.Cluster(n=n, controller_args=["--HeartMonitor.period=500"], log_level=40)
    rc = cluster.start_and_connect_sync()
    try:
        rc.wait_for_engines(n, timeout=120)
        view = rc[:]
        view.execute("import numpy", block=True)
        out = {
            "push_s": timed(lambda: view.push({"x": arr}, block=True), repeat),
            "push_read_s": timed(
                lambda: (
                    view.push({"x": arr}, block=True),
                    view.execute("float(x[::256].sum())", block=True),
                ),
                repeat,
            ),
        }
        view.execute(f"y = numpy.ones({pull_numel}, dtype=numpy.float32)", block=True)
        out["pull_all_s"] = timed(lambda: view.pull("y", block=True), repeat)
        return out
    finally:
        rc.close()
        cluster.stop_cluster_sync()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--mb", type=int, default=512)
    parser.add_argument("--pull-mb", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--no-ipyparallel", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args()
    args.no_ipyparallel = without("ipyparallel", args.no_ipyparallel)

    t = torch.randn(args.mb * 2**20 // 4)
    pull_numel = args.pull_mb * 2**20 // 4
    floor = timed(lambda: t.clone(), args.repeat)
    results = {"floor_clone_s": floor, **nbddp_figures(args.ranks, t, pull_numel, args.repeat)}
    if not args.no_ipyparallel:
        results["ipyparallel"] = ipp_figures(args.ranks, t, pull_numel, args.repeat)

    n, mb = args.ranks, args.mb
    print(
        f"\nmoving data: {mb} MB tensor to {n} ranks, {args.pull_mb} MB from each back "
        f"(medians of {args.repeat})"
    )
    print(f"  floor: one clone of the tensor              {floor:7.2f} s")
    rows = [
        ("--need, bound on every rank", "need_bound_s", "push_s"),
        ("--need, bound and read once", "need_read_s", "push_read_s"),
        ("pull --all", "pull_all_s", "pull_all_s"),
    ]
    for name, ours, theirs in rows:
        line = f"  nbddp {name:<36} {results[ours]:7.2f} s  ({results[ours] / floor:.2f}x floor)"
        if "ipyparallel" in results:
            peer = results["ipyparallel"][theirs]
            line += f"   ipyparallel {peer:7.2f} s   nbddp/ipyparallel = {results[ours] / peer:.3f}"
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
