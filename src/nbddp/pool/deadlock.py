"""Collectives that can never complete: found from each rank's place in its groups.

Pure: the pool hands it what the ranks said (:class:`Seen`: a rank's stack and its
count of operations issued on each group, nbddp.rank.seq) and it says whether a
deadlock is *certain*, and in one line which ranks, which collective, which line.
Two rules, both certain by construction, so a slow rank is never taken for one:

- **left behind**: rank F has finished the cell (or does not run it: ``--ranks``)
  after issuing ``n`` operations on group G, and rank R, still running, has issued
  more than ``n`` on G. R's operation ``n + 1`` needs F, which will issue nothing
  more in this cell. (Counts only grow, so an old sample of R is still proof; F's
  count is read once it has finished, so it is final.)
- **disagree**: every member of G is blocked in a torch.distributed call, at the
  same count, and they are not all in the same call (``broadcast`` on rank 0,
  ``all_reduce`` on the others), and nothing moved for ``settle`` seconds; or
  members blocked in the same call at the same count pass tensors of different sizes
  or dtypes (``torch.ones(1 + rank)`` all-reduced: gloo hangs or returns garbage), read
  from the blocked call's arguments by the sample (nbddp.rank.seq.call_shape).

A group that carried a point-to-point operation is never judged (its counts are
not comparable across its members); neither is a group some member did not report.

After a cell, :func:`out_of_step` finds a group whose members ended it at different
counts (an interrupt that landed on one rank just after it issued a collective and
on another just before): the operation issued on some members only is still in
flight on their backend, and would pair with the next cell's first one on the
others (gloo: a size mismatch that aborts the process; NCCL: wrong data or a hang).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..wire.stacks import Frame, rank_set

__all__ = ["Deadlock", "Seen", "calls", "disagreeing", "judge", "out_of_step", "world_count"]

_C10D = ("distributed_c10d.py",)


@dataclass
class Seen:
    """What one rank said about itself, and when."""

    frames: tuple[Frame, ...]
    groups: tuple  # nbddp.rank.seq.Position each
    taken: float
    since: float  # when these frames and counts were first seen unchanged
    on: str | None = None  # the group the torch.distributed call it is in is on
    shape: tuple[int, str] | None = None  # (elements, dtype) of that call's tensor


@dataclass(frozen=True)
class Deadlock:
    """A certain deadlock: ``message`` says it; ``waiting`` are the ranks stuck."""

    message: str
    waiting: tuple[int, ...]


def calls(frames: tuple[Frame, ...]) -> tuple[str | None, int | None]:
    """(the torch.distributed call a rank is blocked in, innermost; its cell line)."""
    call = next((f[2] for f in reversed(frames) if f[0].endswith(_C10D)), None)
    line = next((f[1] for f in reversed(frames) if f[0].startswith("<ddp-")), None)
    return call, line


def disagreeing(seen: dict[int, Seen], running: list[int]) -> bool:
    """Every running rank is in a torch.distributed call, not all the same one: worth a
    second look soon (it is a deadlock once it stays so for ``settle`` s)."""
    if not running or len(seen) < len(running):
        return False
    ops = {calls(seen[r].frames)[0] if r in seen else None for r in running}
    shapes = {seen[r].shape for r in running if r in seen}
    return None not in ops and (len(ops) > 1 or len(shapes) > 1)


def world_count(groups: tuple) -> int:
    """Operations issued on the default group, from a sample's ``(after, positions)``;
    -1 when it did not say."""
    places = groups[1] if len(groups) >= 2 else ()
    return next((seq for _, ranks, seq, _ in places if not ranks), -1)


def _counts(groups: tuple) -> dict[tuple[str, tuple[int, ...]], int]:
    """(group name, members) -> operations issued, for groups without point-to-point."""
    return {(name, ranks): seq for name, ranks, seq, p2p in groups if not p2p}


def out_of_step(ended: dict[int, tuple], world: int) -> str:
    """The first group whose members all ended a cell (``ended``: rank -> its
    nbddp.rank.seq positions then) having issued different numbers of operations on
    it, in one line ("" when none): ``the default group: rank 1 issued 159 operations,
    rank 0 158``."""
    by_group: dict[tuple, dict[int, int]] = {}
    for rank, places in ended.items():
        for key, seq in _counts(places).items():
            by_group.setdefault(key, {})[rank] = seq
    for key, seqs in sorted(by_group.items()):
        members = key[1] or tuple(range(world))
        if set(members) - set(seqs) or len(set(seqs.values())) == 1:
            continue  # a member that did not say (or not in the cell), or in step
        by_count: dict[int, list[int]] = {}
        for rank, seq in seqs.items():
            by_count.setdefault(seq, []).append(rank)
        said = [f"{rank_set(sorted(by_count[n]))} {n}" for n in sorted(by_count, reverse=True)]
        head, rest = said[0].rsplit(" ", 1)
        said[0] = f"{head} issued {rest} operations"
        return f"{_label(key)}: {', '.join(said)}"
    return ""


def _label(key: tuple[str, tuple[int, ...]]) -> str:
    name, ranks = key
    return "the default group" if not ranks else f"group {name} ({rank_set(list(ranks))})"


def _where(seen: Seen, number: int) -> str:
    call, line = calls(seen.frames)
    what = f"{call} #{number}" if call else f"collective #{number}"
    return f"{what} (cell line {line})" if line else what


def judge(
    running: dict[int, Seen],
    finished: dict[int, tuple],
    world: int,
    why: dict[int, str],
    now: float,
    settle: float,
) -> Deadlock | None:
    """A certain deadlock among ``running`` (rank -> Seen) and ``finished`` (rank -> its
    final groups; ``why[rank]``: "finished the cell" or "did not run the cell")."""
    left = _left_behind(running, finished, why)
    return left or _disagree(running, world, now, settle) or _differ(running, now, settle)


def _left_behind(running, finished, why) -> Deadlock | None:
    final = {r: _counts(g) for r, g in finished.items()}
    lowest: dict[tuple, int] = {}  # each group's lowest final count (its members' own)
    for counts in final.values():
        for key, n in counts.items():
            lowest[key] = min(n, lowest.get(key, n))
    for rank in sorted(running):
        for key, seq in _counts(running[rank].groups).items():
            if key in lowest and lowest[key] < seq:
                return _say_left(running, final, key, lowest[key], why)
    return None


def _say_left(running, final, key, n: int, why) -> Deadlock:
    """``deadlock: ranks 0, 2 wait in all_reduce #3 (cell line 4); rank 1 finished the
    cell after 2 collectives``."""
    waiting = sorted(r for r, s in running.items() if _counts(s.groups).get(key, -1) > n)
    left = sorted(f for f, c in final.items() if c.get(key, n + 1) <= n)
    first = running[waiting[0]]
    where = _where(first, n + 1)
    group = "" if not key[1] else f" of {_label(key)}"
    count = f"{n} collective{'s' * (n != 1)}"
    out = [f for f in left if f in why]
    done = [f for f in left if f not in why]
    said = [f"{rank_set(done)} finished the cell after {count}"] if done else []
    if out:
        said.append(f"{rank_set(out)} {why[out[0]]} (--ranks), at {count}")
    told = "; ".join(said)
    return Deadlock(
        f"deadlock: {rank_set(waiting)} wait{'s' * (len(waiting) == 1)} in {where}{group}; {told}",
        tuple(waiting),
    )


def _disagree(running: dict[int, Seen], world: int, now: float, settle: float) -> Deadlock | None:
    by_group: dict[tuple, dict[int, int]] = {}
    for rank, seen in running.items():
        for key, seq in _counts(seen.groups).items():
            by_group.setdefault(key, {})[rank] = seq
    for key, seqs in sorted(by_group.items()):
        members = key[1] or tuple(range(world))
        if set(members) - set(seqs) or len(set(seqs.values())) != 1:
            continue  # a member not running, or at different places: not this rule
        if any(now - running[r].since < settle or running[r].on != key[0] for r in members):
            continue  # (not settled, or a member blocked in a call on another group)
        ops = {r: calls(running[r].frames) for r in members}
        if any(op is None for op, _ in ops.values()) or len({op for op, _ in ops.values()}) < 2:
            continue
        return _say_disagree(ops, key, seqs[members[0]])
    return None


def _say_disagree(ops: dict, key, n: int) -> Deadlock:
    """``deadlock: ranks disagree on collective #1: rank 0 broadcast (line 4), ranks 1-2
    all_reduce (line 6)``."""
    parts: dict[tuple, list[int]] = {}
    for rank, op in sorted(ops.items()):
        parts.setdefault(op, []).append(rank)
    said = ", ".join(
        f"{rank_set(ranks)} {op}" + (f" (line {line})" if line else "")
        for (op, line), ranks in sorted(parts.items(), key=lambda p: p[1])
    )
    group = "" if not key[1] else f" of {_label(key)}"
    return Deadlock(f"deadlock: ranks disagree on collective #{n}{group}: {said}", tuple(ops))


def _differ(running: dict[int, Seen], now: float, settle: float) -> Deadlock | None:
    """Members of a group blocked, settled, in the same call at the same count on it,
    with tensors of different sizes or dtypes: that collective can never be right."""
    blocked: dict[tuple, dict[int, tuple[int, str]]] = {}
    for rank, seen in sorted(running.items()):
        call = calls(seen.frames)[0]
        if seen.shape is None or call is None or now - seen.since < settle:
            continue
        for (name, ranks), seq in _counts(seen.groups).items():
            if name == seen.on:
                blocked.setdefault((name, ranks, seq, call), {})[rank] = seen.shape
    for (name, ranks, seq, call), shapes in sorted(blocked.items()):
        if len(set(shapes.values())) > 1:
            return _say_differ(running, shapes, (name, ranks), seq, call)
    return None


def _say_differ(running, shapes: dict, key, n: int, call: str) -> Deadlock:
    """``deadlock: ranks disagree on all_reduce #1: rank 0 1 float32 element, rank 1 2,
    rank 2 3 (cell line 2)``."""
    parts: dict[tuple[int, str], list[int]] = {}
    for rank, shape in shapes.items():
        parts.setdefault(shape, []).append(rank)
    first = next(iter(shapes.values()))[1]
    said = []
    for (numel, dtype), ranks in sorted(parts.items(), key=lambda p: p[1]):
        what = f"{numel} {dtype} element{'s' * (numel != 1)}" if not said else str(numel)
        said.append(f"{rank_set(ranks)} {what}{f' {dtype}' if said and dtype != first else ''}")
    line = calls(running[min(shapes)].frames)[1]
    where = f" (cell line {line})" if line else ""
    group = "" if not key[1] else f" of {_label(key)}"
    return Deadlock(
        f"deadlock: ranks disagree on {call} #{n}{group}: {', '.join(said)}{where}",
        tuple(sorted(shapes)),
    )
