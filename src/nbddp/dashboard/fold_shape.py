"""What folds with what, and how a folded line reads.

A line's *shape* is its text with every number taken out: ``rank 3 epoch 2 loss
0.3633`` and ``rank 5 epoch 2 loss 0.4121`` have one shape, so 64 ranks' loss lines
fold into one line, ``rank {0-63} epoch 2 loss {0.3333..0.9633}``: a number every rank
printed alike shows as printed, integers that differ as the set they make, other
numbers as their range. Each rank's values stay in the group (:func:`detail`: the
extremes named, then every rank's values).

A tqdm bar's shape is its description alone: bars of ranks at different speeds fold
into one, drawn as the slowest rank's bar with the spread of the others (:func:`bar`).
"""

from __future__ import annotations

import re

__all__ = [
    "bar", "bar_count", "bar_detail", "bar_percent", "detail", "is_progress", "rank_set",
    "render", "shape",
]  # fmt: skip

# tqdm's default layout, "desc: 100%|█████| 10/10 [00:01<00:00,  9.81it/s]", and with no
# total, "45it [00:01, 30.12it/s]", are read by hand (:func:`_bar`, :func:`_open_count`),
# in time linear in the line: the regular expressions they replace took 5.2 s for a 16 KB
# line of digits, once per output event. A line longer than BAR_MAX is no bar.
BAR_MAX = 1000
_DIGITS = frozenset("0123456789")
_COUNT = re.compile(r"\s*(\d{1,24}(?:\.\d{1,24})?[kMG]?)/(\S{1,64})(?:\s|$)")
# a number: at most 24 digits a part (a longer run of digits is several numbers: int() and
# float() of each stay cheap and within Python's limits)
_NUMBER = re.compile(r"(-?\d{1,24}(?:\.\d{1,24})?(?:[eE][-+]?\d{1,3})?)")
SET_MAX = 24  # characters of an integer set shown in a line; more: its range
DETAIL_RANKS = 64  # ranks whose values the detail lists, at most


def _digits_before(text: str, end: int) -> int:
    """Where the run of digits that ends at ``end`` starts (``end``: none)."""
    while end and text[end - 1] in _DIGITS:
        end -= 1
    return end


def _bar(line: str) -> tuple[str, str, str] | None:
    """A tqdm bar's (description, count, total), or None: the line is no bar."""
    pct = line.find("%|") if len(line) <= BAR_MAX else -1
    if pct < 1:
        return None
    start = _digits_before(line, pct)
    close = line.rfind("|")
    m = _COUNT.match(line, close + 1) if start < pct and close > pct + 1 else None
    return (line[:start].rstrip(), m.group(1), m.group(2)) if m else None


def _open_count(line: str) -> str | None:
    """A tqdm bar with no total's count, ``45it``, or None: the line is no such bar."""
    text = line.rstrip() if len(line) <= BAR_MAX else ""
    at = text.rfind("it [") if text.endswith("]") else -1
    inside = text[at + 4 : -1]
    if at < 1 or "]" in inside or ("it/s" not in inside and "s/it" not in inside):
        return None
    end = at - (text[at - 1] in "kMG")
    start = _digits_before(text, end)
    if start >= 2 and text[start - 1] == "." and text[start - 2] in _DIGITS:
        start = _digits_before(text, start - 1)
    return text[start : at + 2] if start < end and text[start] in _DIGITS else None


def is_progress(line: str) -> bool:
    """A tqdm bar: tqdm writes to stderr, and a bar is progress, not an error."""
    return _bar(line) is not None or _open_count(line) is not None


def shape(line: str) -> tuple[str, tuple[str, ...] | None]:
    """``(key, values)``: what two ranks' lines must share to fold, and this line's
    numbers (None for a bar, whose line is its value)."""
    parsed = _bar(line) if "%|" in line else None
    if parsed:
        return "\x01bar " + parsed[0], None
    parts = _NUMBER.split(line)
    if len(parts) == 1:
        return line, ()
    return "\x00".join(parts[0::2]), tuple(parts[1::2])


def rank_set(ranks) -> str:
    """``[0, 1, 2, 3, 5]`` -> ``0-3,5``."""
    out, ranks = [], sorted(ranks)
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        out.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ",".join(out)


def _slot(column: list[str], ranks: list[int]) -> str:
    """One number as the folded line shows it: as printed, a set of integers, or a range
    with the rank of its outlying end named (the end further from the median)."""
    first = column[0]
    if all(v == first for v in column):
        return first
    if all(_integer(v) for v in column):
        shown = rank_set({int(v) for v in column})
        if len(shown) <= SET_MAX:
            return "{" + shown + "}"
    order = sorted(range(len(column)), key=lambda j: float(column[j]))
    low, high = order[0], order[-1]
    half = len(order) // 2  # the median (of two ranks: their mean, and the max is named)
    middle = (float(column[order[half]]) + float(column[order[(len(order) - 1) // 2]])) / 2
    above, below = float(column[high]) - middle, middle - float(column[low])
    far = high if above >= below * (1 - 1e-9) else low  # (as far: the max)
    named = f"{'max' if far == high else 'min'} rank {ranks[far]}" if ranks else ""
    return "{" + column[low] + ".." + column[high] + (", " + named if named else "") + "}"


def _integer(text: str) -> bool:
    return text.lstrip("-").isdigit()


def render(key: str, values: list[tuple[str, ...]], ranks: list[int] | None = None) -> str:
    """The folded line: the shape with each number as :func:`_slot` shows it (``ranks``:
    whose values they are, to name the outlier of a range)."""
    pieces = key.split("\x00")
    out = [pieces[0]]
    for i, piece in enumerate(pieces[1:]):
        out.append(_slot([v[i] for v in values], ranks or []))
        out.append(piece)
    return "".join(out)


def bar(lines: list[str], ranks: list[int]) -> str:
    """Bars of several ranks as one: the slowest rank's, then where the others are."""
    parsed = [_bar(line) for line in lines]
    counts = [_count(b[1]) if b else 0.0 for b in parsed]
    slow = min(range(len(lines)), key=lambda i: (counts[i], ranks[i]))
    fast = max(counts)
    if counts[slow] == fast:
        return lines[slow]
    first = parsed[max(range(len(lines)), key=counts.__getitem__)]
    ahead = first[1] if first else f"{fast:g}"
    return f"{lines[slow]}  (slowest: rank {ranks[slow]}; the others up to {ahead})"


def bar_count(line: str) -> str | None:
    """A tqdm bar's position, ``45/100`` (``45it`` with no total); None for other lines:
    what a rank's row shows of its bar (the bar itself is drawn once, folded)."""
    parsed = _bar(line) if "%|" in line else None
    return f"{parsed[1]}/{parsed[2]}" if parsed else _open_count(line)


def bar_percent(line: str) -> int | None:
    """A tqdm bar's whole percent done (None: not a bar, or no total)."""
    parsed = _bar(line) if "%|" in line else None
    if not parsed:
        return None
    _desc, n, total = parsed
    whole = _count(total) if _NUMBER.fullmatch(total.rstrip("kMG")) else 0
    return min(100, int(100 * _count(n) / whole)) if whole else None


def bar_detail(lines: list[str], ranks: list[int]) -> str:
    """Each rank's position in a folded bar, in rank order: shown when it is pointed at."""
    each = sorted(zip(ranks, lines, strict=True))[:DETAIL_RANKS]
    out = [f"rank {rank}: {bar_count(line) or line}" for rank, line in each]
    if len(ranks) > DETAIL_RANKS:
        out.append(f"… {len(ranks) - DETAIL_RANKS} more ranks")
    return "\n".join(out)


def _count(text: str) -> float:
    scale = {"k": 1e3, "M": 1e6, "G": 1e9}.get(text[-1:], 1.0)
    return float(text.rstrip("kMG") or 0) * scale


def detail(key: str, values: list[tuple[str, ...]], ranks: list[int]) -> str:
    """Each rank's values of a folded line, the ranks with the extreme values first:
    what the dashboard shows when the line is pointed at (empty when nothing differs)."""
    if not values or not values[0]:
        return ""
    names = [piece.split()[-1] if piece.split() else "#" for piece in key.split("\x00")[:-1]]
    notes = []
    for i, name in enumerate(names):
        column = [v[i] for v in values]
        if len(set(column)) < 2 or [int(v) for v in column if _integer(v)] == ranks:
            continue
        low = min(range(len(column)), key=lambda j: float(column[j]))
        high = max(range(len(column)), key=lambda j: float(column[j]))
        notes.append(
            f"{name} lowest {column[low]} on rank {ranks[low]}, "
            f"highest {column[high]} on rank {ranks[high]}"
        )
    if not notes:
        return ""
    order = sorted(range(len(ranks)), key=ranks.__getitem__)
    each = [f"rank {ranks[j]}: {' '.join(values[j])}" for j in order[:DETAIL_RANKS]]
    if len(order) > DETAIL_RANKS:
        each.append(f"… {len(order) - DETAIL_RANKS} more ranks")
    return "\n".join(notes + each)
