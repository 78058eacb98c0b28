"""A dead rank on several hosts, beside a local pool: ``python benchmarks/bench_multinode.py``.

Side by side in one run, with gloo: a local pool of 8 ranks, and an attached pool of
2 "hosts" x 4 ranks (two torchrun nodes on loopback, ``--nnodes 2``, each through its
relay, each rank held by its holder: nbddp.hosts.holder). A rank is SIGKILLed while
the others wait in all_reduce (bench_failures.death_case: ranks 7, 6, 5, ... in turn);
seconds from the death to the cell's error, and to a ready group of 8 (the result of
an all_reduce over every rank in the next cell). Both keep every other rank's state.

Then a whole host lost (its torchrun, holders, ranks and relay SIGKILLed) and the same
command started again for its node rank (a replacement host): seconds from that launch
to a ready group at full size (an all_reduce over every rank), beside the first launch
of both nodes to a ready group (nbddp.pool.hosts_lost).
"""

from __future__ import annotations

import argparse
import contextlib
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


@contextlib.contextmanager
def two_nodes(per: int):
    """(pool, the torchrun processes, start(node rank)): 2 torchrun nodes on loopback."""
    import socket

    from nbddp import Pool
    from nbddp.notebook import remote

    with tempfile.TemporaryDirectory() as tmp:
        token_file = os.path.join(tmp, "nbddp", "token")
        token = remote.read_or_create_token(token_file)
        pool = Pool(2 * per, listen=("127.0.0.1", 0), token=token, start_timeout=300)
        address = pool.listen()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        log = open(os.path.join(tmp, "nodes.log"), "wb")  # noqa: SIM115
        nodes: list[subprocess.Popen] = []

        def start(i: int) -> subprocess.Popen:
            nodes.append(_node(i, port, address, token_file, per, log))
            return nodes[-1]

        try:
            yield pool, nodes, start
        finally:
            pool.stop()
            for p in nodes:
                try:
                    p.wait(60)
                except subprocess.TimeoutExpired:
                    p.kill()
            log.close()


def attached(per: int, repeat: int) -> dict:
    with two_nodes(per) as (pool, _, start):
        start(0)
        start(1)
        pool.start()
        pool.execute("1")
        return _deaths(pool, repeat)


REDUCE = "_t = torch.ones(1)\ntorch.distributed.all_reduce(_t)\n_t.item()"


def _kill_host(pool, torchrun: subprocess.Popen, ranks: set[int]) -> None:
    """SIGKILL a node's torchrun, its holders and ranks, and its relay (a process of its
    own, outside torchrun's tree): the whole host is gone."""
    import psutil

    relay = next(r.pid for r in pool.hub.relays if r.ranks & ranks)
    procs = [psutil.Process(torchrun.pid), *psutil.Process(torchrun.pid).children(True)]
    for p in [*procs, psutil.Process(relay)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    torchrun.wait(30)


def rejoin(per: int) -> dict:
    """Seconds from the first launch to a group of 2 x ``per`` (the floor: torchrun, torch's
    import, the handshakes), and from a replacement host's launch (the same command) to a
    ready group at full size again, once its lost host's ranks were missing."""
    from nbddp.pool.hosts_lost import HostsMissing

    with two_nodes(per) as (pool, nodes, start):
        t0 = time.perf_counter()
        start(0)
        start(1)
        pool.start()
        assert pool.execute(REDUCE) == [2.0 * per] * (2 * per)
        first = time.perf_counter() - t0
        pool.execute("w = rank")
        _kill_host(pool, nodes[1], set(range(per, 2 * per)))
        while not any(s.state == "missing" for s in pool.status()):
            time.sleep(0.05)
        t0 = time.perf_counter()
        start(1)
        while True:
            try:
                pool.ready()
                break
            except HostsMissing:
                time.sleep(0.05)
        assert pool.execute(REDUCE) == [2.0 * per] * (2 * per)
        again = time.perf_counter() - t0
        kept = pool.execute("w", ranks=list(range(per)))[:per] == list(range(per))
        return {"first_s": first, "rejoin_s": again, "kept": kept}


def fmt(s: float) -> str:
    return f"{s:.2f} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--per-host", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--rejoin-only", action="store_true", help="only the replacement host")
    args = parser.parse_args()
    n = 2 * args.per_host
    t0 = time.perf_counter()
    if args.rejoin_only:
        return _rejoin_rows(args.per_host, n)
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
    _rejoin_rows(args.per_host, n)
    print(f"({time.perf_counter() - t0:.0f} s in all)")


def _rejoin_rows(per: int, n: int) -> None:
    r = rejoin(per)
    print(f"a whole host of {per} ranks SIGKILLed, the same command on a new host:")
    print(f"  first launch to a group of {n}: {fmt(r['first_s'])}")
    print(f"  replacement host's launch to a ready group of {n}: {fmt(r['rejoin_s'])}")
    print(f"  replacement / first launch: {r['rejoin_s'] / r['first_s']:.2f}x; the other")
    print(f"  host's ranks kept their state: {r['kept']}")


if __name__ == "__main__":
    main()
