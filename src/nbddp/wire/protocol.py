"""The messages between the notebook and its workers, and the events a pool yields.

Every message is a frozen dataclass. This module is the only place that turns
them into bytes and back (:func:`dumps`, :func:`loads`: an :class:`nbddp.wire.codec.Codec`
made for these messages). Authentication and framing belong to
:mod:`nbddp.wire.handshake` (a SHA-256 challenge in both directions) and
:mod:`nbddp.wire.frames` (frames with a MAC and a sequence number on TCP), so nothing
here is ever decoded from a peer
that has not proven it holds the pool's key, nor from a frame that failed its
check. Decoding is restricted too (:func:`loads`): only this module's message
classes and plain data (numbers, strings, bytes, tuples, lists, dicts, sets)
come out of a control message; a pickle naming any other class or function is
refused. The user's own objects travel inside as bytes (``Run.needs``,
``Done.value``) and are decoded only where the user asked for them.

A worker holds three connections to the notebook: ``control`` carries these
messages; ``stdout`` and ``stderr`` carry the raw bytes of file descriptors 1
and 2 (Python and C++ output alike). At the end of each cell the worker writes
``end_marker(cell)`` into both streams before it sends :class:`Done`, so the
notebook knows it has every byte the cell printed, on any transport. Ranks
attached with several on a host talk through that host's relay instead
(nbddp.hosts.relay: the same messages, framed per host; no end markers).

Timeline of a pool::

    worker                               notebook
    Hello ------------------------------>  (one per rank; StreamHello x2 on the streams)
    (a local pool's ranks form the group on the store the pool started, NBDDP_STORE_PORT;
     ranks under torchrun on torchrun's; a script's own init_process_group after
     destroy_process_group, on one rank 0 opens:)
    StorePort (rank 0) ----------------->
                  <--------------------- JoinGroup(port)   (ranks != 0)
    Ready(generation) ------------------>
                  <--------------------- Run(cell, code, ...)
    bytes on stdout/stderr ------------->
    Metrics (log_metrics, <= 4 a second) >
    end markers, then Done ------------->
                  <--------------------- Interrupt | Query | StackQuery | Shutdown (any time)
    StatusReply | Stacks --------------->  (from the worker's receiver thread)
                  <--------------------- AbortGroup(cell), Reform(generation)   (after a
                                                    failure left peers blocked in a collective,
                                                    or a rank died and a new one took its place)
    Ready(generation) | ReformFailed --->  (a peer died while the group formed: freed, and
                                            the pool tries the next generation)
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from . import events, slurm
from .codec import Codec
from .events import *  # noqa: F403 (the events a pool yields, as P.Output, ...)
from .markers import end_marker, split_markers  # (the streams' end markers, as P.end_marker)
from .slurm import Slurm, slurm_of  # (a part of Hello, as P.Slurm)

__all__ = [
    "PROTOCOL_VERSION", "AbortGroup", "DebugInput", "DebugPrompt", "Display", "Done",
    "ErrorInfo", "Fatal", "Held", "Hello", "Interrupt", "JoinGroup", "Metrics", "Profile",
    "Progress", "Query", "Ready", "ReformFailed", "Reform", "RelayHello", "Run", "Script",
    "Shutdown", "StackQuery", "Stale", "Stacks", "StatusReply", "StorePort", "StreamHello",
    "dumps", "end_marker", "kernel_of", "loads", "slurm_of", "split_markers", *events.__all__,
]  # fmt: skip

PROTOCOL_VERSION = 12  # 10: Done.issued, Ready.rebound/stale; 11: versions by kernel; 12: weights

# A shipped object's version (Run.versions): the notebook's own random tag (high bits),
# then its count, so versions from two kernels (a detached pool outlives one) never meet
VERSION_COUNT_BITS = 24


def kernel_of(version: int) -> int:
    """The tag of the notebook that gave ``version``."""
    return version >> VERSION_COUNT_BITS


# ---------------------------------------------------------------- data


@dataclass(frozen=True)
class ErrorInfo:
    """An exception as data: it crosses processes without pickling the exception."""

    exc_type: str
    message: str
    traceback: str  # formatted, cell frames only, ends with "Type: message"
    when: float = 0.0  # time.time() in the rank when it was raised: the root cause is first
    collective: str = ""  # the torch.distributed call it came out of ("all_reduce"), if any


@dataclass(frozen=True)
class Profile:
    """A rank's profile of one cell (``%%ddp --profile``, nbddp.rank.profiling)."""

    kind: str  # "torch" | "python"
    wall: float  # seconds the cell took on the rank
    collectives: float  # seconds inside torch.distributed collectives, waiting included
    top: tuple[tuple[str, int, float], ...]  # (operation, calls, seconds), most first


@dataclass(frozen=True)
class Held:
    """A rank's global name as its death note lists it (sized without pickling: rank.held)."""

    name: str
    kind: str  # "module" | "optimizer" | "tensor" | "array" | "object" | ... | "import"
    nbytes: int  # a tensor's, array's, module's or optimizer's bytes; else its own size
    shipped: bool = False  # still bound to what the notebook sent (--need, automatic capture)


@dataclass(frozen=True)
class Stale:
    """A global name of a rank still bound to the group a re-form replaced (nbddp could not
    bind it again): ``kind`` ("ddp", "sharded", "group") and what it is, in words."""

    name: str
    kind: str
    what: str


# ---------------------------------------------------------------- worker -> notebook


@dataclass(frozen=True)
class Hello:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    pid: int
    host: str
    needs_port: bool  # True: rank 0 opens the store on a free port and reports it
    version: int = PROTOCOL_VERSION
    held: bool = False  # its holder forks a new process when it dies (nbddp.hosts.holder)
    slurm: Slurm | None = None  # its SLURM job, node rank and master (slurm_of), shown to the user


@dataclass(frozen=True)
class StreamHello:
    rank: int
    pid: int
    stream: str  # "stdout" | "stderr"


@dataclass(frozen=True)
class RelayHello:
    """A host's relay (nbddp.hosts.relay): the ranks on ``host`` speak to the notebook through
    it."""

    host: str
    pid: int
    version: int = PROTOCOL_VERSION


@dataclass(frozen=True)
class StorePort:
    port: int


@dataclass(frozen=True)
class Ready:
    backend: str
    device: str
    names: tuple[str, ...] = ()  # the rank's global names
    generation: int = 0  # the re-form of the group it joined (0: the first group)
    modules: tuple[str, ...] = ()  # which of ``names`` are modules
    held: tuple[Held, ...] = ()  # every global name, the notebook's included
    rebound: tuple[str, ...] = ()  # a re-form: the DDP models made again on the new group
    stale: tuple[Stale, ...] = ()  # a re-form: what is still bound to the old group
    weights: tuple[tuple[str, str, str], ...] = ()  # a re-form: (model, digest, optimizers)


@dataclass(frozen=True)
class ReformFailed:
    """The rank could not join re-form ``generation`` (a peer died while it formed, and
    the pool freed the rank from the wait); it lives on, without a group."""

    generation: int
    error: ErrorInfo


@dataclass(frozen=True)
class Fatal:
    """The worker could not start (process group, imports); it exits after this."""

    error: ErrorInfo


@dataclass(frozen=True)
class Done:
    cell: int
    status: str  # "ok" | "error" | "interrupted"
    value: bytes | None = None  # the last expression (nbddp.wire.payload), when asked for
    value_repr: str | None = None
    error: ErrorInfo | None = None
    files: tuple[str, ...] = ()  # shared-memory files ``value`` refers to (the notebook removes)
    names: tuple[str, ...] | None = None  # the rank's global names, when they changed
    modules: tuple[str, ...] | None = None  # which of them are modules
    held: tuple[Held, ...] | None = None  # every global name, when any changed (Held)
    freed: bool = False  # the group was aborted under this rank during the cell
    needs_group: bool = False  # the cell destroyed the default group: re-form it
    profile: Profile | None = None  # with Run.profile
    places: tuple = ()  # operations issued on each group by the cell's end (worker_seq)
    issued: bool = False  # the cell's count moved on some group, or a group came or went


@dataclass(frozen=True)
class Display:
    """Rich output from a rank: ``display(obj)``, a matplotlib figure, a rich last value."""

    data: dict  # mime type -> content, as IPython's display formatter gives it
    metadata: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Progress:
    """``nbddp.progress`` on a rank: ``done`` of ``total`` (None when unknown)."""

    done: int
    total: int | None
    desc: str = ""


@dataclass(frozen=True)
class Metrics:
    """``nbddp.log_metrics`` points since the last send: (run, name, steps, values) each,
    the steps and values as the bytes of ``array("q")`` and ``array("d")``."""

    series: tuple[tuple[str | None, str, bytes, bytes], ...]


@dataclass(frozen=True)
class DebugPrompt:
    """pdb on this rank wants a line: ``output`` is what it wrote since the last one."""

    output: str
    prompt: str  # "(Pdb rank 1) "
    seq: int = 0  # counts the rank's prompts: an answer names the one it answers


@dataclass(frozen=True)
class StatusReply:
    rss: int
    device: str


@dataclass(frozen=True)
class Stacks:
    """The main thread's Python stack, taken by the receiver thread (nbddp.wire.stacks.Frame)."""

    frames: tuple[tuple[str, int, str, str], ...]
    cell: int | None  # the cell it is running, None when idle
    groups: tuple = ()  # its place in each group's collectives (nbddp.rank.seq.Position)


# ---------------------------------------------------------------- notebook -> worker


@dataclass(frozen=True)
class JoinGroup:
    port: int


@dataclass(frozen=True)
class Script:
    """A torchrun script run unchanged: its source (read in the notebook), as ``__main__``."""

    path: str
    source: str
    argv: tuple[str, ...] = ()
    keep: bool = False  # its globals join the rank's namespace afterwards


@dataclass(frozen=True)
class Run:
    cell: int
    code: str
    imports: str = ""
    needs: bytes | None = None  # {name: object} (nbddp.wire.payload), bound on the rank
    auto: bytes | None = None  # {name: object} captured automatically: bound where unbound
    # (name, version) of the notebook's objects in needs and auto: a rank that holds a
    # version keeps it, and one another notebook sent (see CellRunner._bind); a name
    # without one becomes the rank's own
    versions: tuple[tuple[str, int], ...] = ()
    want_value: bool = False
    display: bool = False  # send rich output (display(), figures) from this rank
    shm: bool = True  # the notebook shares this rank's /dev/shm: big values come back there
    script: Script | None = None  # run this file as __main__ instead of ``code``
    post_mortem: bool = False  # instead of ``code``: pdb where this rank's last cell failed
    profile: str | None = None  # "torch" | "python": run the cell under that profiler


@dataclass(frozen=True)
class DebugInput:
    """The line typed for a rank's pdb; None: no line will come (pdb reads end of input)."""

    line: str | None
    seq: int = 0  # the DebugPrompt it answers (an answer to an older one is dropped)


@dataclass(frozen=True)
class Interrupt:
    """Interrupt ``cell``: a rank that has not started it yet raises KeyboardInterrupt as
    it starts; a rank whose cell has ended ignores it."""

    cell: int


@dataclass(frozen=True)
class AbortGroup:
    """Abort this rank's process group, freeing it and its peers from any collective.

    A rank running ``cell`` aborts from its receiver thread at once (NCCL's abort;
    on gloo, the group's own sockets are shut down) and again when the cell ends;
    an idle rank aborts in its main thread.
    """

    cell: int = 0


@dataclass(frozen=True)
class StackQuery:
    """Reply with :class:`Stacks`: where the main thread is now."""


@dataclass(frozen=True)
class Reform:
    """Form a new default process group, keeping the namespace.

    ``generation`` names it in the store the ranks already share, so a re-form
    opens no new store connection. ``world_size`` (0: unchanged) is the group's size
    when the pool was resized: the rank's ``world_size`` and env follow it. ``backend``
    ("": unchanged) is the group's at that size (ranks that come to share a GPU: gloo).
    """

    generation: int = 0
    world_size: int = 0
    backend: str = ""
    # sent to a new process in answer to its hello: the only Reform one that waits to be
    # taken in takes (a relay may hand it one meant for the dead process it replaces)
    new: bool = False


@dataclass(frozen=True)
class Refused:
    """notebook -> a rank that connected (or its host's relay, for each of its ranks): this
    pool takes no such rank, and why in one line; the rank says it and exits (a worker
    torchrun restarted after the attached pool lost a rank)."""

    reason: str


@dataclass(frozen=True)
class Query:
    pass


@dataclass(frozen=True)
class Shutdown:
    pass


# ---------------------------------------------------------------- encoding

# every message class above (ErrorInfo, Profile, Held, Script and Stale are parts of
# messages); the events' and Slurm's classes decode too (they travel inside messages and
# relays' frames)
_CODEC = Codec(sys.modules[__name__], (events, slurm), (ErrorInfo, Profile, Held, Script, Stale))
dumps, loads, loads_plain = _CODEC.dumps, _CODEC.loads, _CODEC.loads_plain
