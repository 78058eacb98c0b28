"""What ``nbddp.log_metrics`` costs a training loop: ``python benchmarks/bench_metrics.py
[--steps 100000] [--rounds 3] [--json FILE]``.

A real kernel (jupyter_client) with the dashboard on, a pool of 4 ranks. Each rank runs
the same loop of ``--steps`` small training steps (a 32x32 linear layer on a batch of 8:
forward, backward, SGD; no collective, so nothing hides the cost), once without and
once with ``nbddp.log_metrics({"loss": ..., "acc": ...}, step=i)`` every step; the two
cells alternate ``--rounds`` times. Figures, medians over the rounds: each rank's loop
time (the slowest rank's), the cell's wall time in the notebook (the dashboard drawing
the charts included), each rank's CPU time for its loop (the slowest rank's: less
noisy than wall time on a shared machine), the kernel's CPU time (receiving the points,
drawing the charts) and its iopub messages and bytes for the cell. Also the bare call
(a loop that only logs) per call, on one rank.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import psutil
from jupyter_client.manager import start_new_kernel
from kernel_value import kernel_value

RANKS = 4
LOOP = """
import time, torch, nbddp
torch.manual_seed(rank)
net = torch.nn.Linear(32, 32)
opt = torch.optim.SGD(net.parameters(), lr=0.01)
x, y = torch.randn(8, 32), torch.randn(8, 32)
t0, c0 = time.perf_counter(), time.process_time()
for i in range({steps}):
    loss = ((net(x) - y) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    value = loss.item()
    {log}
(time.perf_counter() - t0, time.process_time() - c0)
"""
BARE = """
import time, nbddp
t0 = time.perf_counter()
for i in range({steps}):
    nbddp.log_metrics({{"loss": 0.5, "acc": 0.25}}, step=i, run="bare")
(time.perf_counter() - t0) / {steps}
"""


def execute(kc, code: str, timeout: float = 900) -> tuple[dict, int, int]:
    """Run ``code``; (the execute reply, iopub messages, iopub bytes) for it."""
    msg_id = kc.execute(code)
    count = size = 0
    while True:
        msg = kc.get_iopub_msg(timeout=timeout)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        count += 1
        size += len(json.dumps(msg["content"], default=str))
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            break
    reply = kc.get_shell_msg(timeout=timeout)
    if reply["content"]["status"] != "ok":
        raise RuntimeError(f"cell failed: {reply['content'].get('evalue')}")
    return reply, count, size


def one(kc, kernel: psutil.Process, steps: int, log: bool) -> dict:
    line = 'nbddp.log_metrics({"loss": value, "acc": 1 / (1 + value)}, step=i)' if log else ""
    code = f"%%ddp -n {RANKS} --out loop_s\n" + LOOP.format(steps=steps, log=line or "pass")
    k0, t0 = sum(kernel.cpu_times()[:2]), time.perf_counter()
    _, count, size = execute(kc, code)
    wall, kernel_cpu = time.perf_counter() - t0, sum(kernel.cpu_times()[:2]) - k0
    loops = kernel_value(kc, "loop_s")
    return {
        "loop_s": max(w for w, _ in loops),
        "rank_cpu_s": max(c for _, c in loops),  # the rank's own CPU: less noisy than wall
        "kernel_cpu_s": kernel_cpu,
        "cell_s": wall,
        "iopub": count,
        "iopub_bytes": size,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()
    km, kc = start_new_kernel(kernel_name="python3")
    kernel = psutil.Process(km.provisioner.process.pid)
    try:
        execute(kc, f"import sys; assert sys.executable == {sys.executable!r}, sys.executable")
        execute(kc, "%load_ext nbddp")
        execute(kc, f"%%ddp -n {RANKS}\nimport torch, nbddp")  # the pool, started
        for log in (False, True):  # warm: imports, the first charts
            one(kc, kernel, 2000, log)
        runs: dict[str, list[dict]] = {"without": [], "with": []}
        for r in range(args.rounds):
            for kind in ("without", "with") if r % 2 == 0 else ("with", "without"):
                row = one(kc, kernel, args.steps, kind == "with")
                runs[kind].append(row)
                print(
                    f"round {r} {kind:>7}: loop {row['loop_s']:.2f} s (rank CPU"
                    f" {row['rank_cpu_s']:.2f} s), cell {row['cell_s']:.2f} s, kernel CPU"
                    f" {row['kernel_cpu_s']:.2f} s, iopub {row['iopub']} messages /"
                    f" {row['iopub_bytes'] / 1e3:.0f} kB",
                    flush=True,
                )
        execute(kc, f"%%ddp -n {RANKS} --ranks 0 --out per_call\n" + BARE.format(steps=200_000))
        bare = kernel_value(kc, "per_call")[0]
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=False)
    med = {
        kind: {k: statistics.median(row[k] for row in rows) for k in rows[0]}
        for kind, rows in runs.items()
    }
    ratio_loop = med["with"]["loop_s"] / med["without"]["loop_s"]
    ratio_cpu = med["with"]["rank_cpu_s"] / med["without"]["rank_cpu_s"]
    ratio_cell = med["with"]["cell_s"] / med["without"]["cell_s"]
    per_step_us = med["without"]["loop_s"] / args.steps * 1e6
    print(
        f"\n{args.steps:,} steps x {RANKS} ranks, medians of {args.rounds}:"
        f"\n  a step without logging: {per_step_us:.1f} us"
        f"\n  loop  without {med['without']['loop_s']:.2f} s, with {med['with']['loop_s']:.2f} s:"
        f" ratio {ratio_loop:.3f}"
        f"\n  rank CPU without {med['without']['rank_cpu_s']:.2f} s,"
        f" with {med['with']['rank_cpu_s']:.2f} s: ratio {ratio_cpu:.3f}"
        f"\n  kernel CPU without {med['without']['kernel_cpu_s']:.2f} s,"
        f" with {med['with']['kernel_cpu_s']:.2f} s"
        f"\n  cell  without {med['without']['cell_s']:.2f} s, with {med['with']['cell_s']:.2f} s:"
        f" ratio {ratio_cell:.3f}"
        f"\n  iopub without {med['without']['iopub']:.0f}, with {med['with']['iopub']:.0f} messages"
        f" ({med['with']['iopub_bytes'] / 1e3:.0f} kB with)"
        f"\n  one log_metrics call, two metrics, alone: {bare * 1e6:.2f} us"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "steps": args.steps,
                    "ranks": RANKS,
                    "rounds": runs,
                    "median": med,
                    "ratio_loop": ratio_loop,
                    "ratio_rank_cpu": ratio_cpu,
                    "ratio_cell": ratio_cell,
                    "step_us": per_step_us,
                    "call_us": bare * 1e6,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
