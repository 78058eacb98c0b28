"""How big a shipped object is, measured without copying it; sizes in words and back."""

from __future__ import annotations

import re

from ..wire import payload
from .errors import CaptureError

__all__ = ["human", "parse_size", "size_of"]


def size_of(obj: object, limit: int | None = None) -> int | None:
    """Bytes ``obj`` would ship as (tensors, arrays and modules without pickling them).

    Anything else is pickled into a counter, never into memory: tensors and
    arrays inside it count their bytes and are not pickled. With ``limit``,
    counting stops once past it, and the answer is None ("more than ``limit``").
    """
    import sys

    torch = sys.modules.get("torch")
    if torch is not None:
        if isinstance(obj, torch.Tensor):
            return obj.nelement() * obj.element_size()
        if isinstance(obj, torch.nn.Module):
            tensors = [*obj.parameters(), *obj.buffers()]
            return sum(t.nelement() * t.element_size() for t in tensors) + 1024
    nbytes = getattr(obj, "nbytes", None)
    if isinstance(nbytes, int) and type(obj).__module__.startswith("numpy"):
        return nbytes
    counter = _Counter(limit)
    try:
        _SizePickler(counter).dump(obj)
    except _OverLimit:
        return None
    return counter.nbytes


class _OverLimit(Exception):
    pass


class _Counter:
    """A file that keeps only how many bytes were written to it, and refuses more
    once they are over ``limit``."""

    def __init__(self, limit: int | None) -> None:
        self.nbytes = 0
        self.limit = limit

    def add(self, nbytes: int) -> None:
        self.nbytes += nbytes
        if self.limit is not None and self.nbytes > self.limit:
            raise _OverLimit

    def write(self, data) -> None:  # the pickler never reads what write returns
        self.add(memoryview(data).nbytes)


class _SizePickler(payload._Pickler):
    """Pickles as :func:`payload.dumps` does, except that a tensor or a numeric array
    adds its bytes to the count and is pickled as a stand-in (``int()``)."""

    def __init__(self, counter: _Counter) -> None:
        super().__init__(counter)  # no folder: everything as if inline
        self.counter = counter

    def reducer_override(self, obj):
        import sys

        torch, np = sys.modules.get("torch"), sys.modules.get("numpy")
        if torch is not None and isinstance(obj, torch.Tensor):
            self.counter.add(obj.nelement() * obj.element_size())
            return int, ()
        if np is not None and type(obj) is np.ndarray and not obj.dtype.hasobject:
            self.counter.add(obj.nbytes)
            return int, ()
        return super().reducer_override(obj)


def human(nbytes: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if nbytes < 1024 or unit == "GB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.1f} GB"


def parse_size(text: str) -> int:
    """``"100MB"``, ``"1.5GB"``, ``"512KB"`` or a number of megabytes -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?B?)?\s*", text, re.I)  # pragma: no mutate
    if not m:
        raise CaptureError(f"not a size: {text!r} (say 100MB, 1GB, 512KB)")
    unit = (m.group(2) or "MB").upper().rstrip("B") or "B"  # pragma: no mutate (case)
    return int(float(m.group(1)) * {"B": 1, "K": 2**10, "M": 2**20, "G": 2**30}[unit])
