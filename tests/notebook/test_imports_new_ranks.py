"""Imports go only where a namespace is new (issue 45, item 8), through a real IPython
shell and real ranks.

After a death, a resize up or a host's rejoin the notebook's imports are replayed to the
new ranks only: a name an import bound and a rank then rebound (``from cfgmod import lr``,
then ``lr = lr * 10 * (rank + 1)``) keeps the rank's own value on every survivor. Before,
the whole import log went to every rank of the new pool generation, and each survivor's
``lr`` was the import's again, under a note that every other rank kept its namespace.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time

import pytest

from helpers import nbddp_shell, wait_gone
from tiers import sizes

LR = 0.001


@pytest.fixture(scope="module")
def shell():
    with nbddp_shell() as sh:
        yield sh


@pytest.fixture(scope="module")
def cfgmod(tmp_path_factory):
    """A module of the tests' own on sys.path (before a pool starts: its ranks import
    what the notebook can): ``lr = 0.001``; its name (one for every test: the notebook's
    import log keeps each import)."""
    folder = tmp_path_factory.mktemp("cfgmod")
    (folder / "cfgmod45.py").write_text(f"lr = {LR}\n")
    sys.path.insert(0, str(folder))
    yield "cfgmod45"
    sys.path.remove(str(folder))
    sys.modules.pop("cfgmod45", None)


def _own(ranks) -> list[float]:
    return [LR * 10 * (r + 1) for r in ranks]


def _until_seen_dead(pool, rank: int, timeout: float = 10.0) -> None:
    """Until the pool has read ``rank``'s death (its connections closed: the next cell
    replaces it before it runs, rather than finding it dead in the cell)."""
    deadline = time.monotonic() + timeout
    while pool.status()[rank].state != "dead":
        assert time.monotonic() < deadline, f"rank {rank}'s death was not seen"


def _lr(shell, run) -> tuple[list[float], str]:
    result, out = run("%%ddp --text --out _v\nlr")
    assert result.success, out
    return shell.user_ns["_v"], out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("n", sizes(2, 3, 8, ids="{}"))
def test_a_survivors_rebinding_of_an_imported_name_outlives_a_death_and_a_resize(
    shell, run, cfgmod, n
):
    from nbddp.notebook.magics import _MAGICS

    run("%ddp stop")
    result, out = run(f"from {cfgmod} import lr")
    assert result.success, out
    result, out = run(f"%%ddp -n {n} --text\nlr = lr * 10 * (rank + 1)")
    assert result.success, out
    assert re.search(r"^nbddp: replayed \d+ imports?$", out, re.M), out  # all: the same
    values, _ = _lr(shell, run)
    assert values == _own(range(n))

    # a rank killed between cells: replaced; only it gets the imports
    pool = _MAGICS[id(shell)].pool
    bad, pid = n - 1, pool.roster.pids()[n - 1]
    os.kill(pid, signal.SIGKILL)
    assert wait_gone([pid]) == []
    _until_seen_dead(pool, bad)
    values, out = _lr(shell, run)
    assert values == [*_own(range(n - 1)), LR]
    assert f"rank {bad}: a new process took its place" in out, out
    assert re.search(rf"^nbddp: replayed \d+ imports? on rank {bad} \(new\)$", out, re.M), out

    # a resize up: the new rank gets the import's value, the others keep theirs
    result, out = run(f"%%ddp -n {n + 1} --text --out _v\nlr")
    assert result.success, out
    assert shell.user_ns["_v"] == [*_own(range(n - 1)), LR, LR]
    assert re.search(rf"^nbddp: replayed \d+ imports? on rank {n} \(new\)$", out, re.M), out
    run("%ddp stop")
