"""The errors nbddp raises in the notebook.

::

    NbddpError
     +-- PoolStartError      the ranks could not be started (names the rank and why)
     +-- PoolClosedError     the pool was stopped and cannot run cells
     |    +-- HostsMissing   an attached pool's lost host's ranks have not come back
     |                       yet (nbddp.pool.hosts_lost): nothing ran, nothing was lost
     +-- CaptureError        a --need / --imports / push name cannot be shipped
                             (raised before any rank runs)
     +-- CellFailed          a cell failed on one or more ranks; .failures lists the root
          |                  causes first (a death, then by when they happened), .groups
          |                  the same causes with one error on several ranks together,
          |                  .consequences the ranks freed from a collective because of
          |                  them (after a death: its peers' transport errors too)
          +-- CellInterrupted    the cell was interrupted (stop button, Ctrl-C, --timeout);
                                 .stacks says where each rank was

    RankFailed and RankDied are the per-rank failures that CellFailed carries.

Rank errors travel as data (type name, message, formatted traceback), never as
pickled exception objects, and render in IPython through ``_render_traceback_``.
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass

from ..wire import stacks as S
from ..wire.protocol import ErrorInfo

__all__ = [
    "CaptureError",
    "CellDeadlocked",
    "CellFailed",
    "CellInterrupted",
    "HostsMissing",
    "NbddpError",
    "PoolClosedError",
    "PoolStartError",
    "RankDied",
    "RankFailed",
    "describe_exit",
    "rank_label",
]


class NbddpError(Exception):
    """Base class of every error nbddp raises."""


class PoolStartError(NbddpError):
    """The pool's ranks could not be started."""


class PoolClosedError(NbddpError):
    """The pool was stopped."""


class HostsMissing(PoolClosedError):
    """Ranks of a lost host have not come back yet: nothing ran, nothing was lost (here,
    with the others, so that a detached pool's client raises it too)."""


class CaptureError(NbddpError):
    """A name could not be shipped to the ranks; nothing ran."""


def describe_exit(returncode: int | None) -> str:
    """``exit code 7`` / ``killed by SIGKILL`` / ``connection lost``."""
    if returncode is None:
        return "connection lost"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


def rank_label(rank: int, host: str = "") -> str:
    """``rank 3``, or ``rank 3 (node-b)`` when the pool spans several hosts."""
    return f"rank {rank} ({host})" if host else f"rank {rank}"


@dataclass(frozen=True)
class RankFailed:
    """One rank's exception, as data."""

    rank: int
    exc_type: str
    message: str
    traceback: str
    host: str = ""  # set when the pool spans several hosts
    when: float = 0.0  # time.time() in the rank
    collective: str = ""  # the torch.distributed call it came out of, if any

    @classmethod
    def from_info(cls, rank: int, info: ErrorInfo, host: str = "") -> RankFailed:
        return cls(
            rank, info.exc_type, info.message, info.traceback, host, info.when, info.collective
        )

    @property
    def summary(self) -> str:
        return f"{rank_label(self.rank, self.host)}: {self.exc_type}: {self.message}".rstrip(": ")

    def render(self) -> list[str]:
        head = f"--- {rank_label(self.rank, self.host)} ---"
        return [head, *self.traceback.rstrip("\n").splitlines()]


@dataclass(frozen=True)
class RankDied:
    """A rank's process ended during the cell."""

    rank: int
    returncode: int | None
    host: str = ""
    when: float = 0.0  # time.time() when the notebook saw it

    @property
    def summary(self) -> str:
        return f"{rank_label(self.rank, self.host)} died ({describe_exit(self.returncode)})"

    def render(self) -> list[str]:
        return [f"--- {rank_label(self.rank, self.host)} ---", self.summary]


# what a rank's error says when a peer's process went away under a collective: gloo's
# pair.cc ("Read error ... Connection reset by peer", "Connection closed by peer",
# "Socket Timeout"), NCCL's remote errors, torch's DistNetworkError / DistBackendError
_TRANSPORT = re.compile(
    r"connection (reset|closed) by peer|socket timeout|gloo/transport"
    r"|remote process exited|ncclRemoteError"
    r"|NCCL communicator was aborted|DistNetworkError|DistBackendError",
    re.I,
)


def transport_error(failure: RankFailed | RankDied) -> bool:
    """A rank's error its transport raised: what a survivor sees when a peer dies."""
    if not isinstance(failure, RankFailed):
        return False
    said = f"{failure.exc_type}: {failure.message}"
    return bool(_TRANSPORT.search(said))


def root_causes(
    failures: list[RankFailed | RankDied], freed: tuple[int, ...] | list[int] = ()
) -> tuple[list[RankFailed | RankDied], list[RankFailed]]:
    """Split failures into root causes (a death first, then first happened first) and
    their consequences.

    A consequence is a rank's error that came out of a collective, or out of a
    group nbddp aborted under it (``freed``), while another rank failed for a
    reason of its own; and, when a rank died, a transport error (a peer's socket
    gone: :func:`transport_error`), wherever it was raised (a DDP backward's
    all_reduce runs in C++, with no collective on the Python stack). When every
    failure is of that kind (a timeout, a mismatched collective), they are all
    root causes. A death comes before every other root cause: the notebook sees a
    process end only after its peers' sockets broke, so a survivor's error is
    often stamped earlier than the death that caused it.
    """
    died = any(isinstance(f, RankDied) for f in failures)

    def consequence(f: RankFailed | RankDied) -> bool:
        return isinstance(f, RankFailed) and (
            f.rank in freed or bool(f.collective) or (died and transport_error(f))
        )

    roots = [f for f in failures if not consequence(f)]
    if not roots:
        roots, rest = list(failures), []
    else:
        rest = [f for f in failures if consequence(f)]
    # stable: no time, given order
    roots.sort(key=lambda f: (not isinstance(f, RankDied), f.when or float("inf")))
    return roots, sorted(rest, key=lambda f: f.rank)


_FRAME = re.compile(r'^\s*File "([^"]*)", line (\d+)', re.M)


def _same(failure: RankFailed | RankDied) -> tuple:
    """What two ranks' failures share when they are one error: the exception and the
    lines it came through (a death: how the process ended)."""
    if isinstance(failure, RankDied):
        return ("died", failure.returncode)
    frames = tuple(_FRAME.findall(failure.traceback))
    return (failure.exc_type, frames) if frames else (failure.exc_type, failure.message)


def fold_failures(failures: list) -> list[list]:
    """The same error on several ranks once: failures grouped by :func:`_same`, in the
    order of each group's first (the root cause stays first)."""
    groups: dict[tuple, list] = {}
    for failure in failures:
        groups.setdefault(_same(failure), []).append(failure)
    return list(groups.values())


def _group_summary(group: list) -> str:
    """``ranks 0-3: NameError: name 'x' is not defined`` (one rank: its own summary)."""
    first = group[0]
    if len(group) == 1:
        return first.summary
    ranks = S.rank_set([f.rank for f in group])
    if isinstance(first, RankDied):
        return f"{ranks} died ({describe_exit(first.returncode)})"
    said = f"{ranks}: {first.exc_type}: {first.message}".rstrip(": ")
    if any(f.message != first.message for f in group):
        said += f" (rank {first.rank}'s message; the others' differ)"
    return said


class CellFailed(NbddpError):
    """A cell failed on one or more ranks: one error, the root cause named first.

    ``failures`` are the root causes in the order they happened; ranks freed
    from a collective because of them are ``consequences``, folded into one line.
    """

    def __init__(
        self,
        failures: list[RankFailed | RankDied],
        notes: list[str] | None = None,
        freed: tuple[int, ...] | list[int] = (),
        kept: bool = False,
    ):
        self.failures, self.consequences = root_causes(list(failures), freed)
        self.groups = fold_failures(self.failures)  # one error on several ranks: once
        self.notes = list(notes or [])
        self.kept = kept  # the ranks freed kept their namespaces
        super().__init__(self._message())

    def _folded(self) -> list[str]:
        """``ranks 1, 3: freed from a collective (all_reduce) after rank 2 failed; state kept``."""
        if not self.consequences:
            return []
        calls = sorted({f.collective for f in self.consequences if f.collective})
        cause = self.failures[0]
        return [
            f"{S.rank_set([f.rank for f in self.consequences])}: freed from a collective"
            + (f" ({', '.join(calls)})" if calls else "")
            + f" after {rank_label(cause.rank, cause.host)} "
            + ("died" if isinstance(cause, RankDied) else "failed")
            + ("; state kept" if self.kept else "")
        ]

    def _message(self) -> str:
        lines = [_group_summary(g) for g in self.groups] or ["the cell failed"]
        return "\n".join(lines + self._folded() + self.notes)

    def _render_traceback_(self) -> list[str]:
        """What IPython shows instead of a Python traceback: each root cause's own, an
        error several ranks share once, headed by its rank set."""
        out: list[str] = []
        for group in self.groups:
            shown = group[0].render()
            if len(group) > 1:
                shown[0] = f"--- {S.rank_set([f.rank for f in group])} ---"
            out += shown
        said = [_group_summary(g) for g in self.groups]
        out += ["", f"{type(self).__name__}: {said[0] if said else ''}"]
        out += said[1:]
        out += self._folded()
        out += self.notes
        return out


class CellDeadlocked(CellFailed):
    """Collectives that could never complete ended the cell (nbddp.pool.deadlock): the group
    was aborted under the waiting ranks and re-formed. What it was comes first; the
    ranks it freed follow in one line, and a rank's own error, if any, after them."""

    def __init__(self, deadlock: str, failures=None, notes=None, freed=(), kept=False):
        self.deadlock = deadlock
        self.freed = tuple(freed)
        super().__init__(failures or [], notes, freed, kept)
        every = self.failures + self.consequences  # the freed are consequences, all of them
        self.failures = [f for f in every if not self._freed(f)]
        self.consequences = [f for f in every if self._freed(f)]

    def _lines(self) -> list[str]:
        freed = sorted({f.rank for f in self.consequences})
        own = [f.summary for f in self.failures]
        kept = "; state kept" if self.kept else ""
        said = [f"{S.rank_set(freed)}: freed by the abort{kept}"] if freed else []
        return [self.deadlock, *said, *own, *self.notes]

    def _freed(self, failure) -> bool:
        """Its error came out of the aborted group (a collective), not out of its code."""
        return failure.rank in self.freed or bool(getattr(failure, "collective", ""))

    def _message(self) -> str:
        return "\n".join(self._lines())

    def _render_traceback_(self) -> list[str]:
        first, *rest = self._lines()
        return [f"{type(self).__name__}: {first}", *rest]


class CellInterrupted(CellFailed):
    """The cell was interrupted on the ranks (stop button, Ctrl-C or --timeout).

    ``stacks`` maps each rank that was running to where it was (nbddp.wire.stacks frames).
    """

    def __init__(self, reason: str, failures=None, notes=None, stacks=None):
        self.reason = reason
        self.stacks = dict(stacks or {})
        super().__init__(failures or [], notes)

    def _where(self, full: bool) -> list[str]:
        if not self.stacks:
            return []
        return ["where the ranks were:", *S.format_groups(self.stacks, full=full)]

    @property
    def head(self) -> str:
        """Names KeyboardInterrupt, which is what people (and tools) look for."""
        if self.reason == "timeout":
            return "cell timed out (the ranks got a KeyboardInterrupt)"
        return "cell interrupted (KeyboardInterrupt)"

    def _message(self) -> str:
        return "\n".join([self.head, *self._where(full=False), *self.notes])

    def _render_traceback_(self) -> list[str]:
        return [f"{type(self).__name__}: {self.head}", *self._where(full=True), *self.notes]
