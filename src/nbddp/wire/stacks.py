"""Where a rank is: its main thread's Python stack, as data, summarized and grouped.

A worker's receiver thread takes the stack of the main thread with
``sys._current_frames()``, so it works while the main thread is blocked in C
(a collective, a sleep). Frames travel as plain tuples; this module knows
nobody and is used by the worker (to take them), the pool (to see a rank
waiting in a collective) and the errors and sinks (to show them).
"""

from __future__ import annotations

import sys
import traceback
from types import FrameType

__all__ = [
    "CELL_PREFIX",
    "Frame",
    "collective",
    "format_groups",
    "frames_of",
    "group",
    "in_torch",
    "is_are",
    "main_thread_frames",
    "rank_set",
    "summary",
]

CELL_PREFIX = "<ddp-"  # the filenames cells (and --imports) run under: <ddp-cell-3>

# (filename, line number, function, source line)
Frame = tuple[str, int, str, str]

_DIST = ("torch/distributed/", "torch\\distributed\\")
_TORCH = ("/torch/", "\\torch\\")
_WRAPPERS = {"wrapper", "_fn", "inner", "decorate_context"}


def frames_of(frame: FrameType | None) -> tuple[Frame, ...]:
    """The stack ending at ``frame``, outermost first, from the first cell frame on."""
    summary_ = traceback.extract_stack(frame)
    frames = tuple((f.filename, f.lineno or 0, f.name, (f.line or "").strip()) for f in summary_)
    for i, f in enumerate(frames):
        if f[0].startswith(CELL_PREFIX):
            return frames[i:]
    return frames


def main_thread_frames(main_ident: int) -> tuple[Frame, ...]:
    """The main thread's stack, taken from any other thread."""
    frame = sys._current_frames().get(main_ident)
    if frame is None:
        return ()
    return frames_of(frame)


def _cell_line(frames: tuple[Frame, ...]) -> Frame | None:
    """The innermost frame of the cell itself (its own line numbers)."""
    return next((f for f in reversed(frames) if f[0].startswith(CELL_PREFIX)), None)


def collective(frames: tuple[Frame, ...]) -> str | None:
    """The torch.distributed call a rank waits in (``all_reduce``), else None.

    The outermost torch.distributed frame below the user's code names the
    call; decorator wrappers (c10d_logger's ``wrapper``) are skipped. A module's
    top level there (``<module>``) is an import under way, not a collective.
    """
    for f in frames:
        if any(part in f[0] for part in _DIST) and f[2] not in _WRAPPERS:
            return None if f[2] == "<module>" else f[2]
    return None


def in_torch(frames: tuple[Frame, ...]) -> bool:
    """The innermost frame is torch's own code, called from the cell: a DDP forward or
    backward, say, whose collectives run in C++ with no torch.distributed frame."""
    return (
        bool(frames)
        and not frames[-1][0].startswith(CELL_PREFIX)
        and any(part in frames[-1][0] for part in _TORCH)
    )


def summary(frames: tuple[Frame, ...]) -> str:
    """One line: ``all_reduce, cell line 5: dist.all_reduce(t)`` or ``idle``."""
    if not frames:
        return "idle"
    cell = _cell_line(frames)
    inner = frames[-1]
    call = collective(frames) or (inner[2] if inner is not cell else None)
    where = f"cell line {cell[1]}: {cell[3]}" if cell else f"{inner[0]}:{inner[1]} in {inner[2]}"
    return f"{call}, {where}" if call and call != "<module>" else where


def rank_set(ranks: list[int] | tuple[int, ...]) -> str:
    """``rank 3`` / ``ranks 0, 1, 3`` / ``ranks 0-7, 9``."""
    ranks = sorted(ranks)
    parts: list[str] = []
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    for run in runs:  # three or more in a row read as a range
        parts += [f"{run[0]}-{run[-1]}"] if len(run) >= 3 else [str(r) for r in run]
    return f"rank{'s' * (len(ranks) != 1)} {', '.join(parts)}"


def is_are(ranks) -> str:
    """The verb after :func:`rank_set` of ``ranks``: ``rank 3 is``, ``ranks 0, 1 are``."""
    return "are" if len(ranks) > 1 else "is"


def group(stacks: dict[int, tuple[Frame, ...]]) -> list[tuple[list[int], tuple[Frame, ...]]]:
    """Ranks with identical stacks together, the largest group first."""
    groups: dict[tuple[Frame, ...], list[int]] = {}
    for rank in sorted(stacks):
        key = tuple(f[:3] for f in stacks[rank])
        groups.setdefault(key, []).append(rank)
    out = [(ranks, stacks[ranks[0]]) for ranks in groups.values()]
    return sorted(out, key=lambda g: (-len(g[0]), g[0]))


def format_groups(stacks: dict[int, tuple[Frame, ...]], *, full: bool = True) -> list[str]:
    """``ranks 0-2: all_reduce, cell line 5: ...`` per group, each with its stack if ``full``."""
    lines: list[str] = []
    for ranks, frames in group(stacks):
        lines.append(f"{rank_set(ranks)}: {summary(frames)}")
        if full:
            for filename, lineno, name, line in frames:
                shown = filename if not filename.startswith(CELL_PREFIX) else "cell"
                lines.append(f"    {shown}, line {lineno}, in {name}")
                if line:
                    lines.append(f"      {line}")
    return lines
