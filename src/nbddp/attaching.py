"""``%ddp attach``: a pool of ranks started elsewhere (torchrun, SLURM) that connect in.

Listen, say the torchrun command (or submit the SLURM job), wait for every rank.
"""

from __future__ import annotations

import os
import socket
import sys
import time

from IPython.core.error import UsageError

from . import remote
from .errors import PoolStartError
from .pool import Pool
from .private import UnsafeFile, workspace_folder
from .session import say
from .tls import Tls, make_server_tls

__all__ = ["attach", "prepare", "workspace"]


def prepare(args) -> tuple[str, int, bytes, Tls | None]:
    """What ``%ddp attach`` (``args``: its parsed options) listens on, with which token
    and (--tls) certificate: checked before the running pool is let go. The token file
    is made if missing; with --tls it pins the new certificate, without it pins none
    (the ranks of the last pool attached with it read how to connect there)."""
    host, _, port = args.listen.rpartition(":")
    if not host or not port.isdigit():
        raise UsageError(f"--listen takes HOST:PORT, not {args.listen!r}")
    workspace(args.workspace)
    tls, pin = make_server_tls() if args.tls else (None, "")
    try:
        token = remote.read_or_create_token(args.token_file, pin)
    except UnsafeFile as exc:
        raise UsageError(str(exc)) from None
    return host, int(port), token, tls


def attach(args, host: str, port: int, token: bytes, tls: Tls | None = None) -> Pool:
    """The pool ``%ddp attach`` asked for, once every rank is in (see :func:`prepare`)."""
    pool = Pool(
        args.world_size,
        listen=(host, port),
        token=token,
        tls=tls,
        start_timeout=args.timeout,
        on_join=_joined,
        workspace=args.workspace,
    )
    _call_ranks(args, pool, host)
    t0 = time.perf_counter()
    try:
        pool.start()
    except (PoolStartError, KeyboardInterrupt) as exc:
        pool.stop()
        raise UsageError(f"attach ended: {exc or 'interrupted'}") from None
    print()
    hosts = sorted({s.host for s in pool.status()})
    say(
        f"attached {args.world_size} ranks on {len(hosts)} host"
        f"{'s' * (len(hosts) > 1)} ({', '.join(hosts)}) in "
        f"{time.perf_counter() - t0:.1f} s"
    )
    return pool


def workspace(path: str | None, make: bool = False) -> str | None:
    """``--workspace``, checked where this host can see it: made (0700) if ``make`` (a
    local pool's), else checked if it is here (the ranks' hosts check it again)."""
    if path is not None and (make or os.path.exists(path)):
        try:
            workspace_folder(path)
        except UnsafeFile as exc:
            raise UsageError(f"--workspace: {exc}") from None
        except OSError as exc:
            raise UsageError(f"--workspace: cannot make {path}: {exc.strerror}") from None
    return path


def _call_ranks(args, pool: Pool, host: str) -> None:
    """Listen, then submit the SLURM job or say the torchrun command that joins."""
    address = pool.listen()
    reachable = (
        address
        if host not in ("0.0.0.0", "::")
        else f"{socket.getfqdn()}:{address.rsplit(':', 1)[1]}"
    )
    if not args.slurm:
        say(
            f"listening on {address}{' (TLS)' * bool(pool.tls)}; on each node run:\n"
            + remote.torchrun_command(reachable, args.token_file, args.world_size)
        )
        return
    try:
        script = remote.slurm_script(
            args.slurm, args.world_size, reachable, args.token_file, python=sys.executable
        )
    except ValueError as exc:
        pool.stop()
        raise UsageError(str(exc)) from None
    say(f"submitted SLURM job {remote.submit_slurm(script)}")


def _joined(connected: int, world_size: int) -> None:
    print(f"\rnbddp: {connected}/{world_size} ranks connected", end="", flush=True)
