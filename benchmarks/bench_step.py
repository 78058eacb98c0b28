"""A DDP step inside nbddp beside torchrun: ``python benchmarks/bench_step.py [--ranks 2 4]``.

The same unmodified script (``benchmarks/ddp_step.py``) runs, in one run, side by side:

- under ``torchrun --nproc-per-node N`` (which sets OMP_NUM_THREADS=1 per rank);
- through ``%ddp run`` (``Pool.run_script``) on a warm pool;
- through ``%%ddp``: its source as a cell, calling ``main()``;
- through ``%ddp run`` on a pool started with ``--threads auto`` (cores / ranks).

Each figure is the median over ``--repeat`` runs of the script's own ms per step;
ratios are against torchrun (target: <= 1.02).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).with_name("ddp_step.py")
STEP = re.compile(r"STEP_MS (\d+\.\d+)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def under_torchrun(n: int, steps: int) -> float:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    torchrun = Path(sys.executable).with_name("torchrun")
    out = subprocess.run(
        [
            str(torchrun),
            "--nproc-per-node",
            str(n),
            "--master-port",
            str(free_port()),
            str(SCRIPT),
            "--steps",
            str(steps),
        ],
        capture_output=True,
        text=True,
        env=env,
        check=True,
        timeout=600,
    )
    return float(STEP.search(out.stdout).group(1))


def in_pool(pool, steps: int, as_cell: bool) -> float:
    from nbddp import protocol as P

    if as_cell:
        source = SCRIPT.read_text().replace('if __name__ == "__main__":\n    main()', "")
        pool.execute(source)
        events = pool.run(f"import sys\nsys.argv = ['ddp_step.py', '--steps', '{steps}']\nmain()")
    else:
        events = pool.run_script(str(SCRIPT), ["--steps", str(steps)])
    text = "".join(e.text for e in events if isinstance(e, P.Output) and e.rank == 0)
    return float(STEP.search(text).group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json")
    args = parser.parse_args()

    from nbddp import Pool

    os.environ.pop("OMP_NUM_THREADS", None)  # unmodified: nobody set threads by hand
    results = {}
    for n in args.ranks:
        runs: dict[str, list[float]] = {
            "torchrun": [],
            "%ddp run": [],
            "%%ddp main()": [],
            "%ddp run, --threads auto": [],
        }
        with Pool(n) as pool, Pool(n, threads="auto") as auto:
            in_pool(pool, 10, False)  # warm: imports, first DDP
            in_pool(auto, 10, False)
            for _ in range(args.repeat):  # interleaved, so drift hits every column alike
                runs["torchrun"].append(under_torchrun(n, args.steps))
                runs["%ddp run"].append(in_pool(pool, args.steps, False))
                runs["%%ddp main()"].append(in_pool(pool, args.steps, True))
                runs["%ddp run, --threads auto"].append(in_pool(auto, args.steps, False))
        results[n] = {k: statistics.median(v) for k, v in runs.items()}
        base = results[n]["torchrun"]
        print(
            f"\n{n} ranks, gloo, {os.cpu_count()} CPUs: ms per DDP step (median of "
            f"{args.repeat}), ratio to torchrun"
        )
        for name, ms in results[n].items():
            print(f"  {name:<28} {ms:8.2f} ms   {ms / base:5.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
