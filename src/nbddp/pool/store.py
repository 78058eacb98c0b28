"""The group's store, in a process of its own.

A local pool's ranks form their process group (and every re-form of it) on one
``TCPStore``. Were it in rank 0, rank 0's death would take the store with it,
and no survivor could form a group again; here no rank's death touches it.
The pool binds the listening socket (on 127.0.0.1, so it knows the port at
once) and its launcher starts this process with it (:meth:`Launcher.start_store`).
The process ends when the pool kills it, or when the process that started it
(the notebook, or the fork server, which ends with the notebook) is gone.
"""

from __future__ import annotations

import os
import socket
import sys
import time

__all__ = ["main"]

POLL = 0.2  # seconds between looks at whether the starter is still there


def main(argv: list[str]) -> int:
    """``[FD]``: serve the store on the listening socket FD until the starter is gone."""
    import torch.distributed as dist

    starter = os.getppid()
    sock = socket.socket(fileno=int(argv[0]))
    host, port = sock.getsockname()[:2]
    store = dist.TCPStore(  # noqa: F841  (it serves from its own thread while referenced)
        host, port, None, True, wait_for_workers=False, master_listen_fd=sock.detach()
    )
    while os.getppid() == starter:
        time.sleep(POLL)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
