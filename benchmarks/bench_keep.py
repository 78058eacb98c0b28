"""What ``--keep`` costs a training cell, beside the cell without it and beside a
``torch.distributed.checkpoint`` save + load of the same state to local disk:
``python benchmarks/bench_keep.py [--mb 100 1000] [--ranks 4] [--steps 20]``.

An FSDP2 model (a stack of Linear(W, W), about MB megabytes of float32 parameters) with
Adam, sharded over N ranks (gloo, CPU). In one run, for each size:

- a training cell of STEPS steps (a small batch) on a pool without ``keep``, and on a
  pool with ``keep=["fmodel", "fopt"]`` (the cell and its snapshot at its end, as the
  notebook waits for both today: the copy is not yet overlapped with the next cell);
- the snapshot alone (each rank's local shards and Adam's moments to /dev/shm), its
  bytes per rank, and a rollback;
- ``dcp.save`` + ``dcp.load`` of the same model and optimizer state
  (``get_state_dict``/``set_state_dict``) to a local folder.

Medians of ``--repeat`` cells; the ratios printed are the keep cell over the plain one,
and dcp's save + load over the snapshot + rollback.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

BUILD = """
import torch
from torch.distributed.fsdp import fully_shard
from torch.distributed.device_mesh import init_device_mesh
dp = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
torch.manual_seed(0)
W = {width}
fmodel = torch.nn.Sequential(*[torch.nn.Linear(W, W) for _ in range({layers})])
for layer in fmodel:
    fully_shard(layer, mesh=dp)
_ = fully_shard(fmodel, mesh=dp)
fopt = torch.optim.Adam(fmodel.parameters(), lr=1e-4)
x = torch.randn(2, W)
"""
STEPS = """
for _ in range({steps}):
    fopt.zero_grad()
    fmodel(x).pow(2).mean().backward()
    fopt.step()
"""
DCP = """
import time, torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
_t0 = time.perf_counter()
_m, _o = get_state_dict(fmodel, fopt)
dcp.save({{"model": _m, "optim": _o}}, checkpoint_id={folder!r})
_saved = time.perf_counter() - _t0
_m, _o = get_state_dict(fmodel, fopt)
_state = {{"model": _m, "optim": _o}}
dcp.load(_state, checkpoint_id={folder!r})
set_state_dict(fmodel, fopt, model_state_dict=_state["model"], optim_state_dict=_state["optim"])
(_saved, time.perf_counter() - _t0 - _saved)
"""


def _shape(mb: int) -> tuple[int, int]:
    """(layers, width) for about ``mb`` MB of float32 parameters, 8 layers."""
    width = int((mb * 2**20 / 4 / 8) ** 0.5)
    return 8, width


def _cell(pool, code: str, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        pool.execute(code)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(mb: int, n: int, steps: int, repeat: int) -> dict:
    from nbddp import Pool

    layers, width = _shape(mb)
    build, train = BUILD.format(width=width, layers=layers), STEPS.format(steps=steps)
    with Pool(n) as plain:
        plain.execute(build)
        plain.execute(train)  # (warm)
        bare = _cell(plain, train, repeat)
    with Pool(n, keep=["fmodel", "fopt"]) as pool:
        pool.execute(build)
        pool.execute(train)
        kept = _cell(pool, train, repeat)
        snap = pool.snapshot
        t0 = time.perf_counter()
        pool.rollback()
        back = time.perf_counter() - t0
        with tempfile.TemporaryDirectory(prefix="nbddp-dcp-") as folder:
            dcp = pool.execute(DCP.format(folder=folder))
    save, load = max(d[0] for d in dcp), max(d[1] for d in dcp)
    return {
        "mb": mb,
        "params_mb": layers * (width * width + width) * 4 / 2**20,
        "bare": bare,
        "kept": kept,
        "snapshot": snap.seconds,
        "per_rank_mb": max(snap.nbytes.values()) / 2**20,
        "rollback": back,
        "dcp_save": save,
        "dcp_load": load,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, nargs="+", default=[100])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    print(
        f"{args.ranks} ranks, gloo, CPU, FSDP2 + Adam, a cell of {args.steps} steps; seconds "
        "(medians)"
    )
    print(
        "model | cell | cell + snapshot | ratio | snapshot | its MB a rank | rollback | "
        "dcp save | dcp load | dcp / (snapshot + rollback)"
    )
    for mb in args.mb:
        r = run(mb, args.ranks, args.steps, args.repeat)
        ours = r["snapshot"] + r["rollback"]
        print(
            f"{r['params_mb']:.0f} MB | {r['bare']:.2f} | {r['kept']:.2f} | "
            f"{r['kept'] / r['bare']:.2f}x | {r['snapshot']:.2f} | {r['per_rank_mb']:.0f} | "
            f"{r['rollback']:.2f} | {r['dcp_save']:.2f} | {r['dcp_load']:.2f} | "
            f"{(r['dcp_save'] + r['dcp_load']) / ours:.1f}x",
            flush=True,
        )


if __name__ == "__main__":
    main()
