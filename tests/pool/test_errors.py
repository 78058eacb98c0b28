from __future__ import annotations

import pytest

from nbddp.pool.errors import (
    CellFailed,
    CellInterrupted,
    RankDied,
    RankFailed,
    describe_exit,
    root_causes,
    transport_error,
)
from nbddp.pool.facade import raise_for_end
from nbddp.wire import protocol as P
from nbddp.wire.stacks import rank_set

GLOO = "[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:4242"


def test_exit_descriptions_name_signals():
    assert describe_exit(7) == "exit code 7"
    assert describe_exit(-9) == "killed by SIGKILL"
    assert describe_exit(-11) == "killed by SIGSEGV"
    assert describe_exit(None) == "connection lost"


def test_cell_failed_names_every_rank_first_failure_first():
    tb = 'Traceback (most recent call last):\n  File "<ddp-cell-1>", line 2\nZeroDivisionError: x\n'
    err = CellFailed(
        [
            RankFailed(1, "ZeroDivisionError", "division by zero", tb, when=1.0),
            RankFailed(0, "KeyError", "'k'", "tb", when=2.0),
        ]
    )
    assert str(err).splitlines() == [
        "rank 1: ZeroDivisionError: division by zero",
        "rank 0: KeyError: 'k'",
    ]
    rendered = err._render_traceback_()
    assert rendered[0] == "--- rank 1 ---"
    assert '  File "<ddp-cell-1>", line 2' in rendered
    assert "CellFailed: rank 1: ZeroDivisionError: division by zero" in rendered


GLOO_RESET = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
    "[127.0.0.1]:5253: Connection reset by peer. This is typically caused by a remote worker "
    "hanging or bugs in the application."
)
GLOO_CLOSED = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed "
    "by peer [127.0.0.1]:53651. This is typically caused by a remote worker crashing."
)


def test_a_death_comes_first_and_its_peers_transport_errors_are_its_consequences():
    """The survivors' sockets break as the process ends, before the notebook sees the end:
    their errors (out of a DDP backward: no collective on the stack) are stamped earlier,
    and are still the death's consequences (issue 45, item 5)."""
    reset0 = RankFailed(0, "RuntimeError", GLOO_RESET, "tb", when=1.000)
    reset2 = RankFailed(2, "RuntimeError", GLOO_RESET, "tb", when=1.001)
    closed3 = RankFailed(3, "RuntimeError", GLOO_CLOSED, "tb", when=1.002)
    death = RankDied(1, -9, when=1.003)
    for order in ([reset0, reset2, death, closed3], [death, closed3, reset2, reset0]):
        err = CellFailed(order)
        assert err.failures == [death]
        assert err.consequences == [reset0, reset2, closed3]
        assert str(err).splitlines() == [
            "rank 1 died (killed by SIGKILL)",
            "ranks 0, 2, 3: freed from a collective after rank 1 died",
        ]
    # an error of the rank's own (not its transport) is a root cause too, after the death
    own = RankFailed(2, "ValueError", "mine", "tb", when=0.5)
    assert root_causes([own, reset0, death]) == ([death, own], [reset0])


def test_a_transport_error_without_a_death_is_a_root_cause():
    """No death to blame (a peer's host unreachable, a timeout): the error itself heads."""
    reset = RankFailed(0, "RuntimeError", GLOO_RESET, "tb", when=1.0)
    assert transport_error(reset)
    assert root_causes([reset]) == ([reset], [])
    assert not transport_error(RankFailed(0, "ValueError", "bad read error", "tb"))
    assert not transport_error(RankDied(1, -9))
    nccl = RankFailed(0, "DistBackendError", "NCCL error: remote process exited", "tb")
    assert transport_error(nccl)


def test_interrupted_cells_say_why():
    timeout = "cell timed out (the ranks got a KeyboardInterrupt)"
    assert str(CellInterrupted("timeout", notes=["n"])) == f"{timeout}\nn"
    assert str(CellInterrupted("interrupt")) == "cell interrupted (KeyboardInterrupt)"


def test_ranks_on_several_hosts_are_named_with_their_host():
    end = P.CellEnd(
        1, (0, 1), errors={1: P.ErrorInfo("ValueError", "x", "tb")}, exits={0: P.RankExit(0, None)}
    )
    with pytest.raises(CellFailed) as err:
        raise_for_end(end, {0: "node-a", 1: "node-b"})
    assert str(err.value).splitlines() == [  # (a death first)
        "rank 0 (node-a) died (connection lost)",
        "rank 1 (node-b): ValueError: x",
    ]


def test_the_root_cause_is_first_whatever_order_the_reports_arrived_in():
    """rank 2 is killed; ranks 1 and 3 get gloo errors that reach the notebook first."""
    end = P.CellEnd(
        1,
        (0, 1, 2, 3),
        errors={
            1: P.ErrorInfo("RuntimeError", GLOO, "tb", when=10.2, collective="all_reduce"),
            3: P.ErrorInfo("RuntimeError", GLOO, "tb", when=10.1, collective="all_reduce"),
        },
        exits={2: P.RankExit(2, -9, when=10.5), 0: P.RankExit(0, -9, True, 10.6)},
        kept=False,  # the pool stopped rank 0 (on_death="restart"): no "state kept"
    )
    with pytest.raises(CellFailed) as err:
        raise_for_end(end)
    assert str(err.value).splitlines() == [
        "rank 2 died (killed by SIGKILL)",
        "ranks 1, 3: freed from a collective (all_reduce) after rank 2 died",
    ]
    assert "pair.cc" not in "\n".join(err.value._render_traceback_())


def test_root_causes_are_ordered_by_when_they_happened_in_their_rank():
    late = RankFailed(0, "ValueError", "late", "tb", when=5.0)
    early = RankFailed(3, "KeyError", "early", "tb", when=4.0)
    freed = RankFailed(1, "RuntimeError", "aborted", "tb", when=4.5)  # its group was aborted
    roots, rest = root_causes([late, freed, early], freed=(1,))
    assert roots == [early, late]
    assert rest == [freed]


def test_collective_errors_alone_are_all_root_causes():
    """A process-group timeout or a mismatch: nothing else to blame."""
    a = RankFailed(0, "RuntimeError", "Timed out", "tb", when=2.0, collective="barrier")
    b = RankFailed(1, "RuntimeError", "Timed out", "tb", when=1.0, collective="barrier")
    assert root_causes([a, b]) == ([b, a], [])
    assert str(CellFailed([a, b])).splitlines() == ["ranks 0, 1: RuntimeError: Timed out"]


def test_an_interrupted_cell_says_where_each_rank_was_grouped():
    cell = "<ddp-cell-4>"
    reduce = (
        (cell, 5, "<module>", "dist.all_reduce(t)"),
        ("/x/torch/distributed/c10d_logger.py", 81, "wrapper", ""),
        ("/x/torch/distributed/distributed_c10d.py", 3000, "all_reduce", "work.wait()"),
    )
    sleep = ((cell, 7, "<module>", "time.sleep(100)"),)
    err = CellInterrupted("interrupt", stacks={0: reduce, 1: reduce, 2: reduce, 3: sleep})
    assert str(err).splitlines() == [
        "cell interrupted (KeyboardInterrupt)",
        "where the ranks were:",
        "ranks 0-2: all_reduce, cell line 5: dist.all_reduce(t)",
        "rank 3: cell line 7: time.sleep(100)",
    ]
    rendered = err._render_traceback_()
    assert "    cell, line 5, in <module>" in rendered
    assert "      work.wait()" in rendered


def test_rank_sets_read_as_ranges_from_three_on():
    assert rank_set([3]) == "rank 3"
    assert rank_set([0, 1, 3]) == "ranks 0, 1, 3"
    assert rank_set([0, 1, 2, 3, 4, 5, 7]) == "ranks 0-5, 7"


def _tb(line: int, exc: str) -> str:
    frame = f'  File "<ddp-cell-4>", line {line}, in <module>'
    return f"Traceback (most recent call last):\n{frame}\n{exc}\n"


@pytest.mark.parametrize("n", [2, 4, 8])
def test_one_error_on_several_ranks_shows_once_with_its_rank_set(n):
    same = [
        RankFailed(r, "NameError", "name 'x' is not defined", _tb(3, "NameError"), when=1.0 + r)
        for r in range(n)
    ]
    err = CellFailed(same)
    rendered = err._render_traceback_()
    assert rendered.count('  File "<ddp-cell-4>", line 3, in <module>') == 1
    assert rendered[0] == f"--- {rank_set(list(range(n)))} ---"
    assert str(err) == f"{rank_set(list(range(n)))}: NameError: name 'x' is not defined"


def test_different_errors_stay_apart_the_root_cause_first():
    first = RankFailed(2, "ValueError", "bad", _tb(5, "ValueError"), when=1.0)
    later = [RankFailed(r, "KeyError", "'k'", _tb(3, "KeyError"), when=2.0) for r in (0, 1, 3)]
    other_line = RankFailed(4, "KeyError", "'k'", _tb(7, "KeyError"), when=3.0)
    err = CellFailed([*later, other_line, first])
    assert str(err).splitlines() == [
        "rank 2: ValueError: bad",
        "ranks 0, 1, 3: KeyError: 'k'",
        "rank 4: KeyError: 'k'",
    ]
    heads = [line for line in err._render_traceback_() if line.startswith("---")]
    assert heads == ["--- rank 2 ---", "--- ranks 0, 1, 3 ---", "--- rank 4 ---"]
    died = CellFailed([RankDied(1, -9, when=1.0), RankDied(3, -9, when=1.1)])
    assert str(died) == "ranks 1, 3 died (killed by SIGKILL)"


def test_the_note_on_a_reformed_group_names_the_collective_the_failure_message_names():
    """rank 2 failed; ranks 0, 1, 3 were freed from all_reduce before a stack of theirs was
    seen: the note says all_reduce too (it said 'maybe in a collective')."""
    from types import SimpleNamespace

    from nbddp.pool.recovery import collectives_of

    sup = SimpleNamespace(aborted_running=[0, 1, 3], waiting_in=lambda rank: None)
    freed = P.ErrorInfo("RuntimeError", GLOO, "tb", collective="all_reduce")
    errors = {0: freed, 1: freed, 3: freed, 2: P.ErrorInfo("ValueError", "x", "tb")}
    out = SimpleNamespace(errors=errors)
    assert collectives_of(sup, out) == ["all_reduce"]
    sup.waiting_in = lambda rank: "barrier" if rank == 0 else None
    assert collectives_of(sup, out) == ["all_reduce", "barrier"]
