"""Output throughput through a real kernel: ``python benchmarks/bench_output.py``.

4 ranks each print 100,000 lines in one cell. For nbddp's dashboard and its
text mode, and for ipyparallel's ``%%px --stream`` on 4 engines, in one run:

- the cell's wall time, seen from the client (execute to idle);
- the ranks' own printing time (measured in the cell), and the same loop
  printing to /dev/null (the floor);
- the iopub messages the cell caused, and how many lines were accounted for
  (delivered, or counted as dropped by the bounded panes).
"""

from __future__ import annotations

import argparse
import json
import re
import time

from jupyter_client.manager import start_new_kernel
from kernel_value import kernel_value
from timing import without

LOOP = (
    "import time, sys, os\n"
    "_t0 = time.perf_counter()\n"
    "for _i in range({lines}):\n"
    "    print('rank', rank, 'line', _i)\n"
    "sys.stdout.flush()\n"
    "print_time = time.perf_counter() - _t0\n"
    "_null = open(os.devnull, 'w')\n"
    "_t0 = time.perf_counter()\n"
    "for _i in range({lines}):\n"
    "    print('rank', rank, 'line', _i, file=_null)\n"
    "null_time = time.perf_counter() - _t0\n"
)


def run(kc, code: str, timeout: float = 600) -> dict:
    msg_id = kc.execute(code)
    t0 = time.perf_counter()
    counts: dict[str, int] = {}
    last_html = ""
    stream_lines = 0
    shown: dict[str, str] = {}  # display id -> its latest text (ipyparallel's per-engine output)
    while True:
        msg = kc.get_iopub_msg(timeout=timeout)
        kind = msg["msg_type"]
        # %%px --stream prints from a thread under another parent: count every stream
        if msg["parent_header"].get("msg_id") != msg_id and kind != "stream":
            continue
        counts[kind] = counts.get(kind, 0) + 1
        if kind in ("display_data", "update_display_data"):
            data = msg["content"]["data"]
            last_html = data.get("text/html", last_html)
            display_id = msg["content"].get("transient", {}).get("display_id", msg_id)
            if "[stdout:" in data.get("text/plain", ""):
                shown[display_id] = data["text/plain"]
        elif kind == "stream":
            text = msg["content"]["text"]
            stream_lines += text.count("\n")
            # a bounded text sink says how many lines it did not show
            stream_lines += sum(int(k) - 1 for k in re.findall(r"\.\.\. (\d+) lines not", text))
        elif kind == "error":
            raise RuntimeError(msg["content"]["evalue"])
        elif kind == "status" and msg["content"]["execution_state"] == "idle":
            stream_lines += sum(text.count("\n") for text in shown.values())
            return {
                "wall_s": time.perf_counter() - t0,
                "iopub": counts,
                "html": last_html,
                "stream_lines": stream_lines,
            }


def nbddp_mode(kc, n: int, lines: int, flags: str) -> dict:
    r = run(kc, f"%%ddp {flags}\n" + LOOP.format(lines=lines))
    run(kc, "%%ddp --out _pt --quiet\n(print_time, null_time)")
    times = kernel_value(kc, "_pt")
    accounted = [int(x) for x in re.findall(r"rank \d+ log \((\d+) lines\)", r["html"])]
    return {
        **r,
        "print_s": max(t[0] for t in times),
        "null_s": max(t[1] for t in times),
        "accounted_lines": sum(accounted) if accounted else r["stream_lines"],
    }


def ipp_mode(kc, n: int, lines: int) -> dict:
    run(
        kc,
        "import ipyparallel as ipp\n"
        f"_cluster = ipp.Cluster(n={n}, controller_args=['--HeartMonitor.period=500'], "
        "log_level=40)\n"
        "_rc = _cluster.start_and_connect_sync(activate=True)\n"
        f"_rc.wait_for_engines({n}, timeout=120)\n"
        "_rc[:].execute('rank = __import__(\"os\").getpid() % 1000', block=True)",
        300,
    )
    try:
        r = run(kc, "%%px --stream\n" + LOOP.format(lines=lines))
        run(kc, "_pt = _rc[:].pull(['print_time', 'null_time'], block=True)")
        times = kernel_value(kc, "_pt")
        return {
            **r,
            "print_s": max(t[0] for t in times),
            "null_s": max(t[1] for t in times),
            "accounted_lines": r["stream_lines"],
        }
    finally:
        run(kc, "_rc.close(); _cluster.stop_cluster_sync()", 120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--lines", type=int, default=100_000)
    parser.add_argument("--no-ipyparallel", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args()
    args.no_ipyparallel = without("ipyparallel", args.no_ipyparallel)
    n, lines = args.ranks, args.lines

    km, kc = start_new_kernel(kernel_name="python3", startup_timeout=60)
    results = {}
    try:
        run(kc, "%load_ext nbddp")
        run(kc, f"%ddp start -n {n}", 120)
        results["nbddp dashboard"] = nbddp_mode(kc, n, lines, "")
        results["nbddp --text"] = nbddp_mode(kc, n, lines, "--text")
        run(kc, "%ddp stop")
        if not args.no_ipyparallel:
            results["ipyparallel %%px --stream"] = ipp_mode(kc, n, lines)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)

    total = n * lines
    print(f"\noutput: {n} ranks x {lines} lines ({total} lines), through a real kernel")
    print(
        f"{'mode':<28} {'cell s':>7} {'print s':>8} {'ratio':>6} {'floor s':>8} "
        f"{'iopub':>6} {'per s':>6} {'lines accounted':>16}"
    )
    for name, r in results.items():
        msgs = sum(r["iopub"].values())
        print(
            f"{name:<28} {r['wall_s']:7.2f} {r['print_s']:8.2f} "
            f"{r['wall_s'] / r['print_s']:6.2f} {r['null_s']:8.2f} {msgs:6d} "
            f"{msgs / r['wall_s']:6.1f} {r['accounted_lines']:>9}/{total}"
        )
    if args.json:
        for r in results.values():
            r.pop("html", None)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
