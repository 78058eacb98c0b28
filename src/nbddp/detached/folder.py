"""A detached pool's folder, and whether a live supervisor holds it.

Each pool's folder (``~/.nbddp/pools/NAME``) holds a file ``lock`` that its
supervisor keeps locked (``flock``) for as long as it lives. That lock, not a
pid, says whether the pool lives: a pid means nothing in another PID namespace
(a container, ``unshare``) or on another host that shares the home folder, and
there ``os.kill(pid, 0)`` took live pools for dead ones and removed them. The
lock is taken before the folder gets its name (it is made under a staging name,
locked, then renamed), and handed to the supervisor as an inherited descriptor
(the same open file, so the same lock): no one ever sees a pool's folder
unlocked while it starts, runs, or stops. Only a folder whose lock nobody holds
is removed, and by the process that then holds it.

(On NFS, ``flock`` is carried as a lock on the whole file, which needs the file
open for writing: so a file, opened read-write, rather than the folder itself.)
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile

from ..wire.private import locked, sweep

__all__ = ["LOCK", "held", "make", "remove_if_dead"]

LOCK = "lock"  # the file in a pool's folder its supervisor keeps locked
STAGING = ".new-"  # a folder being made (not a pool's name: names have no dot)


class Taken(Exception):
    """A pool of that name lives (or is being started right now)."""


def _lock(path: str, create: bool = False) -> int | None:
    """An open descriptor of ``path`` locked by us; None if someone else holds it."""
    flags = os.O_RDWR | os.O_NOFOLLOW | (os.O_CREAT | os.O_EXCL if create else 0)
    return locked(os.open(path, flags, 0o600))


def held(folder: str) -> bool:
    """Whether a live supervisor holds ``folder`` (a pool running, or starting)."""
    try:
        fd = _lock(os.path.join(folder, LOCK))
    except FileNotFoundError:
        return False
    except OSError:
        return True  # not ours to test (a permission, a loop): never taken for dead
    if fd is None:
        return True
    os.close(fd)
    return False


def remove_if_dead(folder: str) -> bool:
    """Remove ``folder`` if no live supervisor holds it; True if it is gone now."""
    try:
        fd = _lock(os.path.join(folder, LOCK))
    except FileNotFoundError:
        fd = -1  # no lock file: not a pool this version made and runs
    except OSError:
        return False
    if fd is None:
        return False  # it lives
    try:
        shutil.rmtree(folder, ignore_errors=True)
    finally:
        if fd >= 0:
            os.close(fd)
    return not os.path.exists(folder)


def make(base: str, folder: str, files: dict[str, bytes]) -> int:
    """Make the pool's ``folder`` in ``base`` with ``files`` in it, locked: the lock's
    descriptor (the supervisor inherits it). Raises :class:`Taken` if a live pool (or
    one starting) has that folder."""
    os.makedirs(base, mode=0o700, exist_ok=True)
    sweep(base, STAGING)  # what a start killed halfway left
    if os.path.lexists(folder) and not remove_if_dead(folder):
        raise Taken(folder)
    staging = tempfile.mkdtemp(prefix=STAGING, dir=base)  # 0700
    fd = _lock(os.path.join(staging, LOCK), create=True)
    try:
        for name, data in files.items():
            with open(os.path.join(staging, name), "wb") as f:
                f.write(data)
        os.rename(staging, folder)  # atomic; fails where a folder of that name has files
    except OSError as exc:
        os.close(fd)
        shutil.rmtree(staging, ignore_errors=True)
        if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
            raise Taken(folder) from None
        raise
    return fd


def release(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)
