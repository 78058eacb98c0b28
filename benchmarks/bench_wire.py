"""What authenticated frames and ``--tls`` cost an attached pool: ``python
benchmarks/bench_wire.py [--ranks 4] [--json FILE]``.

Real torch ranks attached over TCP on this machine, as ``%ddp attach`` takes them:

- ``direct``: each rank its own host (LOCAL_WORLD_SIZE=1): every rank holds its
  own three TCP connections to the notebook;
- ``relay``: one torchrun node of ``--ranks`` ranks, which talk to the notebook
  through the host's relay (one TCP connection).

For each, side by side in one run: frames with a MAC and a sequence number (the
default on TCP) and, where the nbddp on ``PYTHONPATH`` has it, ``--tls``. Figures:
a trivial cell's round trip (``x = 1``, median of ``--reps``) and the time to
ship a ``--need`` of ``--need-mb`` MB to every rank (median of ``--need-tries``).
It uses only nbddp's public API, so ``benchmarks/compare_versions.py`` runs this
same script against an earlier nbddp (before frames had MACs) for the ratios
against "today".
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from nbddp.pool.facade import Pool
from nbddp.wire import protocol as P

TLS = "tls" in inspect.signature(Pool).parameters  # this nbddp has --tls


def cell(pool: Pool, code: str, **kwargs) -> float:
    t0 = time.perf_counter()
    end = None
    for event in pool.run(code, **kwargs):
        if isinstance(event, P.CellEnd):
            end = event
    assert end is not None, "no CellEnd"
    assert not end.errors, end
    return time.perf_counter() - t0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(topology: str, n: int, tls: bool, folder: Path):
    """An attached pool of ``n`` ranks and the processes that serve it."""
    token = secrets.token_hex(32).encode()
    server, pin = (None, "")
    if tls:
        from nbddp.wire.tls import make_server_tls

        server, pin = make_server_tls()
    token_file = folder / f"token-{topology}-{'tls' if tls else 'tcp'}"
    fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(token + b"\n" + (f"tls-sha256 {pin}\n".encode() if pin else b""))
    extra = {"tls": server} if tls else {}
    pool = Pool(n, listen=("127.0.0.1", 0), token=token, start_timeout=180, **extra)
    address = pool.listen()
    worker = ["-m", "nbddp.worker", "--connect", address, "--token-file", str(token_file)]
    procs = []
    if topology == "direct":
        master = free_port()
        for rank in range(n):
            env = dict(
                os.environ,
                RANK=str(rank),
                WORLD_SIZE=str(n),
                LOCAL_RANK="0",
                LOCAL_WORLD_SIZE="1",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(master),
            )
            procs.append(_spawn([sys.executable, *worker], env))
    else:
        run = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1"]
        run += ["--nproc-per-node", str(n), "--master-port", str(free_port())]
        procs.append(_spawn([*run, *worker], dict(os.environ)))
    pool.start()
    return pool, procs


def _spawn(cmd: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen(
        cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )


def stop(pool: Pool, procs: list) -> None:
    pool.stop()
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def measure(pool: Pool, reps: int, big: torch.Tensor, tries: int) -> dict:
    for _ in range(5):
        cell(pool, "x = 1")
    rtt = [cell(pool, "x = 1") for _ in range(reps)]
    need = [cell(pool, "n = big.shape[0]", needs={"big": big}) for _ in range(tries)]
    return {
        "round_trip_ms": 1000 * statistics.median(rtt),
        "need_s": statistics.median(need),
        "need_min_s": min(need),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--need-mb", type=int, default=512)
    parser.add_argument("--need-tries", type=int, default=3)
    parser.add_argument("--topologies", default="direct,relay")
    parser.add_argument("--json")
    args = parser.parse_args()
    big = torch.ones(args.need_mb * 2**20 // 4)
    results: dict = {"ranks": args.ranks, "need_mb": args.need_mb, "cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory(prefix="nbddp-bench-wire-") as tmp:
        for topology in args.topologies.split(","):
            for tls in (False, True) if TLS else (False,):
                pool, procs = start(topology, args.ranks, tls, Path(tmp))
                try:
                    row = measure(pool, args.reps, big, args.need_tries)
                finally:
                    stop(pool, procs)
                results.setdefault(topology, {})["tls" if tls else "tcp"] = row
                print(f"{topology:>6} {'tls' if tls else 'tcp':>3}: {row}", flush=True)
    print(f"\n{args.ranks} attached ranks, {args.need_mb} MB --need; tls / tcp:")
    for topology in args.topologies.split(","):
        rows = results[topology]
        if "tls" in rows:
            for k in ("round_trip_ms", "need_s"):
                tcp, tls = rows["tcp"][k], rows["tls"][k]
                print(f"  {topology:>6} {k:<14} {tcp:9.3f} {tls:9.3f}  {tls / tcp:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
