"""What a pool of ``n`` ranks may be started with: every check that can be made before
anything starts, in one place.

:class:`~nbddp.pool.facade.Pool` runs :func:`check_pool` when it is made, and the front end
runs it before it lets a running pool go (``%ddp start``, ``%%ddp -n``, ``ranch``,
``--detached``), so a refusal leaves the running pool as it was. Each refusal is a
``ValueError`` of one line that says why and what to use instead.
"""

from __future__ import annotations

import math
import os
import stat
import sys

from ..rank.ddp import check_device, parse_groups, parse_mesh
from ..rank.gpus import plan, visible_gpus
from ..wire.private import UnsafeFile, checked_folder, make_folder, workspace_folder
from .launch import START_METHODS

__all__ = ["ON_DEATH", "check_layout", "check_options", "check_pool"]


ON_DEATH = ("replace", "restart")


def check_pool(
    n,
    *,
    start_method: str = "forkserver",
    backend: str | None = None,
    pg_timeout: float | None = None,
    start_timeout: float = 120.0,
    grace: float = 3.0,
    abort_after: float = 1.0,
    listen: tuple[str, int] | None = None,
    token: bytes | None = None,
    device: str | None = None,
    gpus: list[int] | None = None,
    seed: int | None = None,
    groups: str | None = None,
    mesh: str | None = None,
    log_dir: str | None = None,
    workspace: str | None = None,
    threads: str | int | None = None,
    on_death: str = "replace",
    **_nothing_to_check,  # env, tls, on_join, debug
) -> None:
    """Refuse (``ValueError``, one line) a pool of ``n`` ranks these options cannot make:
    Pool's own keyword arguments. The log folder and a local workspace are made (0700)."""
    check_options(n, start_method, backend, listen, token, threads, on_death)
    check_layout(n, device, gpus, groups, mesh)
    check_backend(n, backend, device, gpus)
    check_times(pg_timeout=pg_timeout, start_timeout=start_timeout, grace=grace)
    if abort_after is None or abort_after < 0:
        raise ValueError(f"abort_after: seconds >= 0, not {abort_after!r}")
    if seed is not None and not isinstance(seed, int):
        raise ValueError(f"--seed takes a whole number, not {seed!r}")
    if log_dir is not None:
        check_log_dir(log_dir, n)
    if workspace is not None:
        check_workspace(workspace, local=listen is None)


def check_options(n, start_method, backend, listen, token, threads, on_death="replace") -> None:
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"the world size must be a whole number >= 1, not {n!r}")
    if start_method not in START_METHODS:
        raise ValueError(
            f"unknown start method {start_method!r} (choose from {', '.join(START_METHODS)})"
        )
    torch = sys.modules.get("torch")
    if start_method == "fork" and torch is not None and torch.cuda.is_initialized():
        raise ValueError(
            "start method 'fork' is unsafe: CUDA is initialised in this notebook "
            "(use the default 'forkserver', or 'spawn')"
        )
    if backend not in (None, "gloo", "nccl"):
        raise ValueError(f"unknown backend {backend!r} (choose gloo or nccl)")
    if threads is not None and str(threads) != "auto" and not str(threads).isdigit():
        raise ValueError(f"threads: a number or 'auto', not {threads!r}")
    if threads is not None and str(threads) == "0":
        raise ValueError("threads: a number >= 1 or 'auto', not 0")
    if on_death not in ON_DEATH:
        raise ValueError(f"on_death: 'replace' or 'restart', not {on_death!r}")
    if listen is not None and not token:
        raise ValueError("a pool that listens on TCP needs a token")


def check_layout(n, device, gpus, groups, mesh) -> None:
    """Refuse, before anything starts, options that cannot fit ``n`` ranks."""
    check_device(device)
    if gpus is not None and len(gpus) < n:
        raise ValueError(
            f"--gpus names {len(gpus)} GPU{'s' * (len(gpus) != 1)} for {n} ranks: name "
            f"{n} GPUs, or use -n {len(gpus)}"
        )
    for group in parse_groups(groups):
        if not group or any(not 0 <= r < n for r in group):
            raise ValueError(f"--groups: every group needs ranks 0..{n - 1}, not {group}")
    names, sizes = parse_mesh(mesh)
    if names and math.prod(sizes) != n:
        raise ValueError(
            f"--mesh {mesh}: {' x '.join(map(str, sizes))} = {math.prod(sizes)} ranks, "
            f"but the world size is {n}"
        )


def check_backend(n: int, backend: str | None, device: str | None, gpus) -> None:
    """NCCL needs CUDA and a GPU per rank; ``--gpus`` must name GPUs this host has. More
    ranks than GPUs without ``--backend nccl`` share them over gloo (:mod:`nbddp.rank.gpus`)."""
    count = visible_gpus()
    if gpus is not None and any(not isinstance(g, int) or g < 0 for g in gpus):
        raise ValueError(f"--gpus takes GPU numbers like 0,3, not {gpus}")
    if gpus and count and "CUDA_VISIBLE_DEVICES" not in os.environ and max(gpus) >= count:
        raise ValueError(f"--gpus names GPU {max(gpus)}, but this host has GPUs 0..{count - 1}")
    if backend != "nccl":
        return
    if device in ("cpu", "mps"):
        raise ValueError(f"--backend nccl needs CUDA GPUs, not --device {device}: use gloo")
    if not count:
        raise ValueError(
            "--backend nccl needs CUDA GPUs and none is visible here: use --backend gloo"
        )
    chosen = plan(n, backend=backend, device=device, gpus=gpus, count=count)
    if chosen.shared:
        have = len(set(chosen.gpus))
        raise ValueError(
            f"--backend nccl needs a GPU per rank: {n} ranks, {have} GPU{'s' * (have != 1)} "
            f"{'named' if gpus is not None else 'here'}; use -n {have}, or --backend gloo"
        )


def check_times(**seconds: float | None) -> None:
    """Each of ``seconds`` (None: not set) is a positive number of seconds."""
    for name, value in seconds.items():
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{name}: a positive number of seconds, not {value!r}")


def check_log_dir(path: str, n: int) -> None:
    """``--log-dir``: made (0700) if missing; a folder of this user that no one else can
    write in, that this user can write in, with private rank folders (as LogDir needs)."""
    try:
        make_folder(path)
        st = os.stat(path)
    except OSError as exc:
        raise ValueError(f"--log-dir: cannot make {path}: {exc.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"--log-dir {path}: not a folder")
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise ValueError(
            f"--log-dir {path}: not a private folder of this user (owner uid {st.st_uid}, "
            f"mode {stat.filemode(st.st_mode)}); name a folder only you can write"
        )
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"--log-dir {path}: this user cannot write in it")
    for rank in range(n):
        folder = os.path.join(path, str(rank))
        if os.path.lexists(folder):
            try:
                checked_folder(folder)
            except UnsafeFile as exc:
                raise ValueError(f"--log-dir: {exc}") from None


def check_workspace(path: str, local: bool) -> None:
    """``--workspace``: made (0700) for a local pool; for ranks on other hosts, checked
    when this host sees it (they check it again)."""
    if not local and not os.path.exists(path):
        return
    try:
        workspace_folder(path)
    except UnsafeFile as exc:
        raise ValueError(f"--workspace: {exc}") from None
    except OSError as exc:
        raise ValueError(f"--workspace: cannot make {path}: {exc.strerror}") from None
