"""Messages to bytes and back, and nothing else: what a control message may decode to.

:mod:`nbddp.wire.protocol` defines the messages; a :class:`Codec` made from it turns them into
bytes and back (``P.dumps``, ``P.loads``, ``P.loads_plain``). Decoding is restricted:
only the given modules' message classes and plain data (numbers, strings, bytes,
tuples, lists, dicts, sets) come out; a pickle naming any other class or function is
refused, and one naming a class those modules lack is said to come from another version.
"""

from __future__ import annotations

import builtins
import dataclasses
import io
import pickle
import sys
from types import ModuleType

__all__ = ["Codec"]

_PLAIN = frozenset({"set", "frozenset", "complex", "bytearray", "range", "slice"})


class Codec:
    """Encode ``module``'s messages (its dataclasses but ``parts``, which only travel inside
    one); decode them, and the dataclasses of ``module`` and ``also``, and plain data."""

    def __init__(self, module: ModuleType, also: tuple[ModuleType, ...], parts: tuple) -> None:
        self.messages = _messages(module, parts)
        self.allowed = _allowed((module, *also))
        self.modules = tuple(m.__name__ for m in (module, *also))
        self._unpickler = type("Restricted", (_Restricted,), {"codec": self})

    def dumps(self, msg: object) -> bytes:
        if type(msg) not in self.messages:
            raise TypeError(f"not a protocol message: {type(msg).__name__}")
        return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)

    def loads_plain(self, data) -> object:
        """Decode nbddp's own data (a message, a relay's frame) without running anything."""
        return self._unpickler(io.BytesIO(data)).load()

    def loads(self, data) -> object:
        msg = self.loads_plain(data)
        if type(msg) not in self.messages:
            raise TypeError(f"not a protocol message: {type(msg).__name__}")
        return msg


class _Restricted(pickle.Unpickler):
    """Plain data and the classes a :class:`Codec` allows, nothing else (each codec has a
    subclass of its own, whose ``codec`` is that codec)."""

    codec: Codec

    def find_class(self, module: str, name: str):
        found = self.codec.allowed.get((module, name))
        if found is not None:
            return found
        if module in self.codec.modules and not hasattr(sys.modules[module], name):
            # a message this version lacks: another nbddp version
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        raise pickle.UnpicklingError(f"a control message may not name {module}.{name}")


def _messages(module: ModuleType, parts: tuple) -> tuple:
    """Every message class of ``module``: its own dataclasses, but ``parts``."""
    return tuple(
        obj
        for obj in list(vars(module).values())
        if isinstance(obj, type)
        and obj.__module__ == module.__name__
        and dataclasses.is_dataclass(obj)
        and obj not in parts
    )


def _allowed(modules: tuple[ModuleType, ...]) -> dict:
    """What a control message may name, by (module, name): looked up once each."""
    out = {("builtins", n): getattr(builtins, n) for n in _PLAIN}
    for module in modules:
        for name, obj in vars(module).items():
            ours = isinstance(obj, type) and obj.__module__ == module.__name__
            if ours and dataclasses.is_dataclass(obj):
                out[(module.__name__, name)] = obj
    return out
