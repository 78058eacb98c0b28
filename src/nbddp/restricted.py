"""Pickles that may name only the classes given: how nbddp's own data is decoded.

A control message (nbddp.protocol) is a pickle, and a pickle can name any class or
function to run as it loads. :class:`Restricted` loads plain data (numbers,
strings, bytes, tuples, lists, dicts, sets) and the dataclasses of the modules it is
given, and refuses anything else, so decoding a message runs nothing.
"""

from __future__ import annotations

import builtins
import dataclasses
import io
import pickle
import sys
from types import ModuleType

__all__ = ["Restricted", "allowed"]

_PLAIN = frozenset({"set", "frozenset", "complex", "bytearray", "range", "slice"})


def allowed(modules: tuple[ModuleType, ...]) -> dict:
    """What a pickle may name, by (module, name): the plain builtins and the dataclasses
    defined in ``modules``, looked up once each."""
    out = {("builtins", n): getattr(builtins, n) for n in _PLAIN}
    for module in modules:
        for name, obj in vars(module).items():
            ours = isinstance(obj, type) and obj.__module__ == module.__name__
            if ours and dataclasses.is_dataclass(obj):
                out[(module.__name__, name)] = obj
    return out


class Restricted(pickle.Unpickler):
    """Loads ``data`` naming only what ``names`` (from :func:`allowed`) holds; a name
    ``modules`` lack is another nbddp version's (AttributeError, not a refusal)."""

    def __init__(self, data, names: dict, modules: frozenset[str]) -> None:
        super().__init__(io.BytesIO(data))
        self.names, self.modules = names, modules

    def find_class(self, module: str, name: str):
        found = self.names.get((module, name))
        if found is not None:
            return found
        if module in self.modules and not hasattr(sys.modules[module], name):
            # a message this version lacks: another nbddp version
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        raise pickle.UnpicklingError(f"a control message may not name {module}.{name}")
