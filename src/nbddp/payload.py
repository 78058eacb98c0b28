"""Objects to bytes and back, with big tensors through shared memory.

``dumps`` is cloudpickle, except that tensors are pickled as views of their
storage, each storage once, so tensors that shared one (``a`` and ``a[2:5]``)
still share one when loaded, as with ``torch.save``; and each storage (or
numpy array) of at least ``SHM_MIN_BYTES`` is written once to a file in a
private tmpfs directory (``/dev/shm``) and pickled as a reference to it (only
the bytes its tensors reach are written; the rest of the file is a hole). ``loads`` maps
that file privately (``torch.from_file(shared=False)``): the receiver gets a
tensor of its own (writes stay private, it outlives the file's unlinking)
whose pages are shared with every other receiver until written. So one
notebook object reaches N ranks with one write, not N pickles, and the
notebook never holds extra copies (the file is written with ``write(2)``,
never mapped).

CUDA tensors travel the same way and land on the receiver's own device.
Whoever calls ``dumps`` removes the files once every receiver has loaded.
"""

from __future__ import annotations

import io
import itertools
import os
import pickle
import secrets
import shutil
import tempfile

import cloudpickle
import torch

from .private import UnsafeFile, checked_folder, hold, remove_if_unheld

__all__ = [
    "SHM_MIN_BYTES",
    "Refused",
    "Shipment",
    "dumps",
    "loads",
    "locked_dir",
    "private_dir",
    "remove_locked_dir",
    "shm_dir",
]

SHM_MIN_BYTES = 1 << 20
_counter = itertools.count()


def shm_dir() -> str:
    """A fresh private (0700) directory on tmpfs (or in the temp dir without /dev/shm).

    This process holds a lock on it (``flock`` on the directory) for as long as
    it lives, so the directories of processes that died without cleaning up are
    removed here, by the next one, and no live one's ever is, even where
    ``/dev/shm`` is shared with other PID namespaces (containers with
    ``--ipc=host``), whose pids mean nothing here. Its name carries this
    process's pid, for people reading ``ls``.
    """
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    return locked_dir(base or tempfile.gettempdir())


def locked_dir(base: str) -> str:
    """A fresh private (0700) ``base/nbddp-PID-L...`` folder, locked while this process
    lives; the folders of processes that died (a SIGKILLed kernel's) are removed first."""
    _release_removed()
    _sweep(base)
    # made and locked under a name the sweep never touches, then renamed: no one ever
    # sees it unlocked under its own name
    staging = tempfile.mkdtemp(prefix=".nbddp-new-", dir=base)
    fd = hold(staging)  # (just made: no one else holds it)
    try:
        path = os.path.join(base, f"nbddp-{os.getpid()}-{_LOCKED}{secrets.token_hex(8)}")
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
    """Remove a folder :func:`locked_dir` made here, and let its lock go with it."""
    shutil.rmtree(path, ignore_errors=True)
    fd = _held.pop(path, None)
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


class Shipment:
    """The pickled bytes and the files they refer to (to remove once loaded)."""

    def __init__(self, data: bytes, files: list[str]) -> None:
        self.data = data
        self.files = files
        self.nbytes = len(data) + sum(os.path.getsize(f) for f in files if os.path.exists(f))

    def remove(self) -> None:
        for path in self.files:
            try:
                os.unlink(path)
            except (FileNotFoundError, IsADirectoryError, PermissionError):
                pass  # gone already, or not a file of ours
        self.files = []


def _write(path: str, tensor: torch.Tensor) -> None:
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    view = memoryview(raw)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    try:
        done = 0
        while done < len(view):
            done += os.write(fd, view[done : done + (1 << 30)])
    finally:
        os.close(fd)


def _load_storage_file(path: str, nbytes: int, to_device: bool) -> torch.UntypedStorage:
    raw = torch.from_file(path, shared=False, size=nbytes, dtype=torch.uint8)
    return (raw.to(_rank_device()) if to_device else raw).untyped_storage()


def _read_storage_file(path: str, nbytes: int, to_device: bool) -> torch.UntypedStorage:
    raw = _read_file(path, nbytes)
    return (raw.to(_rank_device()) if to_device else raw).untyped_storage()


def _read_file(path: str, nbytes: int) -> torch.Tensor:
    """The file's bytes read into memory, not mapped: for a file on a shared folder (NFS),
    which its writer (on another host) may remove as soon as this returns."""
    raw = torch.empty(nbytes, dtype=torch.uint8)
    view = memoryview(raw.numpy())
    with open(path, "rb", buffering=0) as f:
        done = 0
        while done < nbytes:
            n = f.readinto(view[done:])
            if not n:
                raise EOFError(f"{path} ends at byte {done} of {nbytes}")
            done += n
    return raw


def _load_storage_inline(data: bytearray, to_device: bool) -> torch.UntypedStorage:
    raw = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    return (raw.to(_rank_device()) if to_device else raw).untyped_storage()


def _load_view(
    storage: torch.UntypedStorage,
    dtype: torch.dtype,
    shape: tuple,
    stride: tuple,
    offset: int,
    requires_grad: bool,
    parameter: bool,
    attrs: dict | None,
) -> torch.Tensor:
    """One tensor on a storage that every view of it pickled alongside shares."""
    t = torch.empty(0, dtype=dtype, device=storage.device).set_(storage, offset, shape, stride)
    if parameter:
        t = torch.nn.Parameter(t, requires_grad=requires_grad)
    elif requires_grad:
        t.requires_grad_(True)
    for name, value in (attrs or {}).items():
        setattr(t, name, value)
    return t


class _Storage:
    """A storage some tensors being pickled are views of: pickled once (the pickle's
    memo), so the views come back as views of one storage, as ``torch.save`` keeps them.

    With a file, only the bytes the views cover are written (the rest is a hole)."""

    def __init__(
        self, storage: torch.UntypedStorage, device: torch.device, path: str | None, read: bool
    ):
        self.storage, self.device, self.path, self.read = storage, device, path, read
        self.written: list[tuple[int, int]] = []
        if path is not None:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
            try:
                os.ftruncate(fd, storage.nbytes())
            finally:
                os.close(fd)

    def _bytes(self, start: int, stop: int):
        raw = torch.empty(0, dtype=torch.uint8, device=self.device)
        raw.set_(self.storage, start, (stop - start,), (1,))
        return memoryview(raw.cpu().numpy())

    def cover(self, t: torch.Tensor) -> None:
        """Write the bytes of the storage ``t`` can reach to the file (once)."""
        if t.numel() == 0:
            return
        last = t.storage_offset() + sum(
            (n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True)
        )
        start, stop = t.storage_offset() * t.element_size(), (last + 1) * t.element_size()
        if any(a <= start and stop <= b for a, b in self.written):
            return
        view = self._bytes(start, stop)
        fd = os.open(self.path, os.O_WRONLY)
        try:
            done = 0
            while done < len(view):
                done += os.pwrite(fd, view[done : done + (1 << 30)], start + done)
        finally:
            os.close(fd)
        self.written.append((start, stop))

    def reduce(self):
        cuda = self.device.type == "cuda"
        if self.path is not None:
            load = _read_storage_file if self.read else _load_storage_file
            return load, (self.path, self.storage.nbytes(), cuda)
        return _load_storage_inline, (
            pickle.PickleBuffer(self._bytes(0, self.storage.nbytes())),
            cuda,
        )


def _load_array(path: str, dtype: str, shape: tuple, read: bool = False):
    import numpy as np

    size = os.path.getsize(path)
    if read:
        raw = _read_file(path, size)
    else:
        raw = torch.from_file(path, shared=False, size=size, dtype=torch.uint8)
    return raw.numpy().view(np.dtype(dtype)).reshape(shape)


def _rank_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class Refused(TypeError):
    """An object ``dumps`` was told to refuse (its ``refuse`` said what it is)."""


class _Pickler(cloudpickle.CloudPickler):
    def __init__(
        self,
        file,
        directory: str | None = None,
        min_bytes: int = SHM_MIN_BYTES,
        refuse=None,
        read: bool = False,
    ) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.directory, self.read = directory, read
        self.min_bytes = min_bytes
        self.refuse = refuse
        self.files: list[str] = []
        self.storages: dict[tuple, _Storage] = {}  # by device and address

    def _path(self) -> str:
        path = os.path.join(self.directory, f"{secrets.token_hex(8)}-{next(_counter)}")
        self.files.append(path)
        return path

    def reducer_override(self, obj):
        if isinstance(obj, io.IOBase) and not isinstance(obj, io.BytesIO | io.StringIO):
            # cloudpickle would send a snapshot of a readable file's contents: not the file
            raise TypeError(
                f"cannot pickle an open file ({getattr(obj, 'name', type(obj).__name__)}): "
                "open it on the ranks instead"
            )
        if isinstance(obj, _Storage):
            return obj.reduce()
        if self.refuse is not None and (what := self.refuse(obj)) is not None:
            raise Refused(what)
        if isinstance(obj, torch.Tensor) and self._fits(obj):
            return self._reduce_tensor(obj)
        if self.directory is not None:
            np = _numpy()
            if np is not None and type(obj) is np.ndarray and self._fits_array(obj):
                path = self._path()
                _write(path, torch.from_numpy(np.ascontiguousarray(obj)).reshape(-1))
                return _load_array, (path, obj.dtype.str, obj.shape, self.read)
        return super().reducer_override(obj)

    def _fits(self, t: torch.Tensor) -> bool:
        """A tensor made of its storage, dtype, shape, strides, offset, grad flag and
        attributes (everything else, as torch pickles it)."""
        return (
            type(t) in (torch.Tensor, torch.nn.Parameter)
            and t.layout == torch.strided
            and t.device.type in ("cpu", "cuda")
            and not (t.is_quantized or t.is_nested or t.is_conj() or t.is_neg())
            and (t.is_leaf or not t.requires_grad)
        )

    def _fits_array(self, a) -> bool:
        return a.nbytes >= self.min_bytes and a.dtype.hasobject is False and a.dtype.kind in "biufc"

    def _reduce_tensor(self, t: torch.Tensor):
        storage = t.untyped_storage()
        key = (t.device, storage.data_ptr(), storage.nbytes())
        holder = self.storages.get(key)
        if holder is None:
            big = self.directory is not None and storage.nbytes() >= max(self.min_bytes, 1)
            path = self._path() if big else None
            holder = self.storages[key] = _Storage(storage, t.device, path, self.read)
        if holder.path is not None:
            holder.cover(t)
        args = (
            holder,
            t.dtype,
            tuple(t.shape),
            t.stride(),
            t.storage_offset(),
            t.requires_grad,
            isinstance(t, torch.nn.Parameter),
            dict(t.__dict__) or None,
        )
        return _load_view, args


def _numpy():
    import sys

    return sys.modules.get("numpy")


def dumps(
    obj: object,
    directory: str | None = None,
    min_bytes: int = SHM_MIN_BYTES,
    refuse=None,
    read: bool = False,
) -> Shipment:
    """Pickle ``obj``; with ``directory``, big tensors go to files there, which the
    receiver maps (or with ``read``, reads into memory: a folder other hosts share, whose
    files their writer may remove once it is loaded). ``refuse(o)``, if given, says what
    an object that must not go is (then :class:`Refused`)."""
    buf = io.BytesIO()
    pickler = _Pickler(buf, directory, min_bytes, refuse, read)
    try:
        pickler.dump(obj)
    except BaseException:
        Shipment(b"", pickler.files).remove()
        raise
    return Shipment(buf.getvalue(), pickler.files)


def loads(data: bytes) -> object:
    return pickle.loads(data)
