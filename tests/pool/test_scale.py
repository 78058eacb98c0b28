"""Hundreds of ranks through the notebook side, with simulated ranks (tests/simranks.py):
the same listener, handshake, fan-out, gather, streams and sinks as torchrun ranks."""

from __future__ import annotations

import io
import os
import resource
import secrets

import pytest

import simranks
from nbddp.dashboard.view import Dashboard, TextSink
from nbddp.pool.facade import Pool
from nbddp.wire import protocol as P


@pytest.fixture
def attach():
    started = []

    def _attach(n: int, procs: int = 2, streams_first: bool = False) -> Pool:
        token = secrets.token_bytes(16)
        pool = Pool(n, listen=("127.0.0.1", 0), token=token, start_timeout=60)
        sims = simranks.start(pool.listen(), token, n, procs, streams_first=streams_first)
        started.append((pool, sims))
        return pool.start()

    yield _attach
    for pool, sims in started:
        pool.stop()
        for sim in sims:
            sim.wait(30)


def cell(pool: Pool, code: str, sink) -> P.CellEnd:
    end = None
    for event in pool.run(code):
        if isinstance(event, P.CellEnd):
            end = event
        else:
            sink.handle(event)
    sink.close(end)
    return end


@pytest.mark.timeout(120)
@pytest.mark.skipif(
    resource.getrlimit(resource.RLIMIT_NOFILE)[0] < 2048, reason="needs 2048 descriptors"
)
def test_ranks_attach_to_a_notebook_holding_over_a_thousand_descriptors(attach):
    """Connections numbered past 1024 (select() cannot wait on them; poll can): a long
    session, or hundreds of ranks with three connections each, gets there."""
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        pool = attach(16)
        end = cell(pool, "print('past 1024')", TextSink(stdout=io.StringIO()))
        assert end.errors == {}
        assert end.exits == {}
    finally:
        for fd in held:
            os.close(fd)


@pytest.mark.timeout(120)
def test_256_ranks_attach_and_their_identical_lines_fold_into_one(attach):
    pool = attach(256)
    assert sorted(s.host for s in pool.status())[::8][:2] == ["sim0", "sim1"]
    out = io.StringIO()
    end = cell(
        pool,
        "print('epoch 1 loss 0.25')\nif rank == 100:\n    print('only rank 100')\n"
        "if rank == 200:\n    raise ValueError('rank 200 is unhappy')",
        TextSink(stdout=out),
    )
    assert list(end.errors) == [200]
    assert end.errors[200].exc_type == "ValueError"
    assert out.getvalue().splitlines() == [
        "[ranks 0-255] epoch 1 loss 0.25",
        "[rank 100] only rank 100",
    ]
    # the pool waits on each connection once: 3 per rank and the wake pipe
    assert len(pool.hub._selector.get_map()) == 3 * 256 + 1
    board = Dashboard(list(range(256)), world_size=256)
    end = cell(pool, "print('step', 'odd' if rank % 2 else 'even')", board)
    assert not end.errors
    assert sorted(g.label for g in board.log) == [
        "ranks 0,2,4,6,8,10,12,14,16,18,20,22,24,26,28,30,32,34,36,38,40,42,44,46,48,50,"
        "52,54,56,58,60,62,64,66,68,70,72,74,76,78,80,82,84,86,88,90,92,94,96,98,100,102,"
        "104,106,108,110,112,114,116,118,120,122,124,126,128,130,132,134,136,138,140,142,"
        "144,146,148,150,152,154,156,158,160,162,164,166,168,170,172,174,176,178,180,182,"
        "184,186,188,190,192,194,196,198,200,202,204,206,208,210,212,214,216,218,220,222,"
        "224,226,228,230,232,234,236,238,240,242,244,246,248,250,252,254",
        "ranks 1,3,5,7,9,11,13,15,17,19,21,23,25,27,29,31,33,35,37,39,41,43,45,47,49,51,"
        "53,55,57,59,61,63,65,67,69,71,73,75,77,79,81,83,85,87,89,91,93,95,97,99,101,103,"
        "105,107,109,111,113,115,117,119,121,123,125,127,129,131,133,135,137,139,141,143,"
        "145,147,149,151,153,155,157,159,161,163,165,167,169,171,173,175,177,179,181,183,"
        "185,187,189,191,193,195,197,199,201,203,205,207,209,211,213,215,217,219,221,223,"
        "225,227,229,231,233,235,237,239,241,243,245,247,249,251,253,255",
    ]
    assert "256 done" in board.summary_html()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_streams_that_arrive_before_their_rank_are_kept(attach, n):
    pool = attach(n, procs=1, streams_first=True)
    out = io.StringIO()
    cell(pool, "print('hello from', rank)", TextSink(stdout=out, fold=False))
    assert sorted(out.getvalue().splitlines()) == [f"[rank {r}] hello from {r}" for r in range(n)]
