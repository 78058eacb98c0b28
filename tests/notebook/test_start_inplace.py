"""No command throws a pool away unasked (issue 45): ``%ddp start`` on a trained pool
applies what a live pool can change in place (every rank's process and namespace kept),
and refuses what needs new processes for every rank in one line naming what would be
lost and the explicit way (``--force``), the pool untouched; through a real IPython shell
and real ranks."""

from __future__ import annotations

import os
import signal

import pytest
from IPython.core.error import UsageError

from helpers import namespace_digests, nbddp_shell, wait_gone
from nbddp.notebook.session import SESSION
from nbddp.rank.ddp import threads_for
from tiers import sizes

TRAIN = (
    "%%ddp -n {n} --quiet\n"
    "torch.manual_seed(0)\n"
    "model = torch.nn.Linear(3, 2)\n"
    "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
    "model(torch.ones(4, 3) * (rank + 1)).sum().backward()\n"
    "opt.step()\n"
    "w = torch.arange(3.0) + 10 * rank"
)
THREADS = "__import__('torch').get_num_threads()"


@pytest.fixture(scope="module")
def shell():
    with nbddp_shell("import torch") as sh:
        yield sh


@pytest.fixture(scope="module", params=sizes(3, 2))
def size(request):
    """The world size (module-scoped: the tests of one size run together, one pool)."""
    return request.param


@pytest.fixture
def trained(shell, run, size):
    """A pool of ``size`` ranks with the defaults that trained something (a model, its
    optimizer, a tensor of each rank's own); (size, its pids, every rank's namespace digest)."""
    n, pool = size, SESSION.pool
    if pool is None or pool.world_size != n or SESSION.options:
        run(f"%ddp start -n {n} --force")
    result, out = run(TRAIN.format(n=n))
    assert result.success, out
    pool = SESSION.pool
    return n, pool.pids, namespace_digests(pool)


def unchanged(n: int, pids: list[int], digests: list[dict]) -> None:
    """The same processes, and every rank's namespace as it was."""
    pool = SESSION.pool
    assert pool.world_size == n
    assert pool.pids == pids
    assert namespace_digests(pool) == digests


def test_detached_on_a_local_pool_that_holds_state_is_refused(shell, run, trained):
    n, pids, digests = trained
    name = f"nbddp-t45-{os.getpid()}-{n}"
    try:
        result, out = run(f"%ddp start --detached {name}")
    finally:  # (should one start, it must not outlive the test)
        if getattr(SESSION.pool, "detached", False):
            run(f"%ddp stop {name}")
    assert isinstance(result.error_in_exec, UsageError), out
    assert len(out.strip().splitlines()) == 1, out
    assert f"--detached {name} starts new processes and stops this kernel's pool" in out, out
    assert "every rank's state would be lost (they held model, opt, w)" in out, out
    assert f"`%ddp start --detached {name} --force`" in out, out
    unchanged(n, pids, digests)
    _, listed = run("%ddp list")
    assert name not in listed, listed  # nothing was started


def test_live_options_apply_in_place_and_a_later_death_is_healed_with_them(shell, run, trained):
    n, pids, digests = trained
    result, out = run(f"%ddp start -n {n} --heal w,model --grace 5 --threads 2")
    assert result.success, out
    assert out == (
        "nbddp: applied to the running pool: --heal w,model --grace 5 --threads 2; "
        "every rank kept its state\n"
    )
    unchanged(n, pids, digests)
    pool = SESSION.pool
    assert (pool.heal, pool.grace, pool.threads) == (("w", "model"), 5.0, "2")
    assert SESSION.pool.execute(THREADS) == [2] * n
    result, out = run(f"%ddp start -n {n} --heal w,model --grace 5 --threads 2")
    assert "the pool already runs with these options" in out, out  # (the session knows)

    bad = n - 1
    os.kill(pids[bad], signal.SIGKILL)
    assert wait_gone([pids[bad]]) == []
    _, out = run("%%ddp --quiet\npass")  # (the cell that sees the death says it)
    assert f"rank {bad}: w, model healed from rank 0" in out, out
    result, out = run("%%ddp --quiet --out got\nfloat(w.sum()), float(model.weight.sum())")
    assert result.success, out
    got = shell.user_ns["got"]
    assert got[bad] == got[0], got  # rank 0's (its own w: 3 + 30 r)
    assert got[0][0] == 3.0, got
    assert SESSION.pool.pids[:bad] == pids[:bad]
    assert SESSION.pool.pids[bad] != pids[bad]
    after = namespace_digests(SESSION.pool)
    assert after[:bad] == digests[:bad]

    result, out = run(f"%ddp start -n {n}")  # the defaults again, in place
    assert "applied to the running pool: no --heal --grace 3 no --threads;" in out, out
    default = threads_for(n, None, os.environ.get("OMP_NUM_THREADS"))  # torchrun's
    assert SESSION.pool.execute(THREADS) == [default] * n


def test_a_change_that_needs_new_processes_is_refused_and_forced(shell, run, trained):
    n, pids, digests = trained
    line = f"%ddp start -n {n} --backend gloo --start-method spawn"
    result, out = run(line)
    assert isinstance(result.error_in_exec, UsageError), out
    assert out.startswith("UsageError: --backend, --start-method need new processes"), out
    assert len(out.strip().splitlines()) == 1, out
    assert "every rank's state would be lost (they held model, opt, w)" in out, out
    assert f"`{line} --force`" in out, out
    unchanged(n, pids, digests)
    result, out = run("%ddp restart --seed 1")  # (restart keeps the pool's options)
    assert isinstance(result.error_in_exec, UsageError), out
    assert "`%ddp start OPTIONS --force`" in out, out
    unchanged(n, pids, digests)

    if n > 2:  # (a spawn start costs seconds a rank: 2 ranks show it; else forkserver's)
        line = f"%ddp start -n {n} --backend gloo"
    result, out = run(line + " --force")
    assert result.success, out
    assert "every rank's state is lost (they held model, opt, w)" in out, out
    assert wait_gone(pids) == []
    pool = SESSION.pool
    assert pool.backend == "gloo"
    assert pool.world_size == n
    assert pool.start_method == ("spawn" if n == 2 else "forkserver")
    assert pool.execute("'w' in globals()") == [False] * n
