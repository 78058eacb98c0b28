"""Failure figures, side by side: ``python benchmarks/bench_failures.py [--ranks 2 4 8]``.

For each case of the fault matrix, at each world size, with gloo; the failing
rank is N-2 (rank 0 of 2):

- detect: seconds from the failure (the failing rank prints the time just
  before it fails; for interrupts, the moment the interrupt is sent) to the
  cell's error in the notebook;
- recover: seconds from that error to the next trivial cell's result
  (restarting the pool where state was lost);
- state: whether the ranks' namespaces survived (``kept``: every rank's;
  ``others``: every rank's but the dead one's, which a new process replaced).

Then, for a rank that dies (SIGKILL while the others wait in all_reduce), the
two ``--on-death`` modes side by side: seconds from the death to the cell's
error, and to a ready group of N (the result of an all_reduce over all ranks
in the next cell). ``replace`` (the default) keeps the survivors' state and
forks one new process; ``restart`` (the old behaviour) starts every rank anew.

Interrupts are sent once every rank has printed "ready" (the line before the
one it blocks on) and 0.3 s more have passed.

The same cases run on ipyparallel (N engines that form a gloo group, the
controller with ``--HeartMonitor.period=500``, interrupts sent with
``Cluster.signal_engines(SIGINT)`` 1 s after the cell was sent), each on a
fresh cluster, waiting at most ``--limit`` seconds for an answer.
nbdistributed is not run: its shutdown calls ``pkill -f`` on other processes'
command lines.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import socket
import statistics
import time

from timing import without

MARK = "import time as _t\nprint('FAIL_AT', _t.time(), flush=True)\n"
READY = "print('ready', flush=True)\n"
COLL = "import torch.distributed as dist\nt = torch.ones(1)\n"


def _at_bad(code: str) -> str:
    """``code`` run by the failing rank only, right after it prints the time."""
    body = (MARK + code).replace("\n", "\n    ")
    return f"if rank == BAD:\n    {body}\n"


# name: (code, interrupted, ipyparallel runs it)
CASES = {
    "raise": (_at_bad("raise ValueError('x')"), False, True),
    "sys.exit(3)": (_at_bad("import sys; sys.exit(3)"), False, True),
    "os._exit(7)": (_at_bad("import os; os._exit(7)"), False, True),
    "SIGKILL": (
        COLL + _at_bad("import os; os.kill(os.getpid(), 9)") + "dist.all_reduce(t)",
        False,
        True,
    ),
    "SIGSEGV": (_at_bad("import ctypes; ctypes.string_at(0)"), False, True),
    "raise before a collective": (
        COLL + _at_bad("raise ValueError('x')") + "dist.all_reduce(t)",
        False,
        True,
    ),
    "raise between collectives": (
        COLL + "dist.all_reduce(t)\n" + _at_bad("raise ValueError('x')") + "dist.all_reduce(t)",
        False,
        True,
    ),
    "infinite loop + interrupt": (READY + "while True:\n    pass", True, True),
    "sleep + interrupt, others in all_reduce": (
        COLL + "import time\n" + READY + "if rank == BAD:\n    time.sleep(60)\ndist.all_reduce(t)",
        True,
        True,
    ),
    "mismatched collectives + interrupt": (
        COLL + READY + "if rank == BAD:\n    dist.barrier()\nelse:\n    dist.all_reduce(t)",
        True,
        True,
    ),
    "stuck in C ignoring SIGINT + interrupt": (
        "import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        + READY
        + "time.sleep(60)",
        True,
        True,
    ),
    "one stuck in C ignoring SIGINT + interrupt": (
        COLL
        + "import signal, time\nif rank == BAD:\n    signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        + READY
        + "if rank == BAD:\n    time.sleep(60)\ndist.all_reduce(t)",
        True,
        True,
    ),
    "mismatched collectives, --debug": (
        COLL + "if rank == BAD:\n    " + MARK.replace("\n", "\n    ") + "dist.barrier()\n"
        "else:\n    dist.all_reduce(t)",
        False,
        False,
    ),
}
FAIL_AT = re.compile(r"FAIL_AT (\d+\.\d+)")


def nbddp_case(pool, code: str, interrupted: bool) -> dict:
    from nbddp.wire import protocol as P

    n = pool.world_size
    pool.execute(COLL + "kept = rank")
    pool.roster.deaths.clear()  # repeated deaths here are the benchmark's, not a crash loop
    sent: list[float] = []
    fail_at, ready, fire_at = None, 0, None
    for ev in pool.run(code, tick=0.02):
        if isinstance(ev, P.Output) and (m := FAIL_AT.search(ev.text)):
            fail_at = float(m.group(1))
        if isinstance(ev, P.Output) and interrupted:
            ready += ev.text.count("ready")
            if ready == n and fire_at is None:
                fire_at = time.monotonic() + 0.3
        if fire_at is not None and not sent and time.monotonic() >= fire_at:
            sent.append(time.time())
            pool.interrupt()
        if isinstance(ev, P.CellEnd):
            end_t = time.time()
    fail_at = sent[0] if sent else fail_at
    t0 = time.perf_counter()
    values = pool.execute("kept if 'kept' in globals() else None")
    return {
        "detect_s": end_t - fail_at,
        "recover_s": time.perf_counter() - t0,
        "state_kept": _state(values, n),
    }


def _state(values: list, n: int) -> str:
    if values == list(range(n)):
        return "kept"
    lost = [r for r in range(n) if values[r] != r]
    return "others" if len(lost) == 1 and values.count(None) == 1 else "lost"


DEATH = (
    COLL
    + READY
    + "import time\nif rank == BAD:\n    time.sleep(0.3)\n    "
    + MARK.replace("\n", "\n    ")
    + "import os; os.kill(os.getpid(), 9)\ndist.all_reduce(t)"
)
SUM = COLL + "dist.all_reduce(t)\nt.item()"


def death_case(pool, bad: int) -> dict:
    """A SIGKILL of ``bad`` while the others wait in all_reduce: seconds to the cell's
    error, and to the result of an all_reduce over every rank (a ready group)."""
    from nbddp.wire import protocol as P

    n = pool.world_size
    pool.execute(COLL + "kept = rank")
    pool.roster.deaths.clear()  # repeated deaths here are the benchmark's, not a crash loop
    fail_at = end_t = None
    for ev in pool.run(DEATH.replace("BAD", str(bad)), tick=0.02):
        if isinstance(ev, P.Output) and (m := FAIL_AT.search(ev.text)):
            fail_at = float(m.group(1))
        if isinstance(ev, P.CellEnd):
            end_t = time.time()
    total = pool.execute(SUM)
    ready_t = time.time()
    values = pool.execute("kept if 'kept' in globals() else None")
    assert total == [float(n)] * n, total
    return {"error_s": end_t - fail_at, "ready_s": ready_t - fail_at, "state": _state(values, n)}


def run_deaths(n: int, repeat: int) -> dict:
    from nbddp import Pool

    results = {}
    for mode in ("replace", "restart"):
        with Pool(n, on_death=mode) as pool:
            pool.execute("1")
            runs = [death_case(pool, (n - 1 - i) % n) for i in range(repeat)]
        results[mode] = {
            "error_s": statistics.median(r["error_s"] for r in runs),
            "ready_s": statistics.median(r["ready_s"] for r in runs),
            "max_ready_s": max(r["ready_s"] for r in runs),
            "state": sorted({r["state"] for r in runs}),
        }
    return results


def death_table(n: int, r: dict) -> list[str]:
    rep, res = r["replace"], r["restart"]
    return [
        f"{n} ranks, a rank SIGKILLed in all_reduce (ranks {n - 1}, {n - 2}, ...; median of "
        "the runs, worst in brackets): seconds from the death",
        f"{'--on-death':<10} {'to the error':>12} {'to a ready group of N':>22} {'state':>8}",
        *(
            f"{mode:<10} {fmt(x['error_s']):>12} "
            f"{fmt(x['ready_s']) + ' [' + fmt(x['max_ready_s']) + ']':>22} "
            f"{'/'.join(x['state']):>8}"
            for mode, x in r.items()
        ),
        f"restart / replace, to a ready group: {res['ready_s'] / rep['ready_s']:.1f}x",
    ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ipp_case(code: str, n: int, interrupted: bool, limit: float) -> dict:
    import ipyparallel as ipp

    cluster = ipp.Cluster(n=n, controller_args=["--HeartMonitor.period=500"], log_level=40)
    rc = cluster.start_and_connect_sync()
    try:
        rc.wait_for_engines(n, timeout=120)
        port = free_port()
        for rank, eid in enumerate(sorted(rc.ids)):
            rc[eid].execute(
                f"import os; os.environ.update(RANK='{rank}', WORLD_SIZE='{n}', "
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
        if interrupted:
            time.sleep(1.0)
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
            kept = values == list(range(n))
            after = {"recover_s": time.perf_counter() - t0, "state_kept": kept}
        except Exception as exc:
            after = {"recover_s": None, "state_kept": False, "after": type(exc).__name__}
        return {"outcome": outcome, "detect_s": detect, **after}
    finally:
        rc.close()
        cluster.stop_cluster_sync()


def fmt(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def run_size(n: int, args) -> dict:
    from nbddp import Pool

    bad = str(n - 2 if n > 2 else 0)
    results: dict = {"nbddp": {}, "ipyparallel": {}}
    for name, (code, interrupted, on_ipp) in CASES.items():
        if args.cases and not any(c in name for c in args.cases):
            continue
        debug = "--debug" in name
        with Pool(n, debug=debug) as pool:
            runs = [
                nbddp_case(pool, code.replace("BAD", bad), interrupted) for _ in range(args.repeat)
            ]
        results["nbddp"][name] = {
            "detect_s": statistics.median(r["detect_s"] for r in runs),
            "recover_s": statistics.median(r["recover_s"] for r in runs),
            "state_kept": "/".join(sorted({r["state_kept"] for r in runs})),
        }
        if on_ipp and not args.no_ipyparallel:
            results["ipyparallel"][name] = ipp_case(
                code.replace("BAD", bad), n, interrupted, args.limit
            )
    return results


def table(n: int, results: dict) -> list[str]:
    lines = [
        f"\n{n} ranks, gloo, failing rank {n - 2 if n > 2 else 0}: seconds from the failure "
        "to the cell's error (detect), then to the next cell's result (recover)"
    ]
    head = f"{'case':<42} {'nbddp detect':>12} {'recover':>8} {'state':>6}"
    if results["ipyparallel"]:
        head += f" | {'ipyparallel':<24} {'recover':>8} {'state':>6}"
    lines.append(head)
    for name in results["nbddp"]:
        r = results["nbddp"][name]
        line = f"{name:<42} {fmt(r['detect_s']):>12} {fmt(r['recover_s']):>8} {r['state_kept']:>6}"
        if name in results["ipyparallel"]:
            i = results["ipyparallel"][name]
            what = fmt(i["detect_s"]) if i["detect_s"] is not None else i["outcome"]
            line += (
                f" | {what:<24} {fmt(i['recover_s']):>8} {'kept' if i['state_kept'] else 'lost':>6}"
            )
        lines.append(line)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--limit", type=float, default=20.0)
    parser.add_argument("--no-ipyparallel", action="store_true")
    parser.add_argument("--deaths-only", action="store_true", help="only the death section")
    parser.add_argument("--cases", nargs="+", help="only the cases whose names hold these")
    parser.add_argument("--json")
    args = parser.parse_args()
    args.no_ipyparallel = without("ipyparallel", args.no_ipyparallel)

    everything: dict = {"deaths": {}}
    for n in args.ranks:
        if not args.deaths_only:
            everything[n] = run_size(n, args)
            print("\n".join(table(n, everything[n])), flush=True)
    for n in args.ranks:
        everything["deaths"][n] = run_deaths(n, args.repeat)
        print("\n" + "\n".join(death_table(n, everything["deaths"][n])), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(everything, f, indent=2)


if __name__ == "__main__":
    main()
