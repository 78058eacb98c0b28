"""The note on a replaced rank: what its dead process held, what matters named first.

A rank reports every global name with a kind and a size (``P.Held``, measured
on the rank without pickling). The note names modules first, then optimizers,
then the largest tensors and arrays, then the rest by kind and size (never
alphabetically: ``model`` and ``opt`` must not hide in "and 5 more"); it says
which names the notebook had sent (they come again with ``--need`` or automatic
capture), which a survivor healed (``--heal``), and which are gone.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import protocol as P
from .sizes import human

__all__ = ["Healed", "ordered", "replaced_note"]

NAMES_SAID = 12  # the names a dead rank held, said in full up to this many
# modules, optimizers, tensors and arrays by size; then data, functions, classes, the rest
_ORDER = {"module": 0, "optimizer": 1, "tensor": 2, "array": 2, "object": 3, "function": 4,
          "class": 5}  # fmt: skip
_SIZED = ("module", "optimizer", "tensor", "array")


@dataclass(frozen=True)
class Healed:
    """What ``--heal`` did for one new rank: names copied from ``src`` (or why not)."""

    names: tuple[str, ...]
    src: int
    seconds: float
    error: str = ""  # why it could not heal (then ``names`` is what it tried)
    rewrapped: tuple[str, ...] = ()  # the names wrapped again (DDP) on every rank
    missing: tuple[str, ...] = ()  # names the source did not have


def ordered(held) -> list[P.Held]:
    """Modules, optimizers, the largest tensors and arrays, then the rest by kind and size
    (within a kind, the largest first)."""

    def key(h: P.Held) -> tuple:
        order = _ORDER.get(h.kind, 6)
        return order, h.kind if order == 6 else "", -h.nbytes, h.name

    return sorted(held, key=key)


def _said(held: list[P.Held]) -> str:
    words = [f"{h.name} ({h.kind} {human(h.nbytes)})" if h.kind in _SIZED else h.name
             for h in held[:NAMES_SAID]]  # fmt: skip
    more = f" and {len(held) - NAMES_SAID} more" if len(held) > NAMES_SAID else ""
    return ", ".join(words) + more


def _names(names) -> str:
    names = list(names)
    more = f" and {len(names) - NAMES_SAID} more" if len(names) > NAMES_SAID else ""
    return ", ".join(names[:NAMES_SAID]) + more


def _healed(healed: Healed) -> str:
    if healed.error:
        names = _names(healed.names)
        return f"--heal could not copy {names} from rank {healed.src}: {healed.error}"
    wrapped = f", {_names(healed.rewrapped)} wrapped again in DDP on every rank"
    missing = f" (rank {healed.src} has no {_names(healed.missing)})" if healed.missing else ""
    return (
        f"{_names(healed.names)} healed from rank {healed.src} in {healed.seconds:.2f} s"
        + (wrapped if healed.rewrapped else "")
        + missing
    )


def replaced_note(rank: int, dead_held, fresh: frozenset[str], healed: Healed | None) -> str:
    """One line for a rank whose process was replaced: ``dead_held`` is what the dead
    process reported (``P.Held``), ``fresh`` the names a new process starts with."""
    lost = ordered(h for h in dead_held if h.name not in fresh)
    copied = set(healed.names) if healed is not None and not healed.error else set()
    imported = [h.name for h in lost if h.kind == "import" and not h.shipped]
    gone = [h for h in lost if h.kind != "import" and not h.shipped and h.name not in copied]
    sent = [h for h in lost if h.shipped and h.name not in copied]
    parts = [f"rank {rank}: a new process took its place"]
    if healed is not None:
        parts.append(_healed(healed))
    had = f"it had {_said(gone)} (gone)" if gone else ""
    if not gone and not copied:
        had = "it had nothing of its own (as of its last finished cell)"
    if imported:
        imports = f"had imported {_names(sorted(imported))}"
        had = f"{had} and {imports}" if had else f"it {imports}"
    if had:
        parts.append(had)
    if sent:
        parts.append(
            f"{_said(sent)} came from the notebook (--need or automatic capture sends "
            f"{'them' if len(sent) > 1 else 'it'} again)"
        )
    return "; ".join(parts)
