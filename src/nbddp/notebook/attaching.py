"""``%ddp attach``: a pool of ranks started elsewhere (torchrun, SLURM) that connect in.

Listen, say the torchrun command (or submit the SLURM job), wait for every rank.
"""

from __future__ import annotations

import os
import socket
import sys
import time

from IPython.core.error import UsageError

from ..detached import client
from ..detached import messages as W
from ..pool.errors import NbddpError, PoolStartError
from ..pool.facade import Pool
from ..wire.private import UnsafeFile, workspace_folder
from ..wire.tls import Tls, pin_listener, server_credentials
from . import detaching, remote
from .session import say

__all__ = ["attach", "prepare", "workspace"]


def prepare(args) -> tuple[str, int, bytes, Tls | None]:
    """What ``%ddp attach`` (``args``: its parsed options) listens on, with which token
    and (--tls) certificate: checked before the running pool is let go. The token file
    is made if missing; with --tls it pins the new certificate, without it pins none
    (the ranks of the last pool attached with it read how to connect there). With
    --detached the supervisor makes the certificate (its key stays there): here the
    token file is only checked, and the name, --slurm and --idle-timeout too."""
    host, _, port = args.listen.rpartition(":")
    if not host or not port.isdigit():
        raise UsageError(f"--listen takes HOST:PORT, not {args.listen!r}")
    workspace(args.workspace)
    detached = getattr(args, "detached", None)
    if getattr(args, "idle_timeout", None) is not None and not detached:
        raise UsageError("--idle-timeout needs --detached NAME (a kernel's own pool ends with it)")
    if detached:
        detaching.check_name(detached)
    _can_listen(host, int(port))
    if getattr(args, "slurm", None):  # (what it says wrong, before anything starts)
        try:
            remote.check_slurm(_slurm_script(args, "notebook-host:1"))
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    try:
        if detached:
            return host, int(port), remote.read_or_create_token(args.token_file), None
        token, tls = server_credentials(args.token_file, args.tls)
    except UnsafeFile as exc:
        raise UsageError(str(exc)) from None
    return host, int(port), token, tls


def _can_listen(host: str, port: int) -> None:
    """Bind ``host:port`` as the pool will, and let it go: a busy port or an address that
    is not this host's is refused before the running pool is let go."""
    try:
        socket.create_server((host, port)).close()
    except OSError as exc:
        raise UsageError(f"--listen {host}:{port}: cannot listen there: {exc.strerror}") from None


def attach(args, host: str, port: int, token: bytes, tls: Tls | None = None):
    """The pool ``%ddp attach`` asked for, once every rank is in (see :func:`prepare`):
    the kernel's own, or (--detached) a detached pool's, run by its supervisor."""
    if getattr(args, "detached", None):
        return _attach_detached(args, host, port)
    pool = Pool(
        args.world_size,
        listen=(host, port),
        token=token,
        tls=tls,
        start_timeout=args.timeout,
        on_join=_joined,
        workspace=args.workspace,
    )
    t0 = time.perf_counter()
    try:
        _call_ranks(args, pool, host)
        pool.start()
    except (PoolStartError, KeyboardInterrupt) as exc:
        pool.stop()
        raise UsageError(f"attach ended: {exc or 'interrupted'}") from None
    _attached(args, pool, t0)
    return pool


def _attach_detached(args, host: str, port: int):
    """A detached pool's supervisor listens and holds the pool; this kernel says how to
    start the ranks, counts them in, and connects."""
    name, t0 = args.detached, time.perf_counter()
    idle = W.IDLE_TIMEOUT if args.idle_timeout is None else args.idle_timeout
    try:
        pool = client.start(
            name,
            args.world_size,
            idle_timeout=idle,
            timeout=args.timeout + START_MARGIN,
            attach={"token_file": args.token_file, "tls": args.tls},
            watch=_Watch(args, host),
            listen=(host, port),
            start_timeout=args.timeout,
            workspace=args.workspace,
        )
    except (NbddpError, ValueError, KeyboardInterrupt) as exc:
        raise UsageError(f"attach ended: {exc or 'interrupted'}") from None
    _attached(
        args,
        pool,
        t0,
        f": the detached pool {name} outlives this kernel (`%ddp connect {name}` from any "
        f"of your kernels; it stops after {idle:g} s without one)",
    )
    return pool


START_MARGIN = 30.0  # s a detached attach waits past --timeout (its supervisor says first)


class _Watch:
    """A detached attach's start, seen from the kernel: once its supervisor listens, the
    ranks are called (the torchrun command said, or the SLURM job submitted), then each
    rank that joins is counted."""

    def __init__(self, args, host: str) -> None:
        self.args, self.host = args, host
        self.called, self.joined = False, ""

    def __call__(self, folder: str) -> None:
        if not self.called:
            address = _read(os.path.join(folder, W.ADDRESS))
            if not address:
                return
            self.called = True
            _call(self.args, address, self.host)
        joined = _read(os.path.join(folder, W.JOINED))
        if joined and joined != self.joined:
            self.joined = joined
            _joined(int(joined), self.args.world_size)


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _attached(args, pool, t0: float, more: str = "") -> None:
    print()
    hosts = sorted({s.host for s in pool.status()})
    say(
        f"attached {args.world_size} ranks on {len(hosts)} host"
        f"{'s' * (len(hosts) > 1)} ({', '.join(hosts)}) in "
        f"{time.perf_counter() - t0:.1f} s{more}"
    )


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
    pin_listener(args.token_file, pool.tls, address)
    _call(args, address, host)


def _call(args, address: str, host: str) -> None:
    """The ranks are called to ``address``: the SLURM job submitted, or the torchrun
    command said (a host that listens on every address is named by its own name)."""
    reachable = (
        address
        if host not in ("0.0.0.0", "::")
        else f"{socket.getfqdn()}:{address.rsplit(':', 1)[1]}"
    )
    if not args.slurm:
        say(
            f"listening on {address}{' (TLS)' * bool(args.tls)}; on each node run:\n"
            + remote.torchrun_command(reachable, args.token_file, args.world_size)
        )
        return
    say(f"submitted SLURM job {remote.submit_slurm(_slurm_script(args, reachable))}")


def _slurm_script(args, reachable: str) -> str:
    try:
        return remote.slurm_script(
            args.slurm, args.world_size, reachable, args.token_file, python=sys.executable
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _joined(connected: int, world_size: int) -> None:
    print(f"\rnbddp: {connected}/{world_size} ranks connected", end="", flush=True)
