"""A rank's handshake against a crowd of peers that never authenticate:
``python benchmarks/bench_handshake.py [--idle 0,200,1000] [--ranks 2] [--json FILE]``.

The notebook's listener (``nbddp.wire.listener.Listener`` on TCP, as an attached pool's) runs
in this process. A crowd (tests/crowd.py) in a process of its own opens IDLE connections
that never speak, plus a slowloris (a byte a second) and a garbage peer (4 KiB of random
bytes, again and again). The crowd is held for the whole measure (the listener's
deadline set to an hour: an attacker that reconnects at once would keep it as full).

- ``handshake``: a client process does what a rank does to attach
  (``nbddp.wire.handshake.connect``, then its Hello), ``--reps`` times one after another:
  the median and the slowest, from its connect to the notebook holding its Hello;
- ``attach``: ``--ranks`` real ranks started by hand (each its own host: three TCP
  connections each) attach to a pool under the same crowd: seconds from their start
  to a ready pool (the ranks import torch meanwhile);
- the descriptors the notebook holds for the crowd.

It uses only what the nbddp on ``PYTHONPATH`` has, so the same script runs against an
earlier nbddp (one thread per handshake in flight) for the figures before.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from nbddp import Pool
from nbddp.notebook import remote
from nbddp.wire import listener as L

HERE = Path(__file__).resolve().parent

CROWD = HERE.parent / "tests" / "crowd.py"
CLIENT = """
import json, sys, time
from nbddp.wire import handshake as HS, protocol as P
host, port, token, reps = sys.argv[1], int(sys.argv[2]), sys.argv[3].encode(), int(sys.argv[4])
took, failed = [], []
for i in range(reps):
    t0 = time.perf_counter()
    try:
        c = HS.connect((host, port), "AF_INET", token, timeout=10)
        c.send_bytes(P.dumps(P.Hello(i, reps, 0, 1, 1, "bench", False)))
        c.recv_bytes(timeout=30)  # the notebook's word that it holds the Hello
        c.close()
    except Exception as exc:
        failed.append(f"{type(exc).__name__}: {exc}")
    took.append(time.perf_counter() - t0)
print(json.dumps({"took": took, "failed": failed}))
"""


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def crowd(port: int, idle: int) -> subprocess.Popen | None:
    if not idle:
        return None
    proc = subprocess.Popen(
        [sys.executable, str(CROWD), "127.0.0.1", str(port), str(idle)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert proc.stdout.readline().split() == ["ready", str(idle)]
    time.sleep(1.0)  # the listener takes them in
    return proc


def end(proc: subprocess.Popen | None) -> None:
    if proc is not None:
        proc.stdin.close()
        proc.wait(30)


def handshakes(idle: int, reps: int) -> dict:
    """A client's handshakes, one after another, against a bare listener under the crowd."""
    token = secrets.token_hex(32)
    heard: queue.SimpleQueue = queue.SimpleQueue()

    def on_peer(conn, hello, raw) -> None:
        conn.send_bytes(b"ok")  # (the client's clock stops here)
        heard.put(conn)

    lis = L.Listener(L.bind_tcp("127.0.0.1", 0), token.encode(), on_peer, name="bench").start()
    port = lis.sock.getsockname()[1]
    before = open_fds()
    proc = crowd(port, idle)
    try:
        held = open_fds() - before - (2 if proc else 0)  # (less the crowd's pipes)
        args = ["127.0.0.1", str(port), token, str(reps)]
        out = subprocess.run(
            [sys.executable, "-c", CLIENT, *args], capture_output=True, text=True, check=True
        )
        got = json.loads(out.stdout)
    finally:
        end(proc)
        lis.close()
        while not heard.empty():
            heard.get().close()
    took = got["took"]
    return {
        "median_ms": 1000 * statistics.median(took),
        "slowest_ms": 1000 * max(took),
        "failed": len(got["failed"]),
        "why": sorted(set(got["failed"])),
        "notebook_fds_for_the_crowd": held,
    }


def attach(idle: int, ranks: int, folder: Path) -> dict:
    """Seconds from starting ``ranks`` real ranks to a ready pool, under the crowd."""
    token_file = folder / f"token-{idle}"
    remote.read_or_create_token(str(token_file))
    token = token_file.read_bytes().strip()
    pool = Pool(ranks, listen=("127.0.0.1", 0), token=token, start_timeout=60)
    address = pool.listen()
    proc = crowd(int(address.rsplit(":", 1)[1]), idle)
    procs = []
    try:
        t0 = time.perf_counter()
        master = str(_free_port())
        for rank in range(ranks):
            env = dict(
                os.environ,
                RANK=str(rank),
                WORLD_SIZE=str(ranks),
                LOCAL_RANK="0",
                LOCAL_WORLD_SIZE="1",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=master,
            )
            cmd = [sys.executable, "-m", "nbddp.worker", "--connect", address]
            cmd += ["--token-file", str(token_file)]
            procs.append(
                subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            )
        try:
            pool.start()
            return {"ready_s": time.perf_counter() - t0}
        except Exception as exc:
            return {"ready_s": None, "attach_failed": f"{type(exc).__name__}: {exc}"}
    finally:
        pool.stop()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        end(proc)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--idle", default="0,200,1000")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--ranks", type=int, default=2, help="real ranks (0: none)")
    parser.add_argument("--json")
    args = parser.parse_args()
    L.HANDSHAKE_TIMEOUT = 3600.0  # the crowd is held all along
    results: dict = {"cpus": os.cpu_count(), "reps": args.reps, "ranks": args.ranks}
    with tempfile.TemporaryDirectory(prefix="nbddp-bench-hs-") as tmp:
        for idle in (int(x) for x in args.idle.split(",")):
            row = handshakes(idle, args.reps)
            if args.ranks:
                row.update(attach(idle, args.ranks, Path(tmp)))
            results[str(idle)] = row
            print(f"{idle:>5} idle: {row}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
