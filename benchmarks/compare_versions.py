"""Before and after, side by side in one run: ``python benchmarks/compare_versions.py
[--before REV] [--rounds 2]``.

Checks out ``REV`` (by default the last commit before the pool was split into
parts, issue 23) into a temporary git worktree, then runs the same benchmarks
on it and on this checkout, alternating (before, after, before, after, ...),
each version's own benchmark script with its own sources first on
``PYTHONPATH``, and prints each figure's median over the rounds with the
ratio after/before:

- ``bench_core.py``: round trip (``Pool.execute`` and ``%%ddp --quiet``), cold
  start to first result, restart to first result, at 4 ranks;
- ``bench_scale.py``: 1,024 simulated ranks behind relays (attach, round trip,
  notebook CPU per cell);
- ``bench_failures.py``: the fault matrix at 2, 4 and 8 ranks (seconds from the
  failure to the cell's error, and to the next cell's result);
- ``bench_wire.py`` (this checkout's script, run against each version's sources:
  it uses only the public API): round trip and a 512 MB ``--need`` at 4 attached
  ranks over TCP, direct and through a relay;
- ``bench_progress.py`` (this checkout's script too): the notebook's CPU for a
  progress bar of 10,000, 20,000 and 40,000 updates, one per output batch (before
  issue 26 it grows with the square of the updates: 100,000 ran over 18 minutes
  of CPU without ending; ``bench_progress.py`` alone measures today's at 100,000).

``--before 7a9d581 --benches wire,scale,progress`` compares with nbddp before
frames were authenticated (issue 26).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BEFORE = "ffbe5be"  # main before issue 23

BENCHES = {
    "core": ["bench_core.py", "--ranks", "4", "--repeat", "200"],
    "scale": [
        "bench_scale.py",
        "--simulated",
        "1024",
        "--real",
        "",
        "--memory-cells",
        "0",
        "--no-direct",
        "--plot",
        "",
    ],
    "wire": ["bench_wire.py", "--ranks", "4", "--reps", "300", "--need-tries", "3"],
    "progress": ["bench_progress.py", "--updates", "10000", "20000", "40000"],
    "failures": [
        "bench_failures.py",
        "--ranks",
        "2",
        "4",
        "8",
        "--repeat",
        "1",
        "--no-ipyparallel",
    ],
}


OWN_SCRIPT = {"wire", "progress"}  # run this checkout's script on each version's sources


def figures(bench: str, data: dict) -> dict[str, float]:
    """The figures compared, by name, from one run's JSON."""
    if bench == "wire":
        return {
            f"{n} attached {topo} tcp {k}": data[topo]["tcp"][k]
            for topo in ("direct", "relay")
            for k in ("round_trip_ms", "need_s")
            for n in [data["ranks"]]
        }
    if bench == "progress":
        return {f"progress {n} updates cpu_s": row["cpu_s"] for n, row in data["updates"].items()}
    if bench == "core":
        keys = ("nbddp_pool_execute_ms", "nbddp_magic_ms", "cold_start_s", "restart_ms")
        return {f"core {k}": data[k] for k in keys}
    if bench == "scale":
        row = data["simulated"]["1024"]
        keys = ("attach_s", "round_trip_ms", "notebook_cpu_ms", "dashboard_ms")
        return {f"1024 sim {k}": row[k] for k in keys}
    out = {}
    for n, by in data.items():
        for case, f in by["nbddp"].items():
            for k in ("detect_s", "recover_s"):
                if f.get(k) is not None:
                    out[f"{n} ranks {case} {k}"] = f[k]
    return out


def run(tree: Path, bench: str, workdir: Path) -> dict[str, float]:
    script, *args = BENCHES[bench]
    out = workdir / f"{bench}.json"
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    subprocess.run(
        [
            sys.executable,
            str((ROOT if bench in OWN_SCRIPT else tree) / "benchmarks" / script),
            *args,
            "--json",
            str(out),
        ],
        cwd=tree,
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return figures(bench, json.loads(out.read_text()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default=BEFORE)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--benches", default=",".join(BENCHES))
    parser.add_argument("--json")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="nbddp-compare-"))
    before = tmp / "before"
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(before), args.before],
        check=True,
        capture_output=True,
    )
    runs: dict[str, dict[str, list[float]]] = {"before": {}, "after": {}}
    try:
        for i in range(args.rounds):
            for bench in args.benches.split(","):
                order = [("before", before), ("after", ROOT)]
                for label, tree in order if i % 2 == 0 else order[::-1]:
                    for name, value in run(tree, bench, tmp).items():
                        runs[label].setdefault(name, []).append(value)
                    print(f"round {i + 1}: {bench} {label} done", flush=True)
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(before)])
        shutil.rmtree(tmp, ignore_errors=True)
    table = {}
    print(f"\n{'figure':<58} {'before':>10} {'after':>10} {'after/before':>12}")
    for name in runs["after"]:
        if name not in runs["before"]:
            continue
        b, a = statistics.median(runs["before"][name]), statistics.median(runs["after"][name])
        ratio = a / b if b else float("nan")
        table[name] = {"before": b, "after": a, "ratio": ratio}
        print(f"{name:<58} {b:>10.4g} {a:>10.4g} {ratio:>12.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rounds": args.rounds, **table}, indent=2))


if __name__ == "__main__":
    main()
