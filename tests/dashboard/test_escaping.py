"""Every text a rank sends is escaped wherever it becomes HTML: the rows, the live and frozen
logs, the charts and their alt text, the header; and a rank importing torch.distributed is
not taken for one waiting in a collective (its ``<module>`` frame once read as a tag)."""

from __future__ import annotations

import re
from array import array

import pytest

from nbddp.dashboard.view import Dashboard
from nbddp.wire import protocol as P
from nbddp.wire import stacks

NASTY = "<b>bold</b> <script>alert(1)</script> a & b"


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def packed(steps, values) -> tuple[bytes, bytes]:
    return array("q", steps).tobytes(), array("d", values).tobytes()


def assert_escaped(page: str) -> None:
    """No tag a rank wrote, and every ``&`` an entity."""
    assert "<b>bold" not in page, page
    assert "<script" not in page, page
    assert not re.search(r"&(?![a-zA-Z]+;|#\d+;|#x[0-9a-fA-F]+;)", page), page


@pytest.mark.parametrize("n", [2, 3, 8])
def test_a_ranks_text_is_escaped_in_every_field_live_and_frozen(n):
    clock = Clock()
    ranks = list(range(n))
    hosts = {r: NASTY for r in ranks}
    d = Dashboard(ranks, world_size=n, backend="gloo", devices="cpu", clock=clock, hosts=hosts)
    for rank in ranks:
        d.handle(P.RankState(rank, "running"))
        d.handle(P.Output(rank, "stdout", f"{NASTY} {rank}\n{NASTY} {rank / 4}\n{NASTY}\n"))
        d.handle(P.Output(rank, "stderr", f"{NASTY} err\npartial {NASTY}"))
        d.handle(P.RankProgress(rank, rank, 10, NASTY))
        d.handle(P.RankWhere(rank, NASTY, NASTY, 0.0))
        series = ((NASTY, NASTY, *packed([0, 1, 2], [1.0, 0.5 + rank, 0.25])),)
        d.handle(P.RankMetrics(rank, series))
        d.handle(P.RankResult(rank, NASTY))
    clock.t = 30.0
    d.handle(P.Tick())
    d._render(force=True)
    w = d.widget
    for page in (w.header, w.rows, w.charts, d.summary_html(all_ranks=True), d.charts_html()):
        assert_escaped(page)
    assert "waiting in &lt;b&gt;" in w.rows  # said, as text
    assert any("highest" in line[3] for line in w.lines)  # each rank's values, as data
    d.handle(P.RankState(0, "failed"))
    end = P.CellEnd(1, tuple(ranks), errors={0: P.ErrorInfo("E", NASTY, NASTY)}, notes=(NASTY,))
    d.close(end)
    frozen = d.frozen_bundle()["text/html"]
    assert_escaped(frozen)
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in frozen
    assert "nbddp-folded' title='b lowest 0.0 on rank 0" in frozen  # its values, each rank's


def test_a_rank_importing_torch_distributed_is_not_waiting_in_a_collective():
    importing = (
        ("<ddp-cell-3>", 1, "<module>", "import torch.distributed"),
        ("<frozen importlib._bootstrap>", 1, "_find_and_load", ""),
        ("/x/torch/distributed/fsdp/__init__.py", 3, "<module>", "from ._fsdp import *"),
    )
    assert stacks.collective(importing) is None
    waiting = (
        ("<ddp-cell-3>", 2, "<module>", "dist.all_reduce(t)"),
        ("/x/torch/distributed/c10d_logger.py", 81, "wrapper", "return func(*a)"),
        ("/x/torch/distributed/distributed_c10d.py", 2501, "all_reduce", "work.wait()"),
    )
    assert stacks.collective(waiting) == "all_reduce"
