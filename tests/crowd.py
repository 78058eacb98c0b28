"""A crowd of peers that never authenticate, in a process of its own (a test and benchmark
helper, not a code path of nbddp): ``python tests/crowd.py HOST PORT IDLE``.

It opens IDLE connections to the listener at HOST:PORT that never say a word, plus one
slowloris (a byte of garbage a second, on one connection, opened again when the listener
closes it) and one garbage peer (4 KiB of random bytes, again and again, a connection
each). It prints ``ready N`` (N: the idle connections it opened) and runs until stdin
closes or it is killed. In its own process, so that the notebook's descriptors
(``/proc/self/fd``) count only what the listener holds for the crowd.
"""

from __future__ import annotations

import contextlib
import os
import resource
import socket
import sys
import threading
import time


def _connect(address: tuple[str, int]) -> socket.socket:
    sock = socket.create_connection(address, timeout=30)
    sock.setblocking(True)
    return sock


def _slowloris(address: tuple[str, int]) -> None:
    """One byte a second, for ever; a new connection when the listener closed this one."""
    while True:
        with contextlib.suppress(OSError), _connect(address) as sock:
            while True:
                sock.sendall(os.urandom(1))
                time.sleep(1.0)


def _garbage(address: tuple[str, int]) -> None:
    """Random bytes on a new connection, again and again (each is refused and closed)."""
    while True:
        with contextlib.suppress(OSError), _connect(address) as sock:
            sock.sendall(os.urandom(4096))
            sock.settimeout(30)
            while sock.recv(4096):  # until the listener closes it
                pass
        time.sleep(0.05)


def _room_for(n: int) -> None:
    """Enough descriptors for ``n`` connections (the soft limit raised to the hard one)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < n + 64 and (hard == resource.RLIM_INFINITY or hard > soft):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def main() -> None:
    host, port, idle = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    address = (host, port)
    _room_for(idle)
    crowd = [_connect(address) for _ in range(idle)]
    for target in (_slowloris, _garbage):
        threading.Thread(target=target, args=(address,), daemon=True).start()
    print(f"ready {len(crowd)}", flush=True)
    sys.stdin.read()  # until the test (or benchmark) closes our stdin
    for sock in crowd:
        sock.close()


if __name__ == "__main__":
    main()
