"""One relay per host: the host's ranks speak to the notebook through it.

Without a relay, every cell costs the notebook work for every rank: a write of
the Run, a read of the rank's Done and reads of the end markers on its two
streams, about 60 us of the notebook's CPU per rank (64 ms at 1,024 ranks), and
three open connections per rank. Under torchrun with several ranks on a host,
local rank 0 starts a relay (:func:`start`: a process of its own, outside the
rank's process tree) and every rank of the host connects to it exactly as it
would connect to the notebook: the same token, the same messages. The relay
holds one connection to the notebook and turns per-rank traffic into per-host
frames (:mod:`nbddp.hosts.relay_carry`: a cell's Run to 8 ranks is one frame; their
equal Done messages one item, each after its rank's output).

The relay ends when the notebook's connection closes, when every rank that
connected has gone, or when no rank came within the start timeout. Ranks whose
relay ends see their connection close and exit, as when the notebook goes away.
Here: where a host's relay listens, and its process's life (it imports no torch: a
relay is a small process).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import socket
import sys
import tempfile
import traceback

from ..wire import handshake
from ..wire import protocol as P
from ..wire.private import hold, private_folder, sweep
from ..wire.tls import Tls
from . import holder
from .relay_carry import Relay

__all__ = ["Relay", "socket_path", "start", "wanted"]

START_TIMEOUT = 120.0  # a relay no rank came to ends after this many seconds


def wanted(tcp: bool, env) -> bool:
    """Ranks that attach over TCP, several on a host, go through a relay (NBDDP_RELAY=0: not);
    so does a held rank alone on its host: its relay's connection is how the notebook tells
    the host's loss (nbddp.pool.hosts_lost) from the rank's death (its holder forks a new one)."""
    local = env.get("LOCAL_WORLD_SIZE", "1")
    several = local.isdigit() and int(local) > 1
    return tcp and (several or holder.wanted(tcp, env)) and env.get("NBDDP_RELAY", "1") != "0"


def socket_path(address: str, token: bytes, env) -> str:
    """Where the relay of this torchrun node listens: the same for each of its ranks, and
    another for another node, run or restart (two nodes on one machine get two relays)."""
    parts = [address, hashlib.sha256(token).hexdigest()]
    for var in (
        "TORCHELASTIC_RUN_ID",
        "TORCHELASTIC_RESTART_COUNT",
        "MASTER_ADDR",
        "MASTER_PORT",
        "GROUP_RANK",
    ):
        parts.append(env.get(var, ""))
    key = hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]
    folder = f"nbddp-relay-{os.getuid()}-{key}"
    return os.path.join(tempfile.gettempdir(), folder, "relay.sock")


def start(
    path: str,
    notebook: tuple,
    token: bytes,
    timeout: float = START_TIMEOUT,
    tls: Tls | None = None,
) -> int:
    """Listen on ``path`` and fork the relay, detached from this process's tree.

    ``notebook`` is ``(address, family)`` as :func:`nbddp.wire.handshake.connect` takes it
    (``tls``: the notebook attached with --tls). The socket is bound before this
    returns, so the host's ranks may connect at once; the relay authenticates them
    once it reached the notebook. Returns the relay's pid.
    """
    folder = os.path.dirname(path)
    # the folders of relays that were SIGKILLed (no live relay holds them): removed
    sweep(os.path.dirname(folder), f"nbddp-relay-{os.getuid()}-")
    private_folder(folder)
    held = hold(folder)  # by the relay (forked below) for as long as it lives
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # left by a relay of an earlier run of this node
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(256)
    read_pid, write_pid = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the forked side; tests see the relay it becomes
        code = 1
        try:
            os.close(read_pid)
            os.setsid()  # signals to local rank 0's group (torchrun's, Ctrl-C) miss it
            if os.fork() == 0:
                os.write(write_pid, str(os.getpid()).encode())
                os.close(write_pid)
                code = serve(listener, notebook, token, timeout, folder, tls)
            else:
                code = 0  # the relay is reparented: it outlives local rank 0 if it must
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    os.close(write_pid)
    listener.close()
    if held is not None:
        os.close(held)
    os.waitpid(child, 0)
    with os.fdopen(read_pid, "rb") as f:
        return int(f.read() or 0)


def serve(
    listener: socket.socket,
    notebook: tuple,
    token: bytes,
    timeout: float,
    folder: str,
    tls: Tls | None = None,
) -> int:
    """The relay's life: reach the notebook, then carry traffic until it ends."""
    try:
        try:
            up = handshake.connect(*notebook, token, timeout=timeout, tls=tls)
            up.send_bytes(P.dumps(P.RelayHello(socket.gethostname(), os.getpid())))
        except (OSError, EOFError) as exc:
            where = notebook[0] if isinstance(notebook[0], str) else "{}:{}".format(*notebook[0])
            print(f"nbddp relay: cannot reach the notebook at {where}: {exc}", file=sys.stderr)
            return 2
        Relay(up, listener, token).serve(timeout)
        return 0
    finally:
        listener.close()
        shutil.rmtree(folder, ignore_errors=True)
