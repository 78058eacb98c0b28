"""200 MB values where /dev/shm is small, beside a roomy one:
``python benchmarks/bench_small_shm.py [--ranks 2 4] [--mb 200] [--repeat 3] [--json F]``.

For each world size, a pool runs twice: with this machine's /dev/shm, and in a mount
namespace with a 64 MB tmpfs over /dev/shm (Docker's default; needs root or a user
namespace), where the values go through the pool's private folder on disk. Timed from
the notebook, median of ``--repeat`` after one warm-up:

- ``--need``: a tensor of MB to every rank, until every rank has read it once;
- ``--out``: a tensor of MB from every rank, until the notebook has read each once;
- ``copy``: ``Pool.copy`` of a tensor of MB from rank 0 to every other rank, until bound.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from timing import timed

MOUNT = "mount -t tmpfs -o size=64m tmpfs /dev/shm"
OPS = ("need", "out", "copy")


def inner(n: int, mb: int, repeat: int) -> dict:
    """The figures of one pool in this process's /dev/shm."""
    import torch

    from nbddp import Pool
    from nbddp.pool.capture import pack
    from nbddp.wire.carriers import spilled

    numel = mb * 2**20 // 4
    x = torch.randn(numel)
    with Pool(n) as pool:
        pool.execute(f"import torch\ny = torch.randn({numel})")

        def need() -> None:
            pool.execute("float(x.sum())", needs=pack({"x": x}, pool.shm_folder))

        def out() -> None:
            for value in pool.execute("y"):
                float(value.sum())  # (read once: a mapped value's pages come when touched)

        figures = {
            "need": timed(need, repeat),
            "out": timed(out, repeat),
            "copy": timed(lambda: pool.copy(["y"], 0), repeat),
        }
        went = spilled(pool.shm_folder)  # past /dev/shm: "disk" (or "message")
    st = os.statvfs("/dev/shm")
    return {"seconds": figures, "shm_mb": st.f_blocks * st.f_frsize / 2**20, "spilled": went}


def outer(n: int, mb: int, repeat: int, small: bool) -> dict:
    me = f"{sys.executable} {os.path.abspath(__file__)} --inner {n} --mb {mb} --repeat {repeat}"
    cmd = ["unshare", "--mount", "sh", "-c", f"{MOUNT} && exec {me}"] if small else me.split()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    if proc.returncode:
        raise SystemExit(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--mb", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json")
    ap.add_argument("--inner", type=int)
    args = ap.parse_args()
    if args.inner:
        print(json.dumps(inner(args.inner, args.mb, args.repeat)))
        return
    results = {"mb": args.mb, "repeat": args.repeat, "cpus": os.cpu_count(), "runs": {}}
    print("| ranks | path | this /dev/shm | 64 MB /dev/shm (disk) | ratio |")
    for n in args.ranks:
        roomy, small = outer(n, args.mb, args.repeat, False), outer(n, args.mb, args.repeat, True)
        results["runs"][n] = {"normal": roomy, "small": small}
        for op in OPS:
            a, b = roomy["seconds"][op], small["seconds"][op]
            shm = f"{roomy['shm_mb']:.0f} MB"
            print(f"| {n} | {op} | {a:.2f} s ({shm}) | {b:.2f} s | {b / a:.2f} |")
        print(f"  past /dev/shm: {roomy['spilled']} here, {small['spilled']} with 64 MB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
