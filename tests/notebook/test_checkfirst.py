"""Check first, then touch the pool: in a real kernel, every pool change that is refused
leaves the running pool as it was (same processes, every rank's namespace digest the
same), and a start with the options the pool has is a no-op that says so."""

from __future__ import annotations

import ast
import os
import socket

import pytest
from test_kernel import execute

from helpers import NAMESPACE_DIGEST, new_kernel

pytestmark = pytest.mark.kernel

STATE = (
    "%%ddp -n 3 --quiet\n"
    "model = torch.nn.Linear(3, 2)\n"
    "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
    "w = torch.zeros(3) + rank"
)


@pytest.fixture(scope="module")
def kc(tmp_path_factory):
    """One kernel for the module, with nbddp loaded and a 3-rank pool that holds state."""
    tmp = tmp_path_factory.mktemp("kernel")
    saved = {k: os.environ.get(k) for k in ("JUPYTER_RUNTIME_DIR", "IPYTHONDIR", "NBDDP_HOME")}
    os.environ.update(
        JUPYTER_RUNTIME_DIR=str(tmp / "runtime"),
        IPYTHONDIR=str(tmp / "ipython"),
        NBDDP_HOME=str(tmp / "nbddp"),
    )
    km, client = new_kernel(tmp)
    try:
        assert execute(client, "%load_ext nbddp\nimport torch").error is None
        yield client
        execute(client, "%ddp stop")
    finally:
        client.stop_channels()
        km.shutdown_kernel(now=True)
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def snapshot(kc) -> tuple[list[int], list[dict]]:
    """(the pool's pids, every rank's namespace digest), as the notebook sees them."""
    r = execute(kc, "%%ddp --no-auto --quiet --out __digests\n" + NAMESPACE_DIGEST)
    assert r.error is None, r.text
    code = (
        "print(repr((__import__('nbddp.notebook.session').notebook.session.SESSION.pool.pids,"
        " __digests)))"
    )
    return ast.literal_eval(execute(kc, code).stdout.strip())


@pytest.fixture
def held(kc):
    """The pool of 3 with its state (made again if a test broke it); its snapshot."""
    if execute(kc, "%%ddp --quiet\nassert world_size == 3 and 'model' in globals()").error:
        assert execute(kc, STATE).error is None
    return snapshot(kc)


REFUSALS = {
    "device-gpu": ("%ddp start -n 3 --device gpu", "--device gpu: no CUDA GPU is visible"),
    "nccl": ("%ddp start --backend nccl", "--backend nccl needs CUDA GPUs"),
    "gpus": ("%ddp start --gpus 0,1", "--gpus names 2 GPUs for 3 ranks"),
    "mesh": ("%ddp start -n 4 --mesh dp=3", "--mesh dp=3: 3 = 3 ranks, but the world size is 4"),
    "groups": ('%ddp start --groups "0,5"', "--groups: every group needs ranks 0..2"),
    "log-dir": ("%ddp start --log-dir /proc/nbddp-nope/logs", "--log-dir: cannot make"),
    "log-dir-open": ("%ddp start --log-dir {open}", "not a private folder of this user"),
    "connect": ("%ddp connect nbddp-no-such-pool", "no detached pool named nbddp-no-such-pool"),
    "detached-name": ("%ddp start --detached bad.name", "a detached pool's name is letters"),
    "detached-gpus": ("%ddp start --detached ok -n 3 --gpus 0", "--gpus names 1 GPU for 3"),
    "attach-name": ("%ddp attach --world-size 2 --detached a.b", "a detached pool's name is"),
    "attach-idle": ("%ddp attach --world-size 2 --idle-timeout 5", "--idle-timeout needs --de"),
    "attach-slurm": (
        "%ddp attach --world-size 2 --detached ok --slurm '--partition gpu'",
        "the SLURM options must say how many nodes (--nodes N)",
    ),
    # issue 47, item 6: these stopped the running pool, then failed
    "attach-busy-port": (
        "%ddp attach --world-size 2 --listen 127.0.0.1:{busy}",
        "cannot listen there: Address already in use",
    ),
    "attach-not-this-host": (
        "%ddp attach --world-size 2 --listen 192.0.2.1:0",  # (TEST-NET-1: no host's)
        "--listen 192.0.2.1:0: cannot listen there: Cannot assign requested address",
    ),
    "attach-detached-busy-port": (
        "%ddp attach --world-size 2 --detached ok --listen 127.0.0.1:{busy}",
        "cannot listen there: Address already in use",
    ),
    "detached-long-name": (
        "%ddp start --detached " + "p" * 120,
        "socket path would be",
    ),
    "attach-sbatch-refuses": (
        "%ddp attach --world-size 2 --slurm '--nodes 1 --partition nope'",
        "sbatch refuses the job: sbatch: error: Batch job submission failed: Invalid partition",
    ),
}


FAILING_SBATCH = """#!/bin/sh
cat > /dev/null
echo 'sbatch: error: Batch job submission failed: Invalid partition name specified' >&2
exit 1
"""


@pytest.mark.parametrize("case", REFUSALS)
def test_a_refused_change_leaves_the_pool_as_it_was(kc, held, case, tmp_path):
    line, said = REFUSALS[case]
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o777)
    os.chmod(open_dir, 0o777)
    fake = tmp_path / "bin"  # an sbatch that refuses every job, first on the kernel's PATH
    fake.mkdir()
    (fake / "sbatch").write_text(FAILING_SBATCH)
    (fake / "sbatch").chmod(0o755)
    path = f"import os\nos.environ['PATH'] = {str(fake)!r} + os.pathsep + os.environ['PATH']"
    assert execute(kc, path).error is None
    busy = socket.create_server(("127.0.0.1", 0))  # a port something else listens on
    try:
        r = execute(kc, line.format(open=open_dir, busy=busy.getsockname()[1]))
    finally:
        busy.close()
        path = f"os.environ['PATH'] = os.environ['PATH'].removeprefix({str(fake) + os.pathsep!r})"
        assert execute(kc, path).error is None
    assert r.text.startswith("UsageError: "), r.text  # one line, no traceback
    assert said in r.text, r.text
    assert len(r.text.strip().splitlines()) == 1, r.text
    assert "restarting" not in r.text, r.text
    assert "stopped" not in r.text, r.text
    assert snapshot(kc) == held  # same processes, every rank's namespace the same


def test_a_resize_the_mesh_cannot_take_is_refused_and_keeps_the_pool(kc, held):
    assert execute(kc, "%ddp start -n 2 --mesh dp=2 --force").error is None
    assert execute(kc, "%%ddp --quiet\nkept = rank + 5").error is None
    before = snapshot(kc)
    r = execute(kc, "%%ddp -n 3\nprint(rank)")
    assert "UsageError: --mesh dp=2: 2 = 2 ranks, but the world size is 3" in r.text, r.text
    assert snapshot(kc) == before
    r = execute(kc, "import nbddp\nnbddp.ranch(4, print)")
    assert r.error["ename"] == "Refused", r.error
    assert r.error["evalue"] == "--mesh dp=2: 2 = 2 ranks, but the world size is 4", r.error
    assert snapshot(kc) == before
    assert execute(kc, "%ddp stop").error is None  # (the next test starts one without a mesh)


def test_a_start_with_the_options_the_pool_has_is_a_no_op(kc, held):
    r = execute(kc, "%ddp start")
    assert r.error is None, r.text
    assert r.stdout.strip() == (
        "nbddp: the pool already runs with these options (3 ranks); %ddp restart starts it anew"
    )
    r = execute(kc, "%ddp start -n 3 --start-method forkserver --on-death replace")
    assert "the pool already runs with these options" in r.stdout, r.text
    assert snapshot(kc) == held


def test_a_new_pool_that_fails_to_start_says_what_the_old_one_held(kc, held):
    # every rank of the new pool fails as it starts (its threads setting is not a number)
    assert execute(kc, "import os\nos.environ['NBDDP_THREADS'] = 'x'").error is None
    try:
        r = execute(kc, "%ddp start --seed 1 --force")
    finally:
        execute(kc, "del os.environ['NBDDP_THREADS']")
    said = r.text.split("UsageError: ", 1)[-1].splitlines()[0]
    assert said.startswith("the pool did not start: the previous pool (3 ranks) was stopped"), said
    assert "they held model, opt, w; the new one failed: rank " in said, said


def test_more_local_ranks_than_gpus_share_them_and_nccl_for_them_is_refused(monkeypatch):
    """On a one-GPU machine, ``-n 2`` shares the GPU over gloo (not refused: nbddp.rank.gpus);
    ``--backend nccl -n 2`` cannot start and is refused in one line by the checks, so a
    running 1-rank pool is never let go for it."""
    import torch

    from nbddp.pool.layout import check_pool

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    check_pool(2)
    check_pool(3, device="gpu")
    with pytest.raises(ValueError, match=r"^--backend nccl needs a GPU per rank: 2 ranks, 1 GPU"):
        check_pool(2, backend="nccl")
    check_pool(1, backend="nccl")
    check_pool(2, device="cpu")
    check_pool(2, listen=("127.0.0.1", 0), token=b"t")  # attached: the ranks are elsewhere
