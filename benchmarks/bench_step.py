"""A DDP step inside nbddp beside torchrun: ``python benchmarks/bench_step.py [--ranks 2 4]``.

The same unmodified script (``benchmarks/ddp_step.py``) runs, in one run, side by side:

- under ``torchrun --nproc-per-node N`` (which sets OMP_NUM_THREADS=1 per rank);
- through ``%ddp run`` (``Pool.run_script``) on a warm pool;
- through ``%%ddp``: its source as a cell, calling ``main()``;
- through ``%ddp run`` on a pool started with ``--threads auto`` (cores / ranks).

Each figure is the median over ``--repeat`` runs of the script's own ms per step;
ratios are against torchrun (target: <= 1.02).

``--device cuda`` (a GPU machine): the same script on the GPU, NCCL where each rank has a
GPU of its own (``--ranks 1`` on one GPU), else gloo with the ranks sharing the GPUs (as
the pool does); no ``--threads auto`` column.
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
from contextlib import nullcontext
from pathlib import Path

SCRIPT = Path(__file__).with_name("ddp_step.py")
STEP = re.compile(r"STEP_MS (\d+\.\d+)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def script_args(steps: int, device: str, backend: str) -> list[str]:
    return ["--steps", str(steps), "--device", device, "--backend", backend]


def under_torchrun(n: int, args: list[str]) -> float:
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
            *args,
        ],
        capture_output=True,
        text=True,
        env=env,
        check=True,
        timeout=600,
    )
    return float(STEP.search(out.stdout).group(1))


def in_pool(pool, args: list[str], as_cell: bool) -> float:
    from nbddp.wire import protocol as P

    if as_cell:
        source = SCRIPT.read_text().replace('if __name__ == "__main__":\n    main()', "")
        pool.execute(source)
        events = pool.run(f"import sys\nsys.argv = ['ddp_step.py', *{args!r}]\nmain()")
    else:
        events = pool.run_script(str(SCRIPT), args)
    text = "".join(e.text for e in events if isinstance(e, P.Output) and e.rank == 0)
    return float(STEP.search(text).group(1))


def backend_for(n: int, device: str) -> str:
    """What the pool forms for ``n`` ranks here: nccl where each rank has a GPU."""
    if device != "cuda":
        return "gloo"
    from nbddp.rank.gpus import plan, visible_gpus

    return plan(n, count=visible_gpus()).backend


def sized(n: int, device: str, repeat: int, steps: int) -> dict[str, float]:
    """The columns at ``n`` ranks, interleaved so drift hits every column alike."""
    from nbddp import Pool

    backend = backend_for(n, device)
    args, warm = script_args(steps, device, backend), script_args(10, device, backend)
    runs: dict[str, list[float]] = {"torchrun": [], "%ddp run": [], "%%ddp main()": []}
    if device == "cpu":
        runs["%ddp run, --threads auto"] = []
    where = {"device": "cpu"} if device == "cpu" else {}  # cuda: as the pool plans it
    auto_pool = Pool(n, threads="auto", **where) if device == "cpu" else nullcontext()
    with Pool(n, **where) as pool, auto_pool as auto:
        in_pool(pool, warm, False)  # warm: imports, first DDP
        if device == "cpu":
            in_pool(auto, warm, False)
        for _ in range(repeat):
            runs["torchrun"].append(under_torchrun(n, args))
            runs["%ddp run"].append(in_pool(pool, args, False))
            runs["%%ddp main()"].append(in_pool(pool, args, True))
            if device == "cpu":
                runs["%ddp run, --threads auto"].append(in_pool(auto, args, False))
    return {k: statistics.median(v) for k, v in runs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--json")
    args = parser.parse_args()

    os.environ.pop("OMP_NUM_THREADS", None)  # unmodified: nobody set threads by hand
    results = {}
    for n in args.ranks:
        results[n] = sized(n, args.device, args.repeat, args.steps)
        base = results[n]["torchrun"]
        where = f"{os.cpu_count()} CPUs" if args.device == "cpu" else gpu_name()
        print(
            f"\n{n} ranks, {backend_for(n, args.device)}, {where}: ms per DDP step (median "
            f"of {args.repeat}), ratio to torchrun"
        )
        for name, ms in results[n].items():
            print(f"  {name:<28} {ms:8.2f} ms   {ms / base:5.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


def gpu_name() -> str:
    import torch

    g = torch.cuda.device_count()
    return f"{g} x {torch.cuda.get_device_name(0)}"


if __name__ == "__main__":
    main()
