"""Files only this user may read: the token file, a pool's own files, --log-dir, and
a workspace's (a folder the hosts share).

One implementation of each rule, the way ssh treats its keys:

- a private file is created with ``O_EXCL | O_NOFOLLOW`` and mode 0600 (a file
  that is replaced is written beside it and renamed over it, never rewritten
  through a link someone planted);
- a private file is read only when it is a regular file of this user that
  nobody else can read, opened without following a symlink; anything else is
  refused in one line that says what is wrong and how to fix it;
- a folder is made with mode 0700; a folder that exists is used as it is,
  never loosened (nor tightened behind the user's back); a workspace that
  another user owns or can write in is refused.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import shutil
import stat

__all__ = [
    "DEFAULT_TOKEN_FILE",
    "TokenFile",
    "UnsafeFile",
    "append_private",
    "checked_folder",
    "hold",
    "is_private_folder",
    "locked",
    "make_folder",
    "open_private",
    "private_folder",
    "read_private",
    "read_token_file",
    "remove_if_unheld",
    "replace_private",
    "sweep",
    "workspace_folder",
    "write_private",
    "write_token_file",
]

DEFAULT_TOKEN_FILE = "~/.nbddp/token"
_PIN = "tls-sha256"  # the token file's line that pins the notebook's TLS certificate


class UnsafeFile(PermissionError):
    """A file or folder nbddp will not trust: the message says why, in one line."""


def make_folder(path: str) -> str:
    """``path`` and its missing parents, made with mode 0700 (existing ones left as they are)."""
    missing = []
    here = os.path.abspath(path)
    while not os.path.isdir(here) and here != os.path.dirname(here):
        missing.append(here)
        here = os.path.dirname(here)
    for folder in reversed(missing):
        with contextlib.suppress(FileExistsError):  # (made meanwhile by another process)
            os.mkdir(folder, 0o700)
    return path


def is_private_folder(st: os.stat_result) -> bool:
    """``st`` (an lstat) is a folder of this user that nobody else can enter."""
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077


def private_folder(path: str) -> str:
    """Make ``path`` (0700) if missing; refuse it unless it is a folder of this user that
    nobody else can enter."""
    return checked_folder(make_folder(path))


def checked_folder(path: str) -> str:
    """``path`` if it is a folder of this user that nobody else can enter (not through a
    symlink), else :class:`UnsafeFile` in one line (FileNotFoundError if it is gone)."""
    st = os.lstat(path)
    if not is_private_folder(st):
        raise UnsafeFile(
            f"refusing to write into {path}: not a private folder of this user (owner uid "
            f"{st.st_uid}, mode {stat.filemode(st.st_mode)})"
        )
    return path


def workspace_folder(path: str) -> str:
    """A folder the hosts share (``~`` expanded, absolute): made 0700 with its missing
    parents; refused in one line unless it is a folder of this user that no one else can
    write in (a symlink to it is followed, and its target checked)."""
    path = os.path.abspath(os.path.expanduser(path))
    make_folder(path)
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeFile(f"refusing the workspace {path}: not a folder")
    if st.st_uid != os.getuid():
        raise UnsafeFile(
            f"refusing the workspace {path}: it belongs to uid {st.st_uid}, not to this user "
            f"(uid {os.getuid()}); name a folder of your own"
        )
    if st.st_mode & 0o022:
        raise UnsafeFile(
            f"refusing the workspace {path}: other users can write in it (mode "
            f"{stat.filemode(st.st_mode)}); chmod 700 {path}, or name a folder only you can write"
        )
    return path


def write_private(path: str, data: bytes) -> None:
    """Write ``data`` to a new 0600 file at ``path`` (replacing a file there by a rename)."""
    replace_private(path, lambda f: f.write(data))


def replace_private(path: str, fill, sync: bool = False) -> None:
    """A new 0600 file at ``path``, written by ``fill(file)`` beside it (``.NAME.XXXX``)
    and renamed over it: a reader sees the old file or the whole new one, never a part.
    ``sync``: on disk before the rename (a crash leaves one or the other too)."""
    folder = os.path.dirname(path) or "."
    temp = os.path.join(folder, f".{os.path.basename(path)}.{secrets.token_hex(6)}")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            fill(f)
            if sync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise


def append_private(path: str):
    """A text file opened for appending: made 0600 if new; never through a symlink."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
    return os.fdopen(fd, "a", encoding="utf-8", buffering=1)


def read_private(path: str, what: str = "file", limit: int = 1 << 16) -> bytes:
    """The bytes of ``path`` (at most ``limit``), if only this user can read it."""
    with open_private(path, what) as f:
        return f.read(limit)


def open_private(path: str, what: str = "file"):
    """``path`` opened for reading (binary), if it is a regular file of this user that no
    one else can read, opened without following a symlink; else :class:`UnsafeFile`."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == 40:  # ELOOP: the last part is a symlink
            raise UnsafeFile(f"refusing the {what} {path}: it is a symlink") from None
        raise
    st = os.fstat(fd)
    problem = None
    if not stat.S_ISREG(st.st_mode):
        problem = "not a regular file"
    elif st.st_uid != os.getuid():
        problem = f"it belongs to uid {st.st_uid}, not to this user (uid {os.getuid()})"
    elif st.st_mode & 0o077:
        problem = f"others can read it (mode {stat.filemode(st.st_mode)}); chmod 600 {path}"
    if problem:
        os.close(fd)
        raise UnsafeFile(f"refusing the {what} {path}: {problem}")
    return os.fdopen(fd, "rb")


class TokenFile:
    """What a token file holds: the token, the pinned certificate of the last --tls pool
    attached with it (``pin``), and each pool's own by its port (``pins``: "" for a pool
    without TLS), so that a host of an earlier pool that comes back still reaches it."""

    def __init__(self, token: bytes, pin: str = "", pins: dict[int, str] | None = None) -> None:
        self.token, self.pin, self.pins = token, pin, dict(pins or {})

    def pin_for(self, port: int | None) -> str:
        """The pin for the pool that listens on ``port`` ("": no TLS)."""
        return self.pins.get(port, self.pin) if port is not None else self.pin


PINS_KEPT = 16  # pools' own pins a token file keeps (the latest)


def read_token_file(path: str) -> TokenFile:
    """The token file at ``path``: refused in one line unless only this user can read it."""
    lines = read_private(os.path.expanduser(path), "token file").decode(errors="replace")
    token, *rest = lines.splitlines() or [""]
    held = TokenFile(token.strip().encode())
    for line in rest:
        key, value, port, *_ = (*line.split(), "", "", "")
        if key != _PIN:
            continue
        if not port:
            held.pin = value
        elif port.isdigit() and int(port) < 65536:
            held.pins[int(port)] = "" if value == "-" else value
    return held


def write_token_file(path: str, pin: str | None = None, port: int | None = None) -> TokenFile:
    """Read the token file at ``path``, or make one with a new random token.

    ``pin``: write this certificate fingerprint into it ("" removes the pin; None leaves
    the file as it is); with ``port``, as the pin of the pool listening there ("": that
    pool has no TLS), beside the others. The folder is made 0700 if missing.
    """
    path = os.path.expanduser(path)
    make_folder(os.path.dirname(path) or ".")
    try:
        current = read_token_file(path)
    except FileNotFoundError:
        current = TokenFile(b"")
    if not current.token:
        current = TokenFile(secrets.token_hex(32).encode(), "")
    elif pin is None or (current.pin if port is None else current.pins.get(port)) == pin:
        return current
    if pin is not None and port is None:
        current.pin = pin
    elif pin is not None:
        current.pins.pop(port, None)
        current.pins[port] = pin  # (the latest last)
    kept = list(current.pins.items())[-PINS_KEPT:]
    current.pins = dict(kept)
    lines = [current.token.decode()] + ([f"{_PIN} {current.pin}"] if current.pin else [])
    lines += [f"{_PIN} {value or '-'} {number}" for number, value in kept]
    write_private(path, "\n".join(lines).encode() + b"\n")
    return current


# ---------------------------------------------------------------- folders that die with a process


def hold(folder: str) -> int | None:
    """Lock ``folder`` (flock) for as long as this process (or a child it forks) lives:
    :func:`remove_if_unheld` leaves it alone meanwhile. The lock's fd; None if held."""
    return locked(os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW))


def locked(fd: int) -> int | None:
    """``fd`` with an exclusive flock taken at once; None (``fd`` closed) if another
    process holds one."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def remove_if_unheld(path: str) -> bool:
    """Remove the folder ``path`` if no live process holds it (:func:`hold`)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return False  # gone, not a directory, or not ours to enter
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False  # its owner lives
    else:
        shutil.rmtree(path, ignore_errors=True)
        return True
    finally:
        os.close(fd)


def sweep(base: str, prefix: str, older_than: float = 60.0) -> None:
    """Remove this user's folders ``base/prefix*`` that no live process holds and that
    are older than ``older_than`` s (one being made now is not held yet)."""
    import time

    try:
        names = os.listdir(base)
    except OSError:
        return
    now = time.time()
    for name in names:
        if not name.startswith(prefix):
            continue
        path = os.path.join(base, name)
        with contextlib.suppress(OSError):
            st = os.lstat(path)
            if (
                st.st_uid == os.getuid()
                and stat.S_ISDIR(st.st_mode)
                and now - st.st_mtime > older_than
            ):
                remove_if_unheld(path)
