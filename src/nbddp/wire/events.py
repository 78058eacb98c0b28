"""The events a pool yields for one cell (:meth:`nbddp.Pool.run`), ending with
:class:`CellEnd`: what sinks (the dashboard, ``[rank N]`` lines) and the driver
(:mod:`nbddp.pool.drive`) consume. They never cross a process boundary as such; they
are also importable from :mod:`nbddp.wire.protocol`, as ``P.Output`` and so on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .protocol import ErrorInfo, Profile

__all__ = [
    "CellEnd",
    "Output",
    "RankDebug",
    "RankDisplay",
    "RankExit",
    "RankMetrics",
    "RankProgress",
    "RankResult",
    "RankState",
    "RankStates",
    "RankWhere",
    "Tick",
]


@dataclass(frozen=True)
class Output:
    rank: int
    stream: str  # "stdout" | "stderr"
    text: str


@dataclass(frozen=True)
class RankState:
    rank: int
    state: str  # "queued" | "running" | "done" | "failed" | "freed" | "interrupted" | "dead"
    # ("freed": its collective failed because the group was aborted after another rank failed;
    # "replaced": dead, a new process took its place; "missing": dead with its host, which
    # was lost: the rank waits for a replacement host, nbddp.pool.hosts_lost)


@dataclass(frozen=True)
class RankStates:
    """Several ranks entered one state at once (every rank of a cell starting, a relay's
    ranks ending together): a :class:`RankState` for each, in one event."""

    ranks: tuple[int, ...]
    state: str

    def each(self) -> list[RankState]:
        return [RankState(rank, self.state) for rank in self.ranks]


@dataclass(frozen=True)
class RankWhere:
    """Where a running rank is (a stack sample): ``waiting`` names the collective it waits in."""

    rank: int
    where: str  # nbddp.wire.stacks.summary: "all_reduce, cell line 5: dist.all_reduce(t)"
    waiting: str | None  # "all_reduce", or None when not in a collective
    since: float  # time.monotonic() when this place was first seen
    count: int = -1  # operations it issued on the default group (nbddp.rank.seq); -1: unknown


@dataclass(frozen=True)
class RankResult:
    rank: int
    value_repr: str | None


@dataclass(frozen=True)
class RankDisplay:
    rank: int
    data: dict
    metadata: dict = field(default_factory=dict)


@dataclass(frozen=True)
class RankDebug:
    """A rank's pdb wants a line: show ``output``, ask with ``prompt``, answer with
    :meth:`nbddp.Pool.debug_reply`."""

    rank: int
    output: str
    prompt: str
    seq: int = 0


@dataclass(frozen=True)
class RankProgress:
    rank: int
    done: int
    total: int | None
    desc: str = ""


@dataclass(frozen=True)
class RankMetrics:
    """A rank's ``log_metrics`` points: (run or None for the cell's own, name, steps,
    values), steps and values as ``array`` bytes (:class:`nbddp.wire.protocol.Metrics`)."""

    rank: int
    series: tuple[tuple[str | None, str, bytes, bytes], ...]


@dataclass(frozen=True)
class Tick:
    """Nothing happened for a while; sinks may refresh clocks."""


@dataclass(frozen=True)
class RankExit:
    """A rank's process ended while it was wanted (died, or was stopped by the pool)."""

    rank: int
    returncode: int | None  # negative: killed by that signal; None: unknown (remote)
    stopped_by_pool: bool = False
    when: float = 0.0  # time.time() when the notebook saw it end


@dataclass(frozen=True)
class CellEnd:
    """The last event of every cell: what came back, what failed, what it cost."""

    cell: int
    ranks: tuple[int, ...]
    values: dict[int, object] = field(default_factory=dict)
    errors: dict[int, ErrorInfo] = field(default_factory=dict)
    exits: dict[int, RankExit] = field(default_factory=dict)
    interrupted: str | None = None  # None, "interrupt" or "timeout"
    notes: tuple[str, ...] = ()
    stacks: dict[int, tuple] = field(default_factory=dict)  # where ranks were when interrupted
    freed: tuple[int, ...] = ()  # ranks whose group was aborted under them (consequences)
    profiles: dict[int, Profile] = field(default_factory=dict)  # with Run.profile
    kept: bool = True  # the ranks that lived kept their namespaces (the pool was not stopped)
    deadlock: str = ""  # a certain deadlock ended the cell: what it was (nbddp.pool.deadlock)
