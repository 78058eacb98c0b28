"""Shared fixtures: real pools (started once per session where a test allows it)."""

from __future__ import annotations

import pytest

from helpers import healthy
from nbddp import Pool


@pytest.fixture(scope="session")
def shared_pool():
    with Pool(2) as pool:
        yield pool


SIZES = (2, 3, 4, 8)  # the world sizes failure, output and data tests run at


@pytest.fixture(scope="module", params=SIZES, ids=[f"{n}ranks" for n in SIZES])
def pool_of_size(request):
    """A pool of each size in SIZES, shared by the module's tests (healthy: check it)."""
    with Pool(request.param) as pool:
        yield pool


@pytest.fixture
def pool(shared_pool):
    """The session's 2-rank pool, healthy at the start of each test."""
    return healthy(shared_pool)


@pytest.fixture
def run(shell, capsys):
    """Run a cell in the module's ``shell``; return (result, everything it printed)."""

    def _run(cell: str):
        capsys.readouterr()
        result = shell.run_cell(cell)
        captured = capsys.readouterr()
        return result, captured.out + captured.err

    return _run
