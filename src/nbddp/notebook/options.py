"""The ``%%ddp`` and ``%ddp`` argument parsers: what each magic takes, checked before the
pool is touched. Their docstrings and help are what ``%%ddp?`` and ``%ddp?`` show, and
what the docs' magics reference is made from; ``nbddp.notebook.export`` reads cells with them.
"""

from __future__ import annotations

import argparse
import os
import shlex
from collections.abc import Callable

from IPython.core.error import UsageError
from IPython.core.magic_arguments import argument, magic_arguments

from ..pool.launch import START_METHODS
from . import remote

__all__ = ["PARSERS", "SUBCOMMANDS", "help_text", "parse_argstring"]

SUBCOMMANDS = (
    "start",
    "attach",
    "status",
    "stacks",
    "restart",
    "stop",
    "interrupt",
    "push",
    "pull",
    "copy",
    "rollback",
    "connect",
    "list",
    "disconnect",
    "run",
    "export",
    "debug",
    "metrics",
)


def _world_size(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"the world size must be a whole number, not {text!r}"
        ) from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"the world size must be at least 1, not {n}")
    return n


def _threads(text: str) -> str:
    if text != "auto" and not (text.isdigit() and int(text) >= 1):
        raise argparse.ArgumentTypeError(f"threads: a whole number >= 1 or auto, not {text!r}")
    return text


def _seconds(text: str) -> float:
    try:
        s = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, not {text!r}") from None
    if s <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, not {text}")
    return s


def _folder(text: str) -> str:
    """An absolute path (``~`` expanded): every host must find the folder at that path."""
    path = os.path.expanduser(text)
    if not os.path.isabs(path):
        raise argparse.ArgumentTypeError(
            f"give an absolute path (every host must mount it there), not {text!r}"
        )
    return os.path.normpath(path)


def parse_argstring(magic, line: str) -> argparse.Namespace:
    """Like IPython's, but shell-like quoting: ``--imports "import a; import b"``."""
    try:
        argv = shlex.split(line)
    except ValueError as exc:
        raise UsageError(f"cannot parse the arguments: {exc}") from None
    return magic.parser.parse_args(argv)


# ---------------------------------------------------------------- argument parsers
# (their docstrings and help are what %%ddp? and %ddp? show)


@magic_arguments()
@argument("-n", type=_world_size, help="world size (starts or resizes the pool)")
@argument("--need", nargs="+", default=[], help="notebook names to ship to the ranks: 'a,b c'")
@argument("--no-auto", action="store_true", help="ship only --need names; replay no imports")
@argument("--imports", default="", help="import statements run on the ranks first")
@argument("--ranks", help="run only on these ranks: '0,2-3'")
@argument("--out", help="notebook variable that receives each rank's last value, by rank")
@argument("--timeout", type=_seconds, help="seconds before the cell is interrupted")
@argument("--display", default="0", help="ranks whose display() and figures are shown ('0')")
@argument("--text", action="store_true", help="print lines as '[rank N] line', no widgets")
@argument("--quiet", action="store_true", help="show nothing unless a rank fails")
@argument(
    "--profile",
    nargs="?",
    const="torch",
    choices=("torch", "python"),
    help="profile every rank (torch's profiler, or cProfile with 'python'): time in "
    "collectives, top operations, the slowest rank",
)
@argument(
    "--no-fold",
    action="store_true",
    help="every rank's lines apart (by default a line several ranks print shows once)",
)
def ddp_cell(line, cell):
    """Run the cell on every rank of the pool (``%%ddp``)."""


@magic_arguments()
@argument("-n", type=_world_size, help="world size (default: one per GPU, else 2)")
@argument("--backend", choices=("gloo", "nccl"), help="default: nccl with CUDA, else gloo")
@argument("--start-method", choices=START_METHODS, default="forkserver")
@argument("--timeout", type=_seconds, help="process-group timeout in seconds")
@argument("--grace", type=_seconds, help="seconds an interrupted rank gets before a restart (3)")
@argument("--no-auto", action="store_true", help="no automatic capture for this pool")
@argument("--auto-limit", default="100MB", help="largest object captured automatically (100MB)")
@argument("--device", choices=("cpu", "gpu", "mps"), help="default: gpu when CUDA is visible")
@argument("--gpus", help="which GPUs the ranks use, in order: '0,3'")
@argument("--seed", type=int, help="seed random, numpy and torch on every rank (and restarts)")
@argument("--groups", help="process subgroups, bound as `group` on each rank: '0,2;1,3'")
@argument("--mesh", help="a DeviceMesh bound as `mesh`: 'dp=2,tp=2' (product = world size)")
@argument("--log-dir", help="every rank's output to DIR/{rank}/stdout.log, stderr.log")
@argument("--tee", help="ranks whose output the notebook shows (all): the rest only in --log-dir")
@argument("--workspace", type=_folder, help="a folder the ranks share: %%ddp copy goes through it")
@argument(
    "--debug",
    action="store_true",
    help="torch's collective checks (TORCH_DISTRIBUTED_DEBUG=DETAIL): a mismatch fails at once",
)
@argument(
    "--detached", metavar="NAME", help="a pool that outlives this kernel (%%ddp connect NAME)"
)
@argument(
    "--idle-timeout",
    type=_seconds,
    help="a detached pool with no kernel connected this long stops itself (3600 s)",
)
@argument(
    "--on-death",
    choices=("replace", "restart"),
    default="replace",
    help="a rank that dies: a new process takes its place, the others keep their state "
    "(replace), or the whole pool restarts (restart)",
)
@argument(
    "--heal",
    metavar="NAMES",
    help="names a rank that took a dead one's place gets from a survivor before the next "
    "cell ('model,opt'; DDP wrappers wrapped again)",
)
@argument(
    "--keep",
    metavar="NAMES",
    help="names every rank snapshots at the end of each clean cell ('fmodel,opt': modules "
    "incl. FSDP2 and tensor-parallel, optimizers, tensors), into shared memory; "
    "%%ddp rollback puts them back on every rank",
)
@argument(
    "--threads",
    type=_threads,
    help="intra-op threads per rank: N, or auto (cores / ranks); default as torchrun (1)",
)
@argument(
    "--force",
    action="store_true",
    help="restart a running pool whose ranks hold state when an option needs new processes "
    "(--backend, --seed, --detached, ...): without it that is refused",
)
def ddp_start(line):
    """Start the pool; with one running, change what a live pool can (--heal, --grace,
    --on-death, --threads, capture) in place, and refuse what needs new processes while its
    ranks hold state (--force restarts it)."""


@magic_arguments()
@argument("--world-size", type=_world_size, required=True, help="how many ranks will connect")
@argument("--listen", default="127.0.0.1:0", help="HOST:PORT to listen on (loopback by default)")
@argument("--token-file", default=remote.DEFAULT_TOKEN_FILE, help="shared secret (made if missing)")
@argument("--tls", action="store_true", help="encrypt (a certificate pinned in the token file)")
@argument("--timeout", type=_seconds, default=600.0, help="seconds to wait for every rank")
@argument("--slurm", help="sbatch options: submit the torchrun job too ('--nodes 2 ...')")
@argument(
    "--workspace",
    type=_folder,
    help="a folder every host mounts at this path (NFS): %%ddp copy goes through it",
)
@argument(
    "--detached",
    metavar="NAME",
    help="the pool outlives this kernel, its ranks too (%%ddp connect NAME)",
)
@argument(
    "--idle-timeout",
    type=_seconds,
    help="a detached pool with no kernel connected this long stops itself (3600 s)",
)
def ddp_attach(line):
    """Wait for ranks started by torchrun elsewhere to connect, then use them as the pool."""


@magic_arguments()
@argument("names", nargs="+", help="notebook names to ship")
@argument("--ranks", help="only these ranks: '0,2-3'")
def ddp_push(line):
    """Bind notebook objects on the ranks."""


@magic_arguments()
@argument("name", help="the detached pool's name (%%ddp list shows them)")
@argument("--force", action="store_true", help="take it over from the kernel connected to it")
def ddp_connect(line):
    """Connect to a detached pool: every rank's namespace as it was."""


@magic_arguments()
@argument("names", nargs="+", help="names on the source rank: 'model opt' or 'model,opt'")
@argument("--from", dest="src", type=int, required=True, help="the rank to copy from")
@argument("--to", help="the ranks to copy to: '2' or '1-3' (default: every other rank)")
def ddp_copy(line):
    """Copy objects from one live rank's namespace to others (a new rank heals from a
    survivor): ``%ddp copy model opt --from 0 --to 2``."""


@magic_arguments()
@argument("--ranks", help="only these ranks: '0,2-3'")
@argument("--keep", action="store_true", help="keep the script's globals in each rank's namespace")
@argument("script", help="a torchrun script, run unchanged as __main__ on every rank")
@argument("args", nargs=argparse.REMAINDER, help="the script's own arguments (its sys.argv)")
def ddp_run(line):
    """Run a torchrun script on the pool: ``%ddp run [--ranks R] [--keep] train.py --lr 0.1``."""


@magic_arguments()
@argument("file", help="the script to write, e.g. train.py")
@argument("--force", action="store_true", help="write over an existing file (never a notebook)")
@argument("-n", type=_world_size, help="the torchrun command's --nproc-per-node (the pool's)")
def ddp_export(line):
    """Write this session's %%ddp cells, and what they used from the notebook, as a torchrun
    script."""


@magic_arguments()
@argument("name", help="a name or expression on the ranks")
@argument("--rank", type=int, default=0, help="which rank (default 0)")
@argument("--all", action="store_true", help="a list with every rank's value")
def ddp_pull(line):
    """Return a rank's value (``x = %ddp pull NAME``)."""


@magic_arguments()
@argument("--rank", type=int, help="which rank (default: the first that failed)")
def ddp_debug(line):
    """pdb where a rank's last failed cell raised, in its live namespace (post-mortem)."""


@magic_arguments()
@argument("name", nargs="?", help="only this metric (default: every one)")
@argument("--run", help="only this run: a run=... name, or a cell's own (In [7])")
@argument("--clear", action="store_true", help="forget every metric logged so far")
def ddp_metrics(line):
    """The points ``nbddp.log_metrics`` sent (``m = %ddp metrics``): a pandas DataFrame
    with rank, step, name, value and run (a list of dicts without pandas)."""


# ---------------------------------------------------------------- help, from the parsers

PARSERS = {
    "%%ddp": ddp_cell,
    "%ddp start": ddp_start,
    "%ddp attach": ddp_attach,
    "%ddp push": ddp_push,
    "%ddp pull": ddp_pull,
    "%ddp copy": ddp_copy,
    "%ddp connect": ddp_connect,
    "%ddp run": ddp_run,
    "%ddp export": ddp_export,
    "%ddp debug": ddp_debug,
    "%ddp metrics": ddp_metrics,
}
for _prog, _magic in PARSERS.items():
    # usage lines and errors say "%ddp start", not "%ddp_start" (IPython adds one "%")
    _magic.parser.prog = _prog[1:]


def help_text(doc_of: Callable[[str], str | None]) -> str:
    """What ``%ddp?`` and ``%%ddp?`` show: every subcommand, each option with its help,
    made from the argument parsers and, for a subcommand without options, the first line
    of ``doc_of(command)`` (its method's docstring)."""
    parts = [
        "Run a cell on a persistent pool of torch.distributed ranks "
        "(%%ddp), and manage the pool (%ddp COMMAND).\n"
    ]
    with_parser = {prog.split()[-1] for prog in PARSERS}
    for magic in PARSERS.values():
        parts.append(magic.parser.format_help())
    for command in SUBCOMMANDS:
        if command not in with_parser:
            doc = (doc_of(command) or "").strip().splitlines()[0]
            parts.append(f"%ddp {command}\n    {doc}\n")
    return "\n".join(parts)
