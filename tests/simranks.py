"""Simulated ranks: processes that speak nbddp's protocol to an attached pool, without torch.

A test and benchmark helper (not a code path of nbddp): one process serves many
ranks, each with the three connections a real rank opens (control, stdout,
stderr), so the notebook side — handshake, fan-out, gather, streams, sinks —
runs exactly as it does for torchrun ranks, at 1,024 ranks on one machine.

A cell's code runs with ``exec`` in the rank's namespace (``rank`` and
``world_size`` bound, ``print`` writing to the rank's stdout connection); there
is no process group. ``python tests/simranks.py ADDRESS TOKEN_HEX WORLD FIRST
COUNT [RANKS_PER_HOST]``.
"""

from __future__ import annotations

import functools
import importlib
import os
import selectors
import subprocess
import sys
import types
from pathlib import Path

P = None  # nbddp.wire.protocol, loaded by _load_protocol()
R = None  # nbddp.hosts.relay
W = None  # nbddp.wire.handshake


def _load_protocol():
    """nbddp's protocol module under its own name (what the notebook unpickles), without
    the package's __init__ where nbddp is not imported yet (it would import torch)."""
    global P, R, W
    if "nbddp" not in sys.modules:
        package = types.ModuleType("nbddp")
        package.__path__ = [str(Path(__file__).resolve().parent.parent / "src" / "nbddp")]
        sys.modules["nbddp"] = package
    P = importlib.import_module("nbddp.wire.protocol")
    R = importlib.import_module("nbddp.hosts.relay")
    W = importlib.import_module("nbddp.wire.handshake")


def Client(addr, family, authkey):  # (named as multiprocessing's was)
    return W.connect(addr, family, authkey)


def _write(conn, data: bytes) -> None:
    """Bytes on a stream: as they are on a Unix socket, in a frame on TCP."""
    if conn.mode == "plain":
        os.set_blocking(conn.fileno(), True)
        os.write(conn.fileno(), data)
    else:
        conn.send_bytes(data)


def parse_address(address: str):
    if "/" in address:
        return address, "AF_UNIX"
    host, _, port = address.rpartition(":")
    return (host, int(port)), "AF_INET"


# the ranks a process serves get the same messages: decode, compile and answer once
# (the simulation's own cost is not nbddp's; a real rank does this in its own process)
_decoded = functools.lru_cache(maxsize=4)(lambda data: P.loads(data))
_compiled = functools.lru_cache(maxsize=4)(lambda code: compile(code, "<cell>", "exec"))


class _DoneOk(dict):
    def __missing__(self, cell: int) -> bytes:
        self.clear()
        self[cell] = P.dumps(P.Done(cell, "ok"))
        return self[cell]


_OK = _DoneOk()


class SimRank:
    def __init__(
        self,
        address: str,
        token: bytes,
        rank: int,
        world: int,
        per_host: int,
        streams_first: bool = False,
        held: bool = False,
    ) -> None:
        addr, family = parse_address(address)
        self.rank = rank
        pid = os.getpid()
        host = f"sim{rank // per_host}"
        hello = P.Hello(rank, world, rank % per_host, per_host, pid, host, False, held=held)
        self.streams = {}
        if not streams_first:  # as a real rank does; the other order happens too, by timing
            self.control = Client(addr, family, authkey=token)
            self.control.send_bytes(P.dumps(hello))
        for name in ("stdout", "stderr"):
            conn = Client(addr, family, authkey=token)
            conn.send_bytes(P.dumps(P.StreamHello(rank, pid, name)))
            self.streams[name] = conn
        if streams_first:
            self.control = Client(addr, family, authkey=token)
            self.control.send_bytes(P.dumps(hello))
        self.namespace = {"rank": rank, "world_size": world, "print": self._print}
        self.namespace["leave"] = self._leave  # this rank dies (its connections close)
        self.left = False
        self.last_cell, self.collectives = 0, 0  # what a real rank's Stacks says (worker_seq)
        self.relayed = "/" in address
        if not held:  # a held rank waits for the notebook's word (a Reform) to join
            self.control.send_bytes(P.dumps(P.Ready("gloo", "cpu")))

    def _leave(self) -> None:
        self.left = True

    def _print(self, *args, sep=" ", end="\n", file=None, flush=False) -> None:
        stream = "stderr" if file is sys.stderr else "stdout"
        _write(self.streams[stream], (sep.join(map(str, args)) + end).encode())

    def handle(self) -> bool:
        """One message from the notebook; False when this rank is done."""
        try:
            data = self.control.recv_bytes()
        except (EOFError, OSError):
            return False
        msg = _decoded(data)
        if isinstance(msg, P.Run):
            status, error = "ok", None
            self.last_cell, self.collectives = msg.cell, self.collectives + 1  # (one a cell)
            try:
                exec(_compiled(msg.code), self.namespace)
            except Exception as exc:
                status = "error"
                error = P.ErrorInfo(type(exc).__name__, str(exc), f"{type(exc).__name__}: {exc}")
            if self.left:
                return False
            for conn in self.streams.values():
                if not self.relayed:  # as a real rank: behind a relay, no end markers
                    _write(conn, P.end_marker(msg.cell))
            done = (
                _OK[msg.cell] if error is None else P.dumps(P.Done(msg.cell, status, error=error))
            )
            self.control.send_bytes(done)
        elif isinstance(msg, P.Reform):  # (no group to form: ready in that generation)
            self.control.send_bytes(P.dumps(P.Ready("gloo", "cpu", generation=msg.generation)))
        elif isinstance(msg, P.Query):
            self.control.send_bytes(P.dumps(P.StatusReply(0, "cpu")))
        elif isinstance(msg, P.StackQuery):  # idle: its count is final after its last cell
            places = (("0", (), self.collectives, False),)
            self.control.send_bytes(P.dumps(P.Stacks((), None, (self.last_cell, places))))
        elif isinstance(msg, P.Shutdown):
            return False
        return True

    def close(self) -> None:
        for conn in (self.control, *self.streams.values()):
            conn.close()


def serve(
    address: str,
    token: bytes,
    world: int,
    first: int,
    count: int,
    per_host: int,
    streams_first: bool = False,
    relay: bool = False,
    held: bool = False,
) -> None:
    _load_protocol()
    connect_to = {}  # rank -> address: the notebook, or its host's relay
    for r in range(first, first + count):
        connect_to[r] = address
        if relay:  # nbddp's own relay, started as local rank 0 of a torchrun node starts it
            host = r // per_host
            path = R.socket_path(address, token, {"GROUP_RANK": str(host), "MASTER_PORT": "sim"})
            if r % per_host == 0 or r == first:
                R.start(path, parse_address(address), token)
            connect_to[r] = path
    ranks = [
        SimRank(connect_to[r], token, r, world, per_host, streams_first, held)
        for r in range(first, first + count)
    ]
    selector = selectors.DefaultSelector()
    for sim in ranks:
        selector.register(sim.control, selectors.EVENT_READ, sim)
    while selector.get_map():
        for key, _ in selector.select():
            sim = key.data
            if not sim.handle():
                selector.unregister(sim.control)
                sim.close()


def start(
    address: str,
    token: bytes,
    world: int,
    procs: int,
    per_host: int = 8,
    streams_first: bool = False,
    relay: bool = False,
    held: bool = False,
    ranks: range | None = None,
) -> list:
    """``procs`` processes serving ``world`` ranks between them; returns the Popen objects.

    With ``relay``, the ranks of each simulated host (``per_host`` of them) go through
    one nbddp relay, as torchrun ranks on a host do; ``held``: each says a holder forks a
    new process if it dies, and joins when the notebook says (a Reform). ``ranks``: only
    those (a replacement host's), else all."""
    ranks = ranks if ranks is not None else range(world)
    share = -(-len(ranks) // procs)
    share = -(-share // per_host) * per_host  # a host's ranks are served by one process
    out = []
    for first in range(ranks.start, ranks.stop, share):
        count = min(share, ranks.stop - first)
        argv = [address, token.hex(), str(world), str(first), str(count), str(per_host)]
        out.append(
            subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    *argv,
                    *(["streams-first"] if streams_first else []),
                    *(["relay"] if relay else []),
                    *(["held"] if held else []),
                ],
                start_new_session=True,
            )
        )
    return out


if __name__ == "__main__":
    address, token, world, first, count, per_host, *flags = sys.argv[1:]
    serve(
        address,
        bytes.fromhex(token),
        int(world),
        int(first),
        int(count),
        int(per_host),
        "streams-first" in flags,
        "relay" in flags,
        "held" in flags,
    )
