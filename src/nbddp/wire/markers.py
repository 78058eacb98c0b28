"""The end markers a worker writes into its stdout and stderr after each cell.

A rank's streams are bytes, not messages: ``end_marker(cell)`` in both tells the
notebook it has every byte the cell printed (see :mod:`nbddp.wire.protocol`'s
timeline), and :func:`split_markers` takes them out of the decoded text again,
holding back a tail that may be the start of a marker still on its way.
"""

from __future__ import annotations

import re

__all__ = ["end_marker", "split_markers"]

_MARKER_PREFIX = "\x00nbddp-end-"
_MARKER_RE = re.compile("\x00nbddp-end-(\\d+)\x00")


def _may_become_marker(tail: str) -> bool:
    if _MARKER_PREFIX.startswith(tail):
        return True
    digits = tail[len(_MARKER_PREFIX) :]
    return tail.startswith(_MARKER_PREFIX) and digits.isdigit() and len(digits) < 20


def end_marker(cell: int) -> bytes:
    """Bytes a worker writes into stdout and stderr when cell ``cell`` has ended."""
    return f"\x00nbddp-end-{cell}\x00".encode()


def split_markers(text: str) -> tuple[list[str | int], str]:
    """Split decoded stream text into pieces of text and cell numbers of end markers.

    Returns the pieces and a tail held back because it may be the start of a
    marker whose rest has not arrived yet.
    """
    pieces: list[str | int] = []
    pos = 0
    for m in _MARKER_RE.finditer(text):
        if m.start() > pos:
            pieces.append(text[pos : m.start()])
        pieces.append(int(m.group(1)))
        pos = m.end()
    rest = text[pos:]
    cut = rest.rfind("\x00")
    tail = rest[cut:] if cut != -1 else ""
    if tail and _may_become_marker(tail):
        rest = rest[:cut]
    else:
        tail = ""
    if rest:
        pieces.append(rest)
    return pieces, tail
