"""One cell alone (nbddp.pool.cell): scripted hub items in, events out, no worker processes.

The pool is a fake with what a Cell uses; its roster is a real Roster whose ranks
have streams but no connections, and its hub plays a script: each ``pump`` returns
the next list of items (or raises the next exception).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest

from nbddp.pool.cell import Cell, Requests
from nbddp.pool.hub import Closed, Dones, Gone, Mark, Msg, RelayLink, Text
from nbddp.pool.repair import PoolRepair
from nbddp.pool.roster import Roster
from nbddp.wire import payload
from nbddp.wire import protocol as P
from nbddp.wire.streams import Stream

CELL = 1
IN_REDUCE = (
    ("<ddp-cell-1>", 3, "<module>", "dist.all_reduce(t)"),
    ("/site/torch/distributed/distributed_c10d.py", 2900, "all_reduce", "work.wait()"),
)


class ScriptedHub:
    def __init__(self) -> None:
        self.script: list = []
        self.delivered: list = []
        self.pumps = 0

    def pump(self, timeout):
        assert self.script, "the cell waited for more than the script has"
        self.pumps += 1
        step = self.script.pop(0)
        if isinstance(step, BaseException):
            raise step
        return step

    def deliver(self, ranks, data, cell=0) -> None:
        self.delivered.append((list(ranks), P.loads(data), cell))


class FakeProcs:
    def __init__(self) -> None:
        self.killed: list = []

    def kill(self, pid) -> bool:
        self.killed.append(pid)
        return True


@dataclass
class FakeLogs:
    errors: list

    def error(self, rank, pid, info) -> None:
        self.errors.append((rank, pid, info))


class FakePool(PoolRepair):
    """What a Cell asks of its pool, recorded (the pool's real repair part carries out
    recovery's decisions on these fakes)."""

    def __init__(self, n: int = 2, relay: bool = False) -> None:
        self.roster = Roster(n, attached=False)
        self.hub = ScriptedHub()
        self.roster.hub = self.hub
        via = RelayLink(None, P.RelayHello("node-b", 1)) if relay else None
        for rank in range(n):
            self.roster.add(rank, 1000 + rank)
            r = self.roster[rank]
            r.state, r.link.relay = "idle", via
            r.link.streams = {s: Stream(None, s) for s in ("stdout", "stderr")}
        self.requests = Requests()
        self.abort_after, self.grace = 60.0, 120.0  # no deadline passes in a test
        self.state = "ready"
        self.logs = None
        self.notes: list[str] = []
        self.last_stacks: dict = {}
        self.mesh = self.groups = None
        self.world_size, self.backend, self.device, self.gpus = n, None, None, None
        self.on_death, self.attached = "restart", False  # (replacing: test_replace.py)
        self.shm_folder = None
        self.procs = FakeProcs()
        self.sent: list = []
        self.lose_calls = 0
        self.reforms: list = []

    def take_notes(self) -> list[str]:
        notes, self.notes = self.notes, []
        return notes

    def send(self, ranks, msg) -> None:
        self.sent.append((tuple(ranks), msg))

    @property
    def needs_restart(self) -> bool:
        return self.state == "lost"

    def lose(self) -> None:
        self.lose_calls += 1
        self.state = "lost"

    def drain(self, rank):
        yield P.Output(rank, "stderr", f"last words of {rank}\n")

    def exit_code(self, _r) -> int:
        return 7

    def reap(self, ranks, _deadline) -> None:
        for r in ranks:
            r.state, r.returncode = "dead", -15

    def handshake(self, timeout, _cancelled) -> None:  # (the ranks formed the group again)
        self.reforms.append(timeout)

    def interrupt(self) -> None:
        self.requests.ask(time.monotonic())

    def interrupt_stuck(self) -> bool:
        return False


def cell_on(pool: FakePool, script, ranks=None, tick=None, shipments=()) -> Cell:
    """A cell of ``ranks`` (all by default) whose hub will give ``script``."""
    targets = sorted(pool.roster.ranks) if ranks is None else ranks
    pool.hub.script = list(script)
    pool.requests.pending = CELL
    run = P.Run(CELL, "x")
    return Cell(pool, CELL, dict.fromkeys(targets, run), None, tick, list(shipments))


def run_cell(pool: FakePool, script, **kw) -> list:
    events = list(cell_on(pool, script, **kw))
    assert pool.hub.script == [], "the cell ended before the script did"
    return events


def marks(rank: int, cell: int = CELL) -> list:
    return [Mark(rank, "stdout", cell), Mark(rank, "stderr", cell)]


def ok(**kw) -> P.Done:
    return P.Done(CELL, "ok", **kw)


def flat(events) -> list:
    """The events with each RankStates said as a RankState per rank."""
    return [e for ev in events for e in (ev.each() if isinstance(ev, P.RankStates) else [ev])]


def end_of(events) -> P.CellEnd:
    assert isinstance(events[-1], P.CellEnd)
    assert sum(isinstance(e, P.CellEnd) for e in events) == 1
    return events[-1]


def error(msg="boom", collective="") -> P.ErrorInfo:
    return P.ErrorInfo("RuntimeError", msg, f"RuntimeError: {msg}\n", 1.0, collective)


# ---------------------------------------------------------------- ends


def test_a_rank_finishes_at_its_done_and_both_end_markers():
    pool = FakePool(2)
    cell = cell_on(
        pool,
        [
            [Text(0, "stdout", "hi\n"), Msg(0, ok()), Mark(0, "stdout", CELL)],
            [Mark(0, "stderr", CELL - 1)],  # an older cell's marker counts for nothing
            [Mark(0, "stderr", CELL)],
            [*marks(1), Msg(1, ok())],  # the markers may come first
        ],
    )
    seen = [(e, pool.hub.pumps) for event in cell for e in flat([event])]
    events = [e for e, _ in seen]
    assert events[:2] == [P.RankState(0, "running"), P.RankState(1, "running")]
    assert P.Output(0, "stdout", "hi\n") in events
    assert (P.RankState(0, "done"), 3) in seen  # after the third pump, not before
    assert (P.RankState(1, "done"), 4) in seen
    end = end_of(events)
    assert (end.cell, end.ranks, end.errors, end.interrupted) == (CELL, (0, 1), {}, None)
    assert [pool.roster[r].state for r in (0, 1)] == ["idle", "idle"]


def test_the_runs_are_delivered_one_message_per_kind_and_ranks_run():
    pool = FakePool(3)
    shown = P.Run(CELL, "x", display=True)
    hidden = P.Run(CELL, "x")
    pool.hub.script = [[Msg(r, ok()) for r in range(3)] + [*marks(0), *marks(1), *marks(2)]]
    pool.requests.pending = CELL
    cell = Cell(pool, CELL, {0: shown, 1: hidden, 2: hidden}, None, None, [])
    assert next(cell) == P.RankStates((0, 1, 2), "running")
    assert pool.hub.delivered == [([0], shown, CELL), ([1, 2], hidden, CELL)]
    assert [pool.roster[r].state for r in range(3)] == ["running"] * 3
    end_of(list(cell))


def test_the_backlog_and_notes_come_with_the_cell():
    pool = FakePool(1)
    pool.roster.backlog = [P.Output(0, "stdout", "between cells\n")]
    pool.notes = ["said once"]
    events = run_cell(pool, [[Msg(0, ok()), *marks(0)]])
    assert events[0] == P.Output(0, "stdout", "between cells\n")
    assert end_of(events).notes == ("said once",)
    assert pool.roster.backlog == []


def test_a_closed_stream_counts_as_its_end_marker():
    pool = FakePool(1)
    events = run_cell(pool, [[Msg(0, ok()), Mark(0, "stdout", CELL)], [Closed(0, "stderr")]])
    assert P.RankState(0, "done") in events
    end_of(events)


def test_a_stream_closed_before_the_cell_is_not_waited_for():
    pool = FakePool(1)
    pool.roster[0].link.streams["stdout"].eof = True  # os.close(1) in an earlier cell
    events = run_cell(pool, [[Msg(0, ok()), Mark(0, "stderr", CELL)]])
    assert P.RankState(0, "done") in events


def test_a_done_of_another_cell_is_not_this_cells():
    pool = FakePool(1)
    events = run_cell(
        pool,
        [[Msg(0, P.Done(CELL + 5, "error", error=error())), *marks(0)], [Msg(0, ok())]],
    )
    assert P.RankState(0, "done") in flat(events)
    assert end_of(events).errors == {}


def test_a_done_says_the_ranks_names():
    pool = FakePool(2)
    pool.roster[1].names = frozenset({"kept"})
    run_cell(pool, [[Msg(0, ok(names=("model", "x"))), *marks(0), Msg(1, ok()), *marks(1)]])
    assert pool.roster[0].names == {"model", "x"}
    assert pool.roster[1].names == {"kept"}  # no names: unchanged


def test_dones_of_a_relayed_group_end_it_in_one_step():
    pool = FakePool(4, relay=True)
    events = run_cell(pool, [[Dones((0, 1, 2), ok())], [Dones((3,), ok())]])
    assert P.RankStates((0, 1, 2), "done") in events
    assert P.RankStates((3,), "done") in events
    assert end_of(events).errors == {}


def test_relayed_dones_with_values_and_errors_finish_each_rank():
    pool = FakePool(4, relay=True)
    value = payload.dumps(41).data
    events = run_cell(
        pool,
        [
            [Dones((0, 1), ok(value=value, value_repr="41"))],
            [Dones((2, 3), P.Done(CELL, "error", error=error()))],
        ],
    )
    assert [P.RankResult(0, "41"), P.RankState(0, "done")] == events[1:3]
    assert P.RankState(2, "failed") in events
    assert P.RankState(3, "failed") in events
    end = end_of(events)
    assert end.values == {0: 41, 1: 41}
    assert end.errors == {2: error(), 3: error()}


def test_an_error_done_fails_the_rank_and_is_logged():
    pool = FakePool(2)
    pool.logs = FakeLogs([])
    events = run_cell(
        pool,
        [[Msg(0, P.Done(CELL, "error", error=error())), *marks(0), Msg(1, ok()), *marks(1)]],
    )
    assert P.RankState(0, "failed") in events
    assert P.RankState(1, "done") in events
    assert end_of(events).errors == {0: error()}
    assert pool.logs.errors == [(0, 1000, error())]


def test_a_rank_a_peers_failure_broke_shows_as_freed():
    pool = FakePool(2)
    own, broken = error("own"), error("peer gone", collective="all_reduce")
    events = run_cell(
        pool,
        [
            [Msg(0, P.Done(CELL, "error", error=own)), *marks(0)],
            [Msg(1, P.Done(CELL, "error", error=broken)), *marks(1)],
        ],
    )
    end = end_of(events)
    assert events.index(P.RankState(1, "failed")) < events.index(P.RankState(1, "freed"))
    assert events[-2] == P.RankState(1, "freed")
    assert P.RankState(0, "freed") not in events
    assert end.errors == {0: own, 1: broken}
    assert pool.sent == [((1,), P.StackQuery())]  # after rank 0 failed: where is rank 1?


def _refuse_to_load():
    raise ValueError("only the ranks can import this")


class OnlyOnTheRanks:
    def __reduce__(self):
        return (_refuse_to_load, ())


def test_a_value_the_notebook_cannot_load_is_that_ranks_error(tmp_path):
    pool = FakePool(2)
    pool.shm_folder = str(tmp_path)  # the pool's own folder: a value's files are there
    shm = tmp_path / "storage-0"
    shm.write_bytes(b"a tensor's bytes")
    bad = ok(value=payload.dumps(OnlyOnTheRanks()).data, value_repr="<obj>", files=(str(shm),))
    good = ok(value=payload.dumps([1, 2]).data, value_repr="[1, 2]")
    events = run_cell(pool, [[Msg(0, bad), *marks(0), Msg(1, good), *marks(1)]])
    assert P.RankState(0, "failed") in events
    assert P.RankResult(1, "[1, 2]") in events
    assert P.RankState(1, "done") in events
    end = end_of(events)
    assert end.values == {1: [1, 2]}
    assert list(end.errors) == [0]
    assert end.errors[0].exc_type == "ValueError"
    assert "could not be loaded in the notebook: only the ranks can import" in end.errors[0].message
    assert not shm.exists()  # its files are removed all the same


# ---------------------------------------------------------------- messages


def test_messages_become_rank_events():
    pool = FakePool(2)
    events = run_cell(
        pool,
        [
            [
                Msg(0, P.Display({"text/plain": "fig"}, {"m": 1})),
                Msg(1, P.Progress(3, 10, "steps")),
                Msg(0, P.DebugPrompt("> cell(2)\n", "(Pdb rank 0) ", 4)),
                Msg(1, P.Stacks(IN_REDUCE, CELL)),
                Msg(1, P.Stacks(IN_REDUCE, CELL)),  # the same place: said once
                Msg(0, P.StatusReply(1, "cpu")),  # not a cell's: nothing
            ],
            [Msg(0, ok()), *marks(0), Msg(1, ok()), *marks(1)],
        ],
    )
    middle = [e for e in events if not isinstance(e, (P.RankState, P.RankStates, P.CellEnd))]
    assert middle[:3] == [
        P.RankDisplay(0, {"text/plain": "fig"}, {"m": 1}),
        P.RankProgress(1, 3, 10, "steps"),
        P.RankDebug(0, "> cell(2)\n", "(Pdb rank 0) ", 4),
    ]
    (where,) = middle[3:]
    assert isinstance(where, P.RankWhere)
    assert (where.rank, where.waiting) == (1, "all_reduce")
    assert where.where == "all_reduce, cell line 3: dist.all_reduce(t)"


def test_a_store_port_in_a_cell_passes_it_on():
    pool = FakePool(1)
    run_cell(pool, [[Msg(0, P.StorePort(29600))], [Msg(0, ok()), *marks(0)]])
    assert pool.roster.store_port == 29600


# ---------------------------------------------------------------- interrupts


def test_an_interrupt_request_sends_stack_query_then_interrupt_once():
    pool = FakePool(2)
    cell = cell_on(
        pool,
        [
            [Msg(0, P.Stacks(IN_REDUCE, CELL))],
            [Msg(r, P.Done(CELL, "interrupted")) for r in (0, 1)] + [*marks(0), *marks(1)],
        ],
    )
    assert pool.requests.ask(time.monotonic())  # before the cell's first step
    events = list(cell)
    assert pool.sent == [((0, 1), P.StackQuery()), ((0, 1), P.Interrupt(CELL))]
    end = end_of(events)
    assert end.interrupted == "interrupt"
    assert end.stacks == {0: IN_REDUCE}
    assert pool.last_stacks == {0: IN_REDUCE}
    assert P.RankState(0, "interrupted") in events
    assert pool.requests.request is None  # answered
    assert pool.requests.active is None


def test_ctrl_c_while_waiting_is_an_interrupt_request():
    pool = FakePool(1)
    events = run_cell(
        pool,
        [KeyboardInterrupt(), [Msg(0, P.Done(CELL, "interrupted")), *marks(0)]],
    )
    assert pool.sent == [((0,), P.StackQuery()), ((0,), P.Interrupt(CELL))]
    assert end_of(events).interrupted == "interrupt"


def test_a_cell_given_up_by_its_consumer_leaves_nothing_running():
    pool = FakePool(2)
    cell = cell_on(pool, [[]])
    assert next(cell) == P.RankStates((0, 1), "running")
    cell.close()
    assert pool.lose_calls == 1
    assert pool.requests.active is None


def test_a_tick_after_a_quiet_wait():
    pool = FakePool(1)
    events = run_cell(pool, [[], [Msg(0, ok()), *marks(0)]], tick=0)
    assert events.count(P.Tick()) == 1


# ---------------------------------------------------------------- deaths


def test_a_gone_rank_is_dead_and_on_death_restart_stops_the_others():
    pool = FakePool(2)
    events = run_cell(pool, [[Text(1, "stdout", "x"), Gone(1)]])
    assert P.Output(1, "stderr", "last words of 1\n") in events  # drained first
    exit_1 = next(e for e in events if isinstance(e, P.RankExit))
    assert (exit_1.rank, exit_1.returncode, exit_1.stopped_by_pool) == (1, 7, False)
    assert P.RankState(1, "dead") in events
    assert P.RankState(0, "dead") in events
    assert pool.procs.killed == [1000]  # the live one
    assert pool.needs_restart
    end = end_of(events)
    assert end.exits[1] == exit_1
    assert (end.exits[0].returncode, end.exits[0].stopped_by_pool) == (-15, True)
    assert any("lost a member" in n for n in end.notes)


def test_a_gone_rank_already_dead_is_not_reported_again():
    pool = FakePool(2)
    pool.roster[1].state = "dead"
    events = run_cell(pool, [[Gone(1)], [Msg(0, ok()), *marks(0)]], ranks=[0])
    assert not any(isinstance(e, P.RankExit) for e in events)
    assert not pool.needs_restart


def test_a_cell_that_destroyed_the_group_re_forms_it_quietly():
    pool = FakePool(1)
    events = run_cell(pool, [[Msg(0, ok(needs_group=True)), *marks(0)]])
    assert len(pool.reforms) == 1
    assert end_of(events).notes == ()


# ---------------------------------------------------------------- requests


def test_no_cell_no_interrupt():
    req = Requests()
    assert not req.ask(1.0)
    assert req.request is None


def test_a_request_is_for_the_cell_that_runs_and_keeps_its_first_time():
    req = Requests(pending=3)
    assert req.ask(10.0)
    assert req.ask(11.0)
    assert req.request == (3, 10.0)
    assert req.for_cell(3) == (3, 10.0)
    assert req.for_cell(4) is None
    req.active, req.pending = 3, 4  # the next cell was made while 3 runs
    assert req.for_cell(3) == (3, 10.0)


def test_a_request_during_a_re_form_cancels_the_wait():
    req = Requests(pending=3, reforming=True)
    assert req.ask(5.0)
    assert req.cancel_wait
    assert req.request is None  # not an interrupt of a cell


def test_a_cells_end_clears_its_request_only():
    req = Requests(pending=3)
    req.ask(1.0)
    req.active = 3
    req.ended(3)
    assert (req.request, req.active, req.pending) == (None, None, None)
    req.pending = 4
    req.ask(2.0)
    req.active = 3
    req.ended(3)  # cell 3 ends; the request is cell 4's
    assert req.request == (4, 2.0)
    assert req.pending == 4
    assert req.active is None


@pytest.mark.parametrize("status", ["ok", "error", "interrupted"])
def test_every_status_ends_the_cell(status):
    pool = FakePool(1)
    done = P.Done(CELL, status, error=error() if status == "error" else None)
    events = run_cell(pool, [[Msg(0, done), *marks(0)]])
    want = {"ok": "done", "error": "failed", "interrupted": "interrupted"}[status]
    assert P.RankState(0, want) in events
