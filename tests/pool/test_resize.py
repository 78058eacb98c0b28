"""Resizing a local pool keeps the ranks that stay: same processes, same namespaces; new
ranks start fresh, re-run the cells without collectives, and are in the group; the stopped
ones are said with what they held."""

from __future__ import annotations

import ast
import re

import pytest
from test_kernel import execute, ranks_printing

from helpers import namespace_digests, wait_gone
from nbddp import Pool
from nbddp.wire.stacks import rank_set

STATE = (
    "model = torch.nn.Linear(3, 2)\n"
    "opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)\n"
    "model(torch.ones(3) * rank).sum().backward()\n"
    "opt.step()\n"
    "w = torch.zeros(3) + rank\n"
    "import math"
)
GROUP = (
    "import os, torch.distributed as dist\n"
    "t = torch.ones(1) * (rank + 1)\n"
    "dist.all_reduce(t)\n"
    "(int(t), dist.get_world_size(), world_size, os.environ['WORLD_SIZE'], "
    "os.environ['LOCAL_WORLD_SIZE'], os.environ['RANK'], rank)"
)
FRESH = {"display", "torch", "rank", "local_rank", "world_size", "device"}


def in_the_group(pool, n: int) -> None:
    """Every one of ``n`` ranks is in one group of ``n``, and says so everywhere."""
    total = n * (n + 1) // 2
    assert pool.execute(GROUP) == [(total, n, n, str(n), str(n), str(r), r) for r in range(n)]


def without_size(digest: dict) -> dict:
    return {k: v for k, v in digest.items() if k != "world_size"}


def test_resizing_keeps_the_ranks_that_stay_and_adds_fresh_ones():
    """4 -> 8 -> 4 -> 2 -> 3 on one pool: each step keeps ranks 0..min-1 as they were."""
    with Pool(4) as pool:
        pool.execute(STATE)
        for new in (8, 4, 2, 3):
            old, pids, before = pool.world_size, pool.pids, namespace_digests(pool)
            done = pool.resize(new)
            kept = min(old, new)
            assert pool.world_size == new == len(pool.pids), (old, new)
            assert pool.pids[:kept] == pids[:kept], (old, new)
            after = namespace_digests(pool)
            for r in range(kept):  # nothing changed but world_size
                assert without_size(after[r]) == without_size(before[r]), (old, new, r)
            for r in range(kept, new):  # new: they re-ran STATE (no collective) by themselves
                assert set(after[r]) == FRESH | {"model", "opt", "w", "math"}, (old, new, r)
            in_the_group(pool, new)
            if new < old:
                assert wait_gone(pids[new:]) == []
                they = "they" if old - new > 1 else "it"
                said = f"{rank_set(list(range(new, old)))} stopped ({they} held model, opt, t, w)"
                assert said in done.line(), done.line()
            else:
                assert "(fresh namespaces)" in done.line(), done.line()
                pool.execute(STATE, ranks=list(range(old, new)))


def test_a_resize_refused_by_the_pools_own_options_keeps_it():
    with Pool(2, mesh="dp=2") as pool:
        pids, before = pool.pids, namespace_digests(pool)
        with pytest.raises(ValueError, match="--mesh dp=2: 2 = 2 ranks, but the world size is 3"):
            pool.resize(3)
        assert pool.pids == pids
        assert namespace_digests(pool) == before


@pytest.mark.kernel
def test_percent_ddp_n_resizes_in_a_kernel_and_replays_imports(kernel):
    _, kc = kernel
    assert execute(kc, "%load_ext nbddp").error is None
    assert execute(kc, "import math\nimport torch").error is None
    r = execute(kc, "%%ddp -n 2 --text\nmodel = torch.nn.Linear(2, 2)\nopt = rank")
    assert r.error is None, r.text
    pids = _pids(kc)
    r = execute(kc, "%%ddp -n 4 --text\nprint(math.floor(2.5), 'model' in globals())")
    assert r.error is None, r.text
    assert "resized the pool 2 -> 4 ranks in" in r.stdout
    assert "ranks 2, 3 are new (fresh namespaces); ranks 0, 1 kept theirs" in r.stdout
    # the new ranks re-ran the cell without collectives that made model (the note names it)
    assert re.search(r"ranks 2, 3 re-ran In \[\d+\]: model, opt$", r.stdout, re.M), r.stdout
    assert ranks_printing(r.stdout, "2 True") == {0, 1, 2, 3}, r.stdout
    assert _pids(kc)[:2] == pids
    r = execute(kc, "%%ddp -n 2 --text\nprint(world_size)")
    assert r.error is None, r.text
    assert "resized the pool 4 -> 2 ranks in" in r.stdout
    assert "ranks 2, 3 stopped (they held model, opt)" in r.stdout, r.stdout
    assert ranks_printing(r.stdout, "2") == {0, 1}, r.stdout
    assert _pids(kc) == pids
    r = execute(kc, "%ddp start -n 2")
    assert "the pool already runs with these options (2 ranks); %ddp restart starts it anew" in (
        r.stdout
    )
    assert _pids(kc) == pids


def _pids(kc) -> list[int]:
    """The pool's pids, read without an import (the notebook's imports go to the ranks)."""
    code = "print(__import__('nbddp.notebook.session').notebook.session.SESSION.pool.pids)"
    return ast.literal_eval(execute(kc, code).stdout.strip())
