"""What the notebook sent to a pool, to send only what changed, and the version of each
object it sent, so a rank that holds it already keeps its own (:class:`Shipped`)."""

from __future__ import annotations

import itertools
import secrets
import weakref

from ..wire import protocol as P

__all__ = ["Shipped"]

_GONE = object()  # what a record of a collected object answers
_UNBOUND = object()  # what a namespace without the name answers (never a record's)


class Shipped:
    """What the notebook sent to one generation of a pool, to send only what changed, and
    a version of each object it ever sent, so a rank that holds it already keeps its own.

    An object counts as unchanged while the notebook binds the same object to
    the name (in-place changes are not seen: ``--need`` ships those). Its version
    stays the same across generations, so after a rank is replaced (a new
    generation) the object goes again for the new rank, while the others keep
    the copy they hold, changed in place or not.
    """

    def __init__(self) -> None:
        self.generation = -1  # pragma: no mutate (any number no pool has)
        self._sent: dict[str, object] = {}
        self._versions: dict[str, tuple[object, int]] = {}  # name -> (ref, version)
        self._names: set[str] = set()  # every name it ever gave a version
        # this notebook's versions: its random tag, then a count (P.kernel_of): a rank
        # that holds another kernel's object (a detached pool) knows it is not ours
        self.tag = secrets.randbits(40)
        self._count = itertools.count((self.tag << P.VERSION_COUNT_BITS) + 1)

    def _ref(self, obj: object):
        try:
            ref = weakref.ref(obj)
            return lambda: ref() if ref() is not None else _GONE  # (not None: a value)
        except TypeError:  # ints, strs, lists, dicts: small, held as they are
            return lambda: obj

    def _at(self, generation: int) -> None:
        if generation != self.generation:
            self.generation, self._sent = generation, {}

    def unchanged(self, generation: int, name: str, obj: object) -> bool:
        self._at(generation)
        ref = self._sent.get(name)
        return ref is not None and ref() is obj

    def sent(self, generation: int, name: str, obj: object) -> None:
        """Every rank of ``generation`` holds ``obj`` as ``name`` now."""
        self._at(generation)
        self._sent[name] = self._ref(obj)

    def names(self) -> frozenset[str]:
        """The names this notebook ever shipped."""
        return frozenset(self._names)

    def forget_unbound(self, namespace: dict) -> None:
        """Let go of what ``namespace`` (the notebook's) no longer binds to its name,
        deleted or rebound: such a record can only say "changed" again, and for a list,
        dict or str (held as it is: no weak reference) it kept the object alive."""
        bound = namespace.get
        for name in [n for n, ref in self._sent.items() if ref() is not bound(n, _UNBOUND)]:
            del self._sent[name]
        for name in [
            n for n, (ref, _) in self._versions.items() if ref() is not bound(n, _UNBOUND)
        ]:
            del self._versions[name]

    def versions(self, objects: dict[str, object]) -> dict[str, int]:
        """Each object's version: the same while the notebook binds the same object."""
        out = {}
        for name, obj in objects.items():
            ref, version = self._versions.get(name, (None, 0))
            if ref is None or ref() is not obj:
                version = next(self._count)
                self._versions[name] = (self._ref(obj), version)
                self._names.add(name)
            out[name] = version
        return out
