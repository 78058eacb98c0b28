"""Ranks on other machines: the token file, and the commands that start them there.

torchrun (started by hand, or by SLURM) starts the workers; they connect back to
the notebook's listener with the token.
"""

from __future__ import annotations

import subprocess

from ..pool.errors import PoolStartError
from ..wire.private import DEFAULT_TOKEN_FILE, write_token_file

__all__ = [
    "DEFAULT_TOKEN_FILE",
    "read_or_create_token",
    "slurm_script",
    "submit_slurm",
    "torchrun_command",
    "worker_command",
]


def read_or_create_token(path: str = DEFAULT_TOKEN_FILE, pin: str | None = None) -> bytes:
    """The token in ``path``; a new random one (file 0600, folder 0700) if it is missing.
    ``pin``: the certificate fingerprint of a --tls pool ("" for none) is written in too.
    A token file others can read, or of another user, is refused (UnsafeFile)."""
    return write_token_file(path, pin).token


def worker_command(connect: str, token_file: str) -> str:
    return f"-m nbddp.worker --connect {connect} --token-file {token_file}"


def torchrun_command(connect: str, token_file: str, world_size: int) -> str:
    """What to run on each node (NODES x GPUS_PER_NODE must be the world size). A static
    rendezvous (each node's rank said): the same command brings a lost host's ranks back
    from a replacement host (nbddp.pool.hosts_lost); with c10d's, torch's agents would restart
    the other hosts' workers when a new node joins their rendezvous."""
    return (
        "torchrun --nnodes NODES --node-rank THIS_NODE --nproc-per-node GPUS_PER_NODE "
        "--master-addr FIRST_NODE --master-port 29400 \\\n    "
        + worker_command(connect, token_file)
        + f"\n(NODES x GPUS_PER_NODE = {world_size}; THIS_NODE: 0 on FIRST_NODE, 1, 2, ...)"
    )


def slurm_script(
    sbatch_options: str, world_size: int, connect: str, token_file: str, python: str = "python"
) -> str:
    """A job script that runs torchrun once per node and so ``world_size`` workers.

    ``sbatch_options`` must name ``--nodes N``; each node runs world_size / N ranks.
    torchrun's static rendezvous, as :func:`torchrun_command`'s: the node rank is
    $SLURM_NODEID, the master the first node of the job. ``--no-kill`` (the job's and the
    step's) keeps the other nodes' ranks when a node fails. The same script, submitted
    again with NBDDP_NODE_RANK and NBDDP_MASTER_ADDR exported, starts a lost node's ranks
    on a replacement (docs/multinode.md).
    """
    import re
    import shlex

    m = re.search(r"(?:--nodes[ =]|-N\s*)(\d+)", sbatch_options)
    if not m:
        raise ValueError("the SLURM options must say how many nodes (--nodes N)")
    nodes = int(m.group(1))
    if world_size % nodes:
        raise ValueError(f"a world size of {world_size} does not split over {nodes} nodes")
    options = shlex.split(sbatch_options)
    lines = [
        "#!/bin/bash",
        "#SBATCH --job-name=nbddp",
        f"#SBATCH {' '.join(shlex.quote(o) for o in options)}",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --no-kill",
        "#SBATCH --output=nbddp-%j.log",
        "set -euo pipefail",
        'first=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        'export NBDDP_MASTER_ADDR="${NBDDP_MASTER_ADDR:-$first}"',
        "# torchrun's static rendezvous: each node's --node-rank (PET_NODE_RANK) is its",
        "# $SLURM_NODEID, or NBDDP_NODE_RANK on a replacement for a lost node",
        _slurm_step(python, nodes, world_size // nodes, connect, token_file),
    ]
    return "\n".join(lines) + "\n"


def _slurm_step(python: str, nodes: int, per_node: int, connect: str, token_file: str) -> str:
    """The job's step: a torchrun on each node, whose node rank is read there. Neither a
    node that fails nor a torchrun that ends ends the others (--no-kill, -K0)."""
    import shlex

    torchrun = (
        f"{shlex.quote(python)} -m torch.distributed.run --nnodes {nodes} "
        f'--nproc-per-node {per_node} --master-addr "$NBDDP_MASTER_ADDR" --master-port 29400 '
        + worker_command(connect, shlex.quote(token_file))
    )
    each = """'PET_NODE_RANK="${NBDDP_NODE_RANK:-$SLURM_NODEID}" exec "$@"'"""
    return f"srun --no-kill --kill-on-bad-exit=0 bash -c {each} - {torchrun}"


def check_slurm(script: str) -> None:
    """``sbatch --test-only`` the script (nothing is submitted): SLURM's own word on it, or
    no sbatch here, raised as a ValueError before the running pool is let go."""
    try:
        out = subprocess.run(
            ["sbatch", "--test-only"],
            input=script,
            capture_output=True,
            text=True,
            check=False,
            timeout=SBATCH_TIMEOUT,
        )
    except FileNotFoundError:
        raise ValueError("--slurm needs SLURM's sbatch on this host: none is on PATH") from None
    except subprocess.TimeoutExpired:
        raise ValueError(
            f"sbatch --test-only did not answer in {SBATCH_TIMEOUT:g} s (is slurmctld up?)"
        ) from None
    if out.returncode != 0:
        said = (out.stderr.strip() or out.stdout.strip()).splitlines()
        raise ValueError(f"sbatch refuses the job: {said[-1] if said else out.returncode}")


SBATCH_TIMEOUT = 30.0  # s ``sbatch --test-only`` may take


def submit_slurm(script: str) -> str:
    """``sbatch`` the script; return the job id."""
    out = subprocess.run(
        ["sbatch", "--parsable"], input=script, capture_output=True, text=True, check=False
    )
    if out.returncode != 0:
        raise PoolStartError(f"sbatch failed: {out.stderr.strip() or out.stdout.strip()}")
    return out.stdout.strip().split(";")[0]
