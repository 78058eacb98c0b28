"""A dead rank on several hosts, beside a local pool: ``python benchmarks/bench_multinode.py``.

Side by side in one run, with gloo: a local pool of 8 ranks, and an attached pool of
2 "hosts" x 4 ranks (two torchrun nodes on loopback, ``--nnodes 2``, each through its
relay, each rank held by its holder: nbddp.worker_holder). A rank is SIGKILLed while
the others wait in all_reduce (bench_failures.death_case: ranks 7, 6, 5, ... in turn);
seconds from the death to the cell's error, and to a ready group of 8 (the result of
an all_reduce over every rank in the next cell). Both keep every other rank's state.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_failures import death_case

ROOT = Path(__file__).resolve().parent.parent


def _deaths(pool, repeat: int) -> dict:
    runs = [death_case(pool, (pool.world_size - 1 - i) % pool.world_size) for i in range(repeat)]
    return {
        "error_s": statistics.median(r["error_s"] for r in runs),
        "ready_s": statistics.median(r["ready_s"] for r in runs),
        "max_ready_s": max(r["ready_s"] for r in runs),
        "state": sorted({r["state"] for r in runs}),
    }


def local(n: int, repeat: int) -> dict:
    from nbddp import Pool

    with Pool(n) as pool:
        pool.execute("1")
        return _deaths(pool, repeat)


def _node(i: int, port: int, address: str, token_file: str, per: int, log) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank"]
    cmd += [str(i), "--nproc-per-node", str(per), "--master-addr", "127.0.0.1"]
    cmd += ["--master-port", str(port), "-m", "nbddp.worker", "--connect", address]
    cmd += ["--token-file", token_file]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


def attached(per: int, repeat: int) -> dict:
    import socket

    from nbddp import Pool, remote

    with tempfile.TemporaryDirectory() as tmp:
        token_file = os.path.join(tmp, "nbddp", "token")
        token = remote.read_or_create_token(token_file)
        pool = Pool(2 * per, listen=("127.0.0.1", 0), token=token, start_timeout=300)
        address = pool.listen()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        log = open(os.path.join(tmp, "nodes.log"), "wb")  # noqa: SIM115
        nodes = [_node(i, port, address, token_file, per, log) for i in range(2)]
        try:
            pool.start()
            pool.execute("1")
            return _deaths(pool, repeat)
        finally:
            pool.stop()
            for p in nodes:
                try:
                    p.wait(60)
                except subprocess.TimeoutExpired:
                    p.kill()
            log.close()


def fmt(s: float) -> str:
    return f"{s:.2f} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--per-host", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    n = 2 * args.per_host
    t0 = time.perf_counter()
    rows = {
        f"local pool of {n}": local(n, args.repeat),
        f"2 hosts x {args.per_host} (torchrun)": attached(args.per_host, args.repeat),
    }
    print(f"a rank SIGKILLed in all_reduce, median of {args.repeat} (worst in brackets)")
    print(f"{'pool':<24} {'to the error':>12} {'to a ready group':>20} {'state':>8}")
    for name, r in rows.items():
        ready = f"{fmt(r['ready_s'])} [{fmt(r['max_ready_s'])}]"
        print(f"{name:<24} {fmt(r['error_s']):>12} {ready:>20} {'/'.join(r['state']):>8}")
    (loc, att) = rows.values()
    print(f"attached / local, to a ready group: {att['ready_s'] / loc['ready_s']:.2f}x")
    print(f"({time.perf_counter() - t0:.0f} s in all)")


if __name__ == "__main__":
    main()
