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

Where ``/dev/shm`` is small or full (Docker's default 64 MB), a file that does not fit
goes to a private folder on disk instead, read by its receivers rather than mapped, or
into the pickle: :mod:`nbddp.wire.carriers` says where, and makes and removes the folders.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import os
import pickle
import secrets

import cloudpickle
import torch

from . import carriers
from .carriers import locked_dir, private_dir, remove_locked_dir, shm_dir

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
    with _space(path):
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        try:
            _put(fd, memoryview(raw), 0)
        finally:
            os.close(fd)


def _put(fd: int, view: memoryview, at: int) -> None:
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done : done + (1 << 30)], at + done)


@contextlib.contextmanager
def _space(path: str):
    """Around a write to ``path``: a full filesystem is :class:`carriers.NoSpace` (the
    value is written again one carrier further; its files, this one too, are removed)."""
    try:
        yield
    except OSError as exc:
        if carriers.full(exc):
            raise carriers.NoSpace(os.path.dirname(path)) from exc
        raise


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
            with _space(path):
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
        with _space(self.path):
            fd = os.open(self.path, os.O_WRONLY)
            try:
                _put(fd, view, start)
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
        route: carriers.Route | None = None,
        min_bytes: int = SHM_MIN_BYTES,
        refuse=None,
    ) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.route = route
        self.min_bytes = min_bytes
        self.refuse = refuse
        self.files: list[str] = []
        self.storages: dict[tuple, _Storage] = {}  # by device and address

    def _path(self, nbytes: int) -> tuple[str | None, bool]:
        """(a new file's path for ``nbytes``, whether its receivers read it): where the
        route has room; (None, False): inside the pickle."""
        place = self.route.place(nbytes) if self.route is not None else None
        if place is None:
            return None, False
        path = os.path.join(place[0], f"{secrets.token_hex(8)}-{next(_counter)}")
        self.files.append(path)
        return path, place[1]

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
        if self.route is not None:
            np = _numpy()
            if np is not None and type(obj) is np.ndarray and self._fits_array(obj):
                path, read = self._path(obj.nbytes)
                if path is not None:
                    _write(path, torch.from_numpy(np.ascontiguousarray(obj)).reshape(-1))
                    return _load_array, (path, obj.dtype.str, obj.shape, read)
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
            big = self.route is not None and storage.nbytes() >= max(self.min_bytes, 1)
            path, read = self._path(storage.nbytes()) if big else (None, False)
            holder = self.storages[key] = _Storage(storage, t.device, path, read)
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
    an object that must not go is (then :class:`Refused`).

    A ``directory`` in ``/dev/shm`` that is full or too small passes files on to its
    twin on disk, else into the pickle (:class:`carriers.Route`): nothing is lost, and
    nothing is left in it."""
    route = carriers.Route(directory, read) if directory is not None else None
    while True:
        buf = io.BytesIO()
        pickler = _Pickler(buf, route, min_bytes, refuse)
        try:
            pickler.dump(obj)
        except carriers.NoSpace as exc:  # another writer took the room first: further on
            Shipment(b"", pickler.files).remove()
            if route is None or not route.give_up(exc.folder):
                raise exc.__cause__ from None
            continue
        except BaseException:
            Shipment(b"", pickler.files).remove()
            raise
        return Shipment(buf.getvalue(), pickler.files)


def loads(data: bytes) -> object:
    return pickle.loads(data)
