"""Failure figures, side by side: ``python benchmarks/bench_failures.py [--limit 20]``.

For each case of the crash matrix, on 2 ranks with gloo:

- detect: seconds from the failure (the failing rank prints the time just
  before it fails; for interrupts, the moment the interrupt is sent) to the
  cell's error in the notebook;
- recover: seconds from that error to the next trivial cell's result
  (restarting the pool where state was lost);
- state: whether the ranks' namespaces survived.

The same cases run on ipyparallel (2 engines that form a gloo group, the
controller with ``--HeartMonitor.period=500``, interrupts sent with
``Cluster.signal_engines(SIGINT)``), each on a fresh cluster, waiting at most
``--limit`` seconds for an answer. nbdistributed is not run: its shutdown
calls ``pkill -f`` on other processes' command lines.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import socket
import statistics
import threading
import time

MARK = "import time as _t\nprint('FAIL_AT', _t.time(), flush=True)\n"
COLL = "import torch.distributed as dist\n"

CASES = {
    "raise": ("if rank == 1:\n    " + MARK.replace("\n", "\n    ") + "raise ValueError('x')", None),
    "os._exit": (
        "import os\nif rank == 1:\n    "
        + MARK.replace("\n", "\n    ")
        + "os._exit(7)\n_t.sleep(60)",
        None,
    ),
    "SIGKILL": (
        "import os\nif rank == 1:\n    "
        + MARK.replace("\n", "\n    ")
        + "os.kill(os.getpid(), 9)\n_t.sleep(60)",
        None,
    ),
    "SIGSEGV": (
        "import ctypes\nif rank == 1:\n    "
        + MARK.replace("\n", "\n    ")
        + "ctypes.string_at(0)\n_t.sleep(60)",
        None,
    ),
    "failure before a collective": (
        COLL
        + "t = torch.ones(1)\nif rank == 1:\n    "
        + MARK.replace("\n", "\n    ")
        + "raise ValueError('x')\ndist.all_reduce(t)",
        None,
    ),
    "infinite loop + interrupt": ("while True:\n    pass", 1.0),
    "time.sleep + interrupt": ("import time\ntime.sleep(60)", 1.0),
    "deadlock in a collective + interrupt": (
        COLL + "import time\nif rank == 0:\n    dist.barrier()\nelse:\n    time.sleep(60)",
        1.0,
    ),
    "stuck in C ignoring SIGINT + interrupt": (
        "import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\ntime.sleep(60)",
        1.0,
    ),
}
FAIL_AT = re.compile(r"FAIL_AT (\d+\.\d+)")


def nbddp_case(pool, code: str, interrupt_after: float | None) -> dict:
    from nbddp import protocol as P

    pool.execute(COLL + "kept = rank")
    sent: list[float] = []
    if interrupt_after:

        def fire():
            sent.append(time.time())
            pool.interrupt()

        threading.Timer(interrupt_after, fire).start()
    fail_at = None
    for ev in pool.run(code):
        if isinstance(ev, P.Output) and (m := FAIL_AT.search(ev.text)):
            fail_at = float(m.group(1))
        if isinstance(ev, P.CellEnd):
            end_t = time.time()
    fail_at = sent[0] if sent else fail_at
    t0 = time.perf_counter()
    values = pool.execute("kept if 'kept' in globals() else None")
    return {
        "detect_s": end_t - fail_at,
        "recover_s": time.perf_counter() - t0,
        "state_kept": values == [0, 1],
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ipp_case(code: str, interrupt_after: float | None, limit: float) -> dict:
    import ipyparallel as ipp

    cluster = ipp.Cluster(n=2, controller_args=["--HeartMonitor.period=500"], log_level=40)
    rc = cluster.start_and_connect_sync()
    try:
        rc.wait_for_engines(2, timeout=120)
        port = free_port()
        for rank, eid in enumerate(sorted(rc.ids)):
            rc[eid].execute(
                f"import os; os.environ.update(RANK='{rank}', WORLD_SIZE='2', "
                f"MASTER_ADDR='127.0.0.1', MASTER_PORT='{port}')"
            )
        view = rc[sorted(rc.ids)]
        view.execute(
            "import torch, torch.distributed as dist\n"
            "dist.init_process_group('gloo')\nrank = dist.get_rank()\nkept = rank",
            block=False,
        ).get(timeout=120)
        ar = view.execute(code, block=False)
        sent: list[float] = []
        if interrupt_after:
            time.sleep(interrupt_after)
            sent.append(time.time())
            cluster.signal_engines_sync(signal.SIGINT)
        outcome = "error"
        try:
            ar.get(timeout=limit)
            outcome = "no error"
        except ipp.error.TimeoutError:
            outcome = f"no answer after {limit:g} s"
        except Exception:
            pass
        end_t = time.time()
        fail_at = sent[0] if sent else None
        if fail_at is None:
            texts = "".join(str(s) for s in (ar.stdout or []))
            m = FAIL_AT.search(texts)
            fail_at = float(m.group(1)) if m else None
        detect = None if outcome.startswith("no answer") or fail_at is None else end_t - fail_at
        t0 = time.perf_counter()
        try:
            check = view.execute("_kept = globals().get('kept')", block=False)
            check.get(timeout=limit)
            values = view.pull("_kept", block=False).get(timeout=limit)
            after = {"recover_s": time.perf_counter() - t0, "state_kept": values == [0, 1]}
        except Exception as exc:
            after = {"recover_s": None, "state_kept": False, "after": type(exc).__name__}
        return {"outcome": outcome, "detect_s": detect, **after}
    finally:
        rc.close()
        cluster.stop_cluster_sync()


def fmt(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--limit", type=float, default=20.0)
    parser.add_argument("--no-ipyparallel", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args()

    from nbddp import Pool

    results: dict = {"nbddp": {}, "ipyparallel": {}}
    with Pool(2) as pool:
        for name, (code, intr) in CASES.items():
            runs = [nbddp_case(pool, code, intr) for _ in range(args.repeat)]
            results["nbddp"][name] = {
                "detect_s": statistics.median(r["detect_s"] for r in runs),
                "recover_s": statistics.median(r["recover_s"] for r in runs),
                "state_kept": all(r["state_kept"] for r in runs),
            }
    if not args.no_ipyparallel:
        for name, (code, intr) in CASES.items():
            results["ipyparallel"][name] = ipp_case(code, intr, args.limit)

    print("\nfailures, 2 ranks, gloo: seconds from the failure to the cell's error (detect),")
    print("then to the next cell's result (recover)")
    head = f"{'case':<40} {'nbddp detect':>12} {'recover':>8} {'state':>6}"
    if results["ipyparallel"]:
        head += f" | {'ipyparallel':<24} {'recover':>8} {'state':>6}"
    print(head)
    for name in CASES:
        n = results["nbddp"][name]
        line = (
            f"{name:<40} {fmt(n['detect_s']):>12} {fmt(n['recover_s']):>8} "
            f"{'kept' if n['state_kept'] else 'lost':>6}"
        )
        if name in results["ipyparallel"]:
            i = results["ipyparallel"][name]
            what = fmt(i["detect_s"]) if i["detect_s"] is not None else i["outcome"]
            line += (
                f" | {what:<24} {fmt(i['recover_s']):>8} {'kept' if i['state_kept'] else 'lost':>6}"
            )
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
