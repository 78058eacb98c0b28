"""Where big values' bytes go: shared memory while it has room, else a private folder on
disk, else the message itself.

A pool's shared-memory folder (``/dev/shm/nbddp-PID-L...``) is made with a twin on disk
(``$TMPDIR/nbddp-PID-L...``: the same name, 0700, locked and removed with it), so every
process that knows the one knows the other. ``/dev/shm`` is often small (64 MB under
Docker's default, in Kubernetes pods) or full: a file that would not leave it room
(``os.statvfs``, checked before each write) goes to the twin instead, and a write that
still runs out of space (``ENOSPC``, another writer was faster) is undone and the whole
value written again one carrier further (:class:`Route`). Files on disk are read by
their receivers, not mapped, so a receiver's tensor holds no disk space once the file
is removed. Whichever process first sends a file past ``/dev/shm`` leaves an empty
marker in the folder, which the pool reads to say so once (:func:`spilled`).

This module also makes and removes the locked folders themselves (:func:`shm_dir`,
:func:`locked_dir`), so one place knows how a folder and its twin live and die.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import tempfile

from .private import UnsafeFile, checked_folder, hold, remove_if_unheld

__all__ = [
    "SHM",
    "NoSpace",
    "Route",
    "locked_dir",
    "private_dir",
    "remove_locked_dir",
    "shm_dir",
    "spilled",
    "twin",
]

SHM = "/dev/shm"
RESERVE = 64 << 20  # left free in a folder's filesystem: at most this, at least 1/8 of it
_MARK = ".spilled-"  # + "disk" or "message": a marker's name in the pool's folder


# ---------------------------------------------------------------- folders and their twins


def shm_dir() -> str:
    """A fresh private (0700) directory on tmpfs (or in the temp dir without /dev/shm),
    with its twin on disk (:func:`twin`) where there is one.

    This process holds a lock on it (``flock`` on the directory) for as long as
    it lives, so the directories of processes that died without cleaning up are
    removed here, by the next one, and no live one's ever is, even where
    ``/dev/shm`` is shared with other PID namespaces (containers with
    ``--ipc=host``), whose pids mean nothing here. Its name carries this
    process's pid, for people reading ``ls``.
    """
    if not (os.path.isdir(SHM) and os.access(SHM, os.W_OK)):
        return locked_dir(tempfile.gettempdir())
    path = locked_dir(SHM)
    disk = twin(path)
    if disk is not None:
        with contextlib.suppress(OSError):  # (none: values that do not fit go in messages)
            locked_dir(os.path.dirname(disk), os.path.basename(disk))
    return path


def twin(folder: str) -> str | None:
    """The folder on disk paired with ``folder``, a folder in ``/dev/shm`` made by
    :func:`shm_dir` or one inside it: the same path under the temp dir. None for any
    other folder, or where the temp dir is itself in ``/dev/shm``."""
    rel = os.path.relpath(os.path.abspath(folder), SHM)
    disk = os.path.abspath(tempfile.gettempdir())
    if not rel.startswith("nbddp-") or disk == SHM or disk.startswith(SHM + os.sep):
        return None
    return os.path.join(disk, rel)


def locked_dir(base: str, name: str | None = None) -> str:
    """A fresh private (0700) ``base/nbddp-PID-L...`` folder (or ``base/name``), locked
    while this process lives; the folders of processes that died (a SIGKILLed kernel's)
    are removed first."""
    _release_removed()
    _sweep(base)
    # made and locked under a name the sweep never touches, then renamed: no one ever
    # sees it unlocked under its own name
    staging = tempfile.mkdtemp(prefix=".nbddp-new-", dir=base)
    fd = hold(staging)  # (just made: no one else holds it)
    try:
        path = os.path.join(base, name or f"nbddp-{os.getpid()}-{_LOCKED}{secrets.token_hex(8)}")
        os.rename(staging, path)
    except BaseException:
        os.close(fd)
        shutil.rmtree(staging, ignore_errors=True)
        raise
    _held[path] = fd
    return path


_LOCKED = "L"  # starts the last part of a locked folder's name (mkdtemp's names are lowercase)
_held: dict[str, int] = {}  # the folders this process made: their open, locked descriptors


def remove_locked_dir(path: str) -> None:
    """Remove a folder :func:`locked_dir` made here (and its twin), and their locks."""
    for folder in (path, twin(path)):
        if folder is None:
            continue
        shutil.rmtree(folder, ignore_errors=True)
        fd = _held.pop(folder, None)
        if fd is not None:
            os.close(fd)


def _release_removed() -> None:
    """Close the locks of folders made here and since removed (by whoever removed them)."""
    for path, fd in list(_held.items()):
        if os.fstat(fd).st_nlink == 0:
            os.close(fd)
            del _held[path]


def private_dir(path: str) -> str:
    """``path`` if it is a directory only this user can enter, else a one-line error:
    nothing is written into a folder someone else made or can read."""
    try:
        return checked_folder(path)
    except FileNotFoundError:
        raise RuntimeError(f"nbddp's shared-memory folder {path} is gone") from None
    except UnsafeFile as exc:
        raise RuntimeError(str(exc)) from None


def _sweep(base: str) -> None:
    """Remove the ``nbddp-PID-*`` directories no live process holds.

    A folder made by :func:`shm_dir` is removed when its lock can be taken;
    one of the older, unlocked kind (made by an earlier nbddp) when no process
    has its pid here.
    """
    for name in os.listdir(base):
        parts = name.split("-", 2)
        if len(parts) < 3 or parts[0] != "nbddp" or not parts[1].isdigit():
            continue
        path = os.path.join(base, name)
        if parts[2].startswith(_LOCKED):
            remove_if_unheld(path)
            continue
        try:
            os.kill(int(parts[1]), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except PermissionError:
            pass  # someone else's, and alive


# ---------------------------------------------------------------- one value's route


class NoSpace(Exception):
    """A write into ``folder`` ran out of space (the partial file is removed with the
    others): the value is written again, one carrier further."""

    def __init__(self, folder: str) -> None:
        super().__init__(folder)
        self.folder = folder


def full(exc: OSError) -> bool:
    """``exc`` says the filesystem (or the user's quota on it) is full."""
    return exc.errno in (errno.ENOSPC, errno.EDQUOT)


def room(folder: str, nbytes: int) -> bool:
    """``folder``'s filesystem keeps some room free after ``nbytes`` more."""
    try:
        st = os.statvfs(folder)
    except OSError:
        return False
    total, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    return free - nbytes >= min(RESERVE, total // 8)


class Route:
    """Where one value's big files go, in order: ``folder``, then its twin on disk
    (read, not mapped), then inside the pickle (``place`` says None). A folder outside
    ``/dev/shm`` (a workspace) is the only place, unchecked, as it always was."""

    def __init__(self, folder: str | None, read: bool = False) -> None:
        self.first = folder
        disk = twin(folder) if folder is not None else None
        self.checked = disk is not None or _in_shm(folder)
        self.stops: list[tuple[str, bool]] = [] if folder is None else [(folder, read)]
        if disk is not None:
            self.stops.append((disk, True))

    def place(self, nbytes: int) -> tuple[str, bool] | None:
        """(the folder for a file of ``nbytes``, whether its receivers read it); None:
        inside the pickle."""
        for folder, read in self.stops:
            further = folder != self.first  # (the twin: also once the first gave up)
            if not self.checked or (_ready(folder, make=further) and room(folder, nbytes)):
                if further:
                    self._mark("disk")
                return folder, read
        if self.first is not None:
            self._mark("message")
        return None

    def give_up(self, folder: str) -> bool:
        """``folder`` ran out of space: False if there is nothing further to go to."""
        if not self.checked:
            return False
        self.stops = [s for s in self.stops if s[0] != folder]
        return True

    def _mark(self, how: str) -> None:
        """An empty file (no space needed) in the pool's folder: it says once what went."""
        rel = os.path.relpath(os.path.abspath(self.first or ""), SHM)
        if rel.startswith("nbddp-"):
            top = os.path.join(SHM, rel.split(os.sep)[0])
            with contextlib.suppress(OSError):
                flags = os.O_CREAT | os.O_WRONLY | os.O_NOFOLLOW
                os.close(os.open(os.path.join(top, _MARK + how), flags, 0o600))


def _in_shm(folder: str | None) -> bool:
    return folder is not None and os.path.abspath(folder).startswith(SHM + os.sep)


def _ready(folder: str, make: bool) -> bool:
    """``folder`` is there and private; with ``make``, a twin's subfolder (a gather's,
    inside a twin that is there) is made here."""
    sub = os.path.basename(os.path.dirname(folder)).startswith("nbddp-")  # (a twin's own)
    if make and sub and not os.path.exists(folder):
        with contextlib.suppress(OSError):
            os.mkdir(folder, 0o700)
    try:
        checked_folder(folder)
        return True
    except OSError:
        return False


def spilled(folder: str) -> list[str]:
    """What went past the pool's shared-memory ``folder``: ``"disk"``, ``"message"``."""
    return [how for how in ("disk", "message") if os.path.exists(os.path.join(folder, _MARK + how))]
