"""What a pool of ``n`` ranks may be started with: refused before anything starts."""

from __future__ import annotations

import math

from .ddp import check_device, parse_groups, parse_mesh
from .launch import START_METHODS

__all__ = ["ON_DEATH", "check_layout", "check_options"]


ON_DEATH = ("replace", "restart")


def check_options(n, start_method, backend, listen, token, threads, on_death="replace") -> None:
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"the world size must be a whole number >= 1, not {n!r}")
    if start_method not in START_METHODS:
        raise ValueError(
            f"unknown start method {start_method!r} (choose from {', '.join(START_METHODS)})"
        )
    if backend not in (None, "gloo", "nccl"):
        raise ValueError(f"unknown backend {backend!r} (choose gloo or nccl)")
    if threads is not None and str(threads) != "auto" and not str(threads).isdigit():
        raise ValueError(f"threads: a number or 'auto', not {threads!r}")
    if on_death not in ON_DEATH:
        raise ValueError(f"on_death: 'replace' or 'restart', not {on_death!r}")
    if listen is not None and not token:
        raise ValueError("a pool that listens on TCP needs a token")


def check_layout(n, device, gpus, groups, mesh) -> None:
    """Refuse, before anything starts, options that cannot fit ``n`` ranks."""
    check_device(device)
    if gpus is not None and len(gpus) < n:
        raise ValueError(f"--gpus names {len(gpus)} GPUs for {n} ranks")
    for group in parse_groups(groups):
        if not group or any(not 0 <= r < n for r in group):
            raise ValueError(f"--groups: every group needs ranks 0..{n - 1}, not {group}")
    names, sizes = parse_mesh(mesh)
    if names and math.prod(sizes) != n:
        raise ValueError(
            f"--mesh {mesh}: {' x '.join(map(str, sizes))} = {math.prod(sizes)} ranks, "
            f"but the world size is {n}"
        )
