"""A one-line cell's cost, dashboard against ``--text``: ``python benchmarks/bench_dashboard.py``.

Through a real kernel (jupyter_client), a warm pool of 4, 8, 16 and 32 ranks runs
``print('x')`` 15 times in each mode, in one run. For each: the median round trip
seen by the client (execute to idle), the iopub messages the cell caused (every
kind, the kernel's busy/idle included), and the kernel's own CPU time per cell
(psutil, the kernel process only: the ranks' CPU is not in it).

Targets (issue 14): the dashboard costs <= 5 ms over ``--text`` at 4 ranks and
<= 15 ms at 32; <= 10 iopub messages for a one-line cell at any size.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import psutil
from jupyter_client.manager import start_new_kernel


def run(kc, code: str, timeout: float = 300) -> int:
    """Run ``code``; the number of iopub messages it caused. Raises on an error."""
    msg_id = kc.execute(code)
    count = 0
    while True:
        msg = kc.get_iopub_msg(timeout=timeout)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        count += 1
        if msg["msg_type"] == "error":
            raise RuntimeError(msg["content"]["evalue"])
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            return count


def measure(kc, kernel: psutil.Process, code: str, reps: int) -> dict:
    run(kc, code)  # warm
    walls, msgs = [], []
    cpu0 = sum(kernel.cpu_times()[:2])
    for _ in range(reps):
        t0 = time.perf_counter()
        msgs.append(run(kc, code))
        walls.append(time.perf_counter() - t0)
    cpu = (sum(kernel.cpu_times()[:2]) - cpu0) / reps
    return {
        "ms": 1000 * statistics.median(walls),
        "iopub": int(statistics.median(msgs)),
        "kernel_cpu_ms": 1000 * cpu,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="4,8,16,32")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--json")
    args = parser.parse_args()

    km, kc = start_new_kernel(kernel_name="python3", startup_timeout=60)
    kernel = psutil.Process(km.provisioner.process.pid)
    results: dict[int, dict] = {}
    try:
        run(kc, "%load_ext nbddp")
        for n in map(int, args.ranks.split(",")):
            run(kc, f"%ddp start -n {n}", 300)
            results[n] = {
                mode: measure(kc, kernel, f"%%ddp {flags}\nprint('x')", args.reps)
                for mode, flags in (("text", "--text"), ("dashboard", ""))
            }
            run(kc, "%ddp stop")
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)

    print("\na one-line cell through a real kernel, medians of", args.reps)
    print(
        f"{'ranks':>5} {'--text ms':>10} {'dashboard ms':>13} {'over text':>10} "
        f"{'ratio':>6} {'iopub text':>11} {'iopub dash':>11} {'kernel CPU text/dash ms':>24}"
    )
    for n, r in results.items():
        t, d = r["text"], r["dashboard"]
        print(
            f"{n:>5} {t['ms']:10.1f} {d['ms']:13.1f} {d['ms'] - t['ms']:10.1f} "
            f"{d['ms'] / t['ms']:6.2f} {t['iopub']:>11} {d['iopub']:>11} "
            f"{t['kernel_cpu_ms']:>12.1f} / {d['kernel_cpu_ms']:.1f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
