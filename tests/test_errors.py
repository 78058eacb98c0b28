from __future__ import annotations

from nbddp.errors import CellFailed, CellInterrupted, RankDied, RankFailed, describe_exit


def test_exit_descriptions_name_signals():
    assert describe_exit(7) == "exit code 7"
    assert describe_exit(-9) == "killed by SIGKILL"
    assert describe_exit(-11) == "killed by SIGSEGV"
    assert describe_exit(None) == "connection lost"


def test_cell_failed_names_every_rank_first_failure_first():
    tb = 'Traceback (most recent call last):\n  File "<ddp-cell-1>", line 2\nZeroDivisionError: x\n'
    err = CellFailed([RankFailed(1, "ZeroDivisionError", "division by zero", tb), RankDied(0, -9)])
    assert str(err).splitlines() == [
        "rank 1: ZeroDivisionError: division by zero",
        "rank 0 died (killed by SIGKILL)",
    ]
    rendered = err._render_traceback_()
    assert rendered[0] == "--- rank 1 ---"
    assert '  File "<ddp-cell-1>", line 2' in rendered
    assert "CellFailed: rank 1: ZeroDivisionError: division by zero" in rendered


def test_interrupted_cells_say_why():
    assert str(CellInterrupted("timeout", notes=["n"])) == "cell timed out\nn"
    assert str(CellInterrupted("interrupt")) == "cell interrupted"


def test_ranks_on_several_hosts_are_named_with_their_host():
    from nbddp import protocol as P
    from nbddp.pool import raise_for_end

    end = P.CellEnd(
        1, (0, 1), errors={1: P.ErrorInfo("ValueError", "x", "tb")}, exits={0: P.RankExit(0, None)}
    )
    try:
        raise_for_end(end, {0: "node-a", 1: "node-b"})
    except CellFailed as err:
        assert str(err).splitlines() == [
            "rank 1 (node-b): ValueError: x",
            "rank 0 (node-a) died (connection lost)",
        ]
