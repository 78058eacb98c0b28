"""The control plane against the number of ranks: ``python benchmarks/bench_scale.py``.

In one run, on this machine:

- simulated ranks (tests/simranks.py: processes that speak nbddp's protocol over
  the same three connections per rank as torchrun ranks, without torch) at 8, 64,
  256 and 1,024 ranks, attached over TCP as ``%ddp attach`` does, 8 ranks to a
  simulated host: through nbddp's relay per host (as torchrun ranks go) and, side
  by side, connected directly (NBDDP_RELAY=0);
- real torch ranks (a local pool, gloo) at 8, 16 and 32.

For each size: the time to attach (or start) every rank; a trivial cell's round
trip (``x = 1``: fan-out of Run, gather of every Done and end marker), median of
30; the notebook's own CPU per cell (``time.process_time``: the ranks' CPU is
not in it); and the same cell printing one line on every rank through the
folding dashboard (rendered into its widget, no front end) and the text sink.
Then the notebook's memory over 1,000 dashboard cells at 64 simulated ranks.
The plot goes to docs/img/scale.png.
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import secrets
import statistics
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import simranks  # noqa: E402
from nbddp.dashboard.view import Dashboard, TextSink  # noqa: E402
from nbddp.pool.facade import Pool  # noqa: E402
from nbddp.wire import protocol as P  # noqa: E402


def cell(pool: Pool, code: str, sink=None) -> tuple[float, float]:
    """One cell: (wall s, notebook CPU s)."""
    c0, t0 = time.process_time(), time.perf_counter()
    end = None
    for event in pool.run(code):
        if isinstance(event, P.CellEnd):
            end = event
        elif sink is not None:
            sink.handle(event)
    if sink is not None:
        sink.close(end)
    assert end is not None, "no CellEnd"
    assert not end.errors, end
    return time.perf_counter() - t0, time.process_time() - c0


def dashboard(pool: Pool) -> Dashboard:
    n = pool.world_size
    return Dashboard(list(range(n)), world_size=n, backend="gloo", devices="cpu")


def measure(pool: Pool, reps: int) -> dict:
    for _ in range(3):
        cell(pool, "x = 1")
    bare = [cell(pool, "x = 1") for _ in range(reps)]
    dash = [cell(pool, "print('step', 1)", dashboard(pool)) for _ in range(reps)]
    text = [cell(pool, "print('step', 1)", TextSink(stdout=io.StringIO())) for _ in range(reps)]

    def med(runs, i):
        return 1000 * statistics.median(r[i] for r in runs)

    return {
        "round_trip_ms": med(bare, 0),
        "notebook_cpu_ms": med(bare, 1),
        "dashboard_ms": med(dash, 0),
        "dashboard_cpu_ms": med(dash, 1),
        "text_ms": med(text, 0),
        "text_cpu_ms": med(text, 1),
    }


def simulated(n: int, procs: int, relay: bool = True) -> tuple[Pool, list, float]:
    token = secrets.token_bytes(16)
    pool = Pool(n, listen=("127.0.0.1", 0), token=token, start_timeout=120)
    address = pool.listen()
    t0 = time.perf_counter()
    sims = simranks.start(address, token, n, procs=min(procs, n), relay=relay)
    pool.start()
    return pool, sims, time.perf_counter() - t0


def memory_over_cells(cells: int, n: int, procs: int) -> dict:
    from ipywidgets.widgets.widget import _instances

    pool, sims, _ = simulated(n, procs)
    me = psutil.Process()
    warm = min(100, cells)  # the first measure, after the caches filled (fewer: at the end)
    rss = {}
    try:
        for i in range(1, cells + 1):
            cell(pool, "print('step', 1)", dashboard(pool))
            if i in (warm, cells):
                gc.collect()
                rss[i] = me.memory_info().rss / 2**20
    finally:
        pool.stop()
        for s in sims:
            s.wait(30)
    return {
        "cells": cells,
        "ranks": n,
        "warm_cells": warm,
        "rss_mib_at_warm": rss[warm],
        "rss_mib_at_end": rss[cells],
        "live_widgets": len(_instances),
    }


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    names = {"simulated": "relay per host", "direct": "simulated, direct", "real": "real ranks"}
    for kind, style in (("simulated", "o-"), ("direct", "^:"), ("real", "s--")):
        rows = sorted((int(n), r) for n, r in results[kind].items())
        if not rows:
            continue
        ns = [n for n, _ in rows]
        ax.plot(
            ns, [r["round_trip_ms"] for _, r in rows], style, label=f"round trip, {names[kind]}"
        )
        ax.plot(
            ns,
            [r["notebook_cpu_ms"] for _, r in rows],
            style,
            alpha=0.6,
            label=f"notebook CPU, {names[kind]}",
        )
        ax.plot(
            ns,
            [r["dashboard_cpu_ms"] - r["notebook_cpu_ms"] for _, r in rows],
            style,
            alpha=0.35,
            label=f"dashboard CPU over bare, {names[kind]}",
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("ranks")
    ax.set_ylabel("ms per cell (median)")
    ax.set_title("A trivial cell against the number of ranks (2-core machine)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--simulated", default="8,64,256,1024")
    parser.add_argument("--real", default="8,16,32")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--procs", type=int, default=4, help="processes serving simulated ranks")
    parser.add_argument("--memory-cells", type=int, default=1000)
    parser.add_argument(
        "--no-direct",
        dest="direct",
        action="store_false",
        help="skip simulated ranks without relays",
    )
    parser.add_argument("--plot", default=str(ROOT / "docs" / "img" / "scale.png"))
    parser.add_argument("--json")
    args = parser.parse_args()

    results: dict = {"simulated": {}, "direct": {}, "real": {}}
    for n in [int(x) for x in args.simulated.split(",") if x]:
        for kind, relay in (("simulated", True), ("direct", False)):
            if kind == "direct" and not args.direct:
                continue
            pool, sims, attach = simulated(n, args.procs, relay)
            try:
                results[kind][n] = {"attach_s": attach, **measure(pool, args.reps)}
            finally:
                pool.stop()
                for s in sims:
                    s.wait(30)
            print(n, kind, results[kind][n], flush=True)
    for n in [int(x) for x in args.real.split(",") if x]:
        t0 = time.perf_counter()
        with Pool(n) as pool:
            pool.start()
            start = time.perf_counter() - t0
            results["real"][n] = {"attach_s": start, **measure(pool, args.reps)}
        print(n, "real", results["real"][n], flush=True)
    if args.memory_cells:
        results["memory"] = memory_over_cells(args.memory_cells, 64, args.procs)

    print(
        "\nranks  kind       attach s  round trip ms  notebook CPU ms  "
        "dashboard ms (CPU)  text ms (CPU)"
    )
    for kind in ("simulated", "direct", "real"):
        for n, r in results[kind].items():
            print(
                f"{n:>5}  {kind:<9} {r['attach_s']:9.2f} {r['round_trip_ms']:14.1f} "
                f"{r['notebook_cpu_ms']:16.1f} {r['dashboard_ms']:10.1f} "
                f"({r['dashboard_cpu_ms']:.1f}) {r['text_ms']:8.1f} ({r['text_cpu_ms']:.1f})"
            )
    sims, real, direct = results["simulated"], results["real"], results["direct"]
    for n in sorted(set(sims) & set(direct)):
        print(
            f"direct / relayed at {n} ranks: round trip "
            f"{direct[n]['round_trip_ms'] / sims[n]['round_trip_ms']:.2f}x, notebook CPU "
            f"{direct[n]['notebook_cpu_ms'] / sims[n]['notebook_cpu_ms']:.2f}x"
        )
    for n in sorted(set(sims) & set(real)):
        print(
            f"real / simulated round trip at {n} ranks: "
            f"{real[n]['round_trip_ms'] / sims[n]['round_trip_ms']:.2f}"
        )
    if "memory" in results:
        m = results["memory"]
        print(
            f"\nmemory over {m['cells']} dashboard cells at {m['ranks']} ranks: "
            f"{m['rss_mib_at_warm']:.1f} MiB after {m['warm_cells']}, {m['rss_mib_at_end']:.1f} "
            f"MiB after {m['cells']} ({m['rss_mib_at_end'] - m['rss_mib_at_warm']:+.1f}); "
            f"live widgets {m['live_widgets']}"
        )
    if args.plot:
        plot(results, Path(args.plot))
        print("plot:", args.plot)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
