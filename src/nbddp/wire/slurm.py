"""Where a rank launched under SLURM came from, bounded: a part of its Hello
(:class:`nbddp.wire.protocol.Hello`), which the lost-host note's resubmission recipe
names (docs/multinode.md)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["Slurm", "checked", "slurm_of"]


@dataclass(frozen=True)
class Slurm:
    """Where a rank launched under SLURM came from: the one-node resubmission recipe for its
    host names these (docs/multinode.md). Built only by :func:`slurm_of`, which bounds them."""

    job_id: str  # digits only
    node_rank: int
    master_addr: str  # a plain hostname or IP


_ADDR = re.compile(r"[A-Za-z0-9][A-Za-z0-9.:-]{0,252}")


def slurm_of(env: Mapping[str, str]) -> Slurm | None:
    """The rank's SLURM origin from its environment, or None when any part is missing or not
    plain (a job id of digits, a node rank 0..65535, a hostname/IP): they are shown to the user."""
    job = env.get("SLURM_JOB_ID", "")
    node = env.get("GROUP_RANK") or env.get("PET_NODE_RANK") or ""
    addr = env.get("MASTER_ADDR", "")
    if not (job.isascii() and job.isdigit() and len(job) <= 20):
        return None
    if not (node.isascii() and node.isdigit() and int(node) < 65536):
        return None
    if not _ADDR.fullmatch(addr):
        return None
    return Slurm(job, int(node), addr)


def checked(slurm: object) -> Slurm | None:
    """``slurm`` as it arrived in a Hello, checked as :func:`slurm_of` built it (a sender
    holding the token could send anything: it ends up in a command shown to the user)."""
    if not isinstance(slurm, Slurm) or not isinstance(slurm.node_rank, int):
        return None
    env = {
        "SLURM_JOB_ID": str(slurm.job_id),
        "GROUP_RANK": str(slurm.node_rank),
        "MASTER_ADDR": str(slurm.master_addr),
    }
    built = slurm_of(env)
    return built if built == slurm else None
