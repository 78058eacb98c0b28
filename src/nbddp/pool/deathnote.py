"""The note on a replaced rank: what its dead process held, what matters named first.

A rank reports every global name with a kind and a size (``P.Held``, measured
on the rank without pickling). The note names modules first, then optimizers,
then the largest tensors and arrays, then the rest by kind and size (never
alphabetically: ``model`` and ``opt`` must not hide in "and 5 more"); it says
which names the notebook had sent (they come again with ``--need`` or automatic
capture), which a survivor healed (``--heal``), and which are gone. The lines on what a
new rank re-ran (:mod:`nbddp.pool.rerun`) and what it still lacks are worded here too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..wire import protocol as P
from ..wire.stacks import rank_set

__all__ = [
    "Healed",
    "healed_words",
    "killer_hint",
    "not_reran",
    "ordered",
    "replaced_note",
    "reran",
    "rerun_failed",
    "still_lacks",
]

NAMES_SAID = 12  # the names a dead rank held, said in full up to this many
# modules, optimizers, tensors and arrays by size; then data, functions, classes, the rest
_ORDER = {"module": 0, "optimizer": 1, "tensor": 2, "array": 2, "object": 3, "function": 4,
          "class": 5}  # fmt: skip


@dataclass(frozen=True)
class Healed:
    """What ``--heal`` did for one new rank: names copied from ``src`` (or why not)."""

    names: tuple[str, ...]
    src: int
    seconds: float
    error: str = ""  # why it could not heal (then ``names`` is what it tried)
    rewrapped: tuple[str, ...] = ()  # the names wrapped again (DDP) on every rank
    missing: tuple[str, ...] = ()  # names the source did not have


# a cell that sends SIGKILL itself: os.kill(pid, signal.SIGKILL), os.kill(pid, 9), kill -9
_SENDS_SIGKILL = re.compile(r"SIGKILL|\bkill(?:pg)?\s*\(.*,\s*9\s*\)|\bkill\s+-(?:9|KILL)\b")


def killer_hint(rank: int, code: str) -> list[str]:
    """Who sent a rank SIGKILL, when nbddp did not: the out-of-memory killer, usually; no
    hint when the cell's own code sends SIGKILL (it named the sender itself)."""
    if _SENDS_SIGKILL.search(code):
        return []
    return [
        f"nothing in nbddp sent rank {rank} SIGKILL: the usual sender is the "
        "kernel's out-of-memory killer (see `dmesg`)"
    ]


def ordered(held) -> list[P.Held]:
    """Modules, optimizers, the largest tensors and arrays, then the rest by kind and size
    (within a kind, the largest first)."""

    def key(h: P.Held) -> tuple:
        order = _ORDER.get(h.kind, 6)
        return order, h.kind if order == 6 else "", -h.nbytes, h.name

    return sorted(held, key=key)


def _said(held: list[P.Held]) -> str:
    return _names(h.name for h in held)


def _names(names) -> str:
    names = list(names)
    more = f" and {len(names) - NAMES_SAID} more" if len(names) > NAMES_SAID else ""
    return ", ".join(names[:NAMES_SAID]) + more


def _healed(rank: int, healed: Healed) -> str:
    return healed_words(f"rank {rank}", healed)


def healed_words(ranks: str, healed: Healed) -> str:
    """``rank 2: model, opt healed from rank 0 in 0.31 s; ...`` (``ranks``: who got them)."""
    names = _names(healed.names)
    if healed.error:
        return f"{ranks}: --heal could not copy {names} from rank {healed.src}: {healed.error}"
    wrapped = f"; {_names(healed.rewrapped)} wrapped again in DDP on every rank"
    missing = f" (rank {healed.src} has no {_names(healed.missing)})" if healed.missing else ""
    return (
        f"{ranks}: {names} healed from rank {healed.src} in {healed.seconds:.2f} s"
        + missing
        + (wrapped if healed.rewrapped else "")
    )


def replaced_note(rank: int, dead_held, fresh: frozenset[str], healed: Healed | None) -> list:
    """The lines for a rank whose process was replaced: ``dead_held`` is what the dead
    process reported (``P.Held``), ``fresh`` the names a new process starts with: what it
    had (what matters first), what ``--heal`` copied, what the notebook had sent."""
    lost = ordered(h for h in dead_held if h.name not in fresh)
    copied = set(healed.names) if healed is not None and not healed.error else set()
    imported = [h.name for h in lost if h.kind == "import" and not h.shipped]
    gone = [h for h in lost if h.kind != "import" and not h.shipped and h.name not in copied]
    sent = [h for h in lost if h.shipped and h.name not in copied]
    if gone:
        had = f"it had {_said(gone)} (gone)"
    else:
        had = f"it had nothing {'else ' if copied else ''}of its own (as of its last finished cell)"
    if imported:
        had += f" and had imported {_names(sorted(imported))}"
    lines = [f"rank {rank}: a new process took its place; {had}"]
    if healed is not None:
        lines.append(_healed(rank, healed))
    if sent:
        them = "them" if len(sent) > 1 else "it"
        lines.append(
            f"rank {rank} had {_said(sent)} from the notebook, as it had changed {them} (gone): "
            f"a cell that reads {them} gets the notebook's again, `%ddp copy` a survivor's"
        )
    return lines


# ------------------------------------------------------------ re-runs (nbddp.pool.rerun)


def reran(ranks, labels, names) -> str:
    """``rank 1 re-ran In [3], In [5]: Xr, yr, loss_fn`` (a label said once: a cell run
    again under the same prompt, or by code, is one; many: the first, then how many)."""
    made = f": {_names(names)}" if names else ""
    return f"{rank_set(ranks)} re-ran {_names(dict.fromkeys(labels))}{made}"


def not_reran(ranks, label: str, touched) -> str:
    """A cell that would reset what ``--heal`` copies."""
    them = _names(sorted(touched))
    return (
        f"{rank_set(ranks)} did not re-run {label}: it touches {them}, which --heal names "
        "(never made again on a new rank)"
    )


def rerun_failed(ranks, label: str, how: str) -> str:
    after = "the cells that use what it makes were not re-run"
    return f"{rank_set(ranks)}: re-running {label} failed ({how}); {after}"


def still_lacks(rank: int, names, src: int, made: list[tuple[str, str]]) -> str:
    """What a new rank lacks that a survivor has (``made``: the kept cells that made it,
    and why each was not re-run), and the command that copies it."""
    them = "them" if len(names) > 1 else "it"
    whys: dict[str, list[str]] = {}
    for label, why in made:
        whys.setdefault(why, []).append(label)
    by = [", ".join(labels) + (f" ({why})" if why else "") for why, labels in whys.items()]
    made_by = f"; not re-run: {'; '.join(by)}" if by else ""
    return (
        f"rank {rank} still lacks {_names(names)} (rank {src} has {them}{made_by}): "
        f"`%ddp copy {' '.join(names)} --from {src} --to {rank}`"
    )
