"""The fault matrix: every way a rank can fail, at world sizes 2, 3, 4 and 8 (gloo).

The failing rank is N-2 (rank 0 of 2), so it is neither the store's rank 0 nor
the last one, and at 3 ranks or more it has peers on both sides of the ring.
Each case asserts that the cell ends (pytest-timeout is the only clock here;
figures are in benchmarks/bench_failures.py), that the message names the root
cause first, which ranks kept their state, and that the next cell, a
collective, works.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from dataclasses import dataclass

import psutil
import pytest

from helpers import collect, wait_gone
from nbddp import Pool
from nbddp.pool.errors import CellFailed, CellInterrupted
from nbddp.pool.facade import raise_for_end
from nbddp.pool.rebinding import words
from nbddp.wire import protocol as P
from nbddp.wire.stacks import rank_set
from tiers import sizes

SIZES = [2, 3, 4, 8]
HAD = r"rank {}: a new process took its place; it had (.*) \(gone\) and had imported (.*)"
HEAD = "import torch.distributed as dist\nt = torch.ones(1)\n"
READY = "print('ready', flush=True)\n"  # the next line is where the rank blocks


@dataclass
class Case:
    name: str
    code: str  # BAD is the failing rank
    first: str  # regex: the error's first line (the root cause)
    kept: bool  # every rank's state survives (for a death: every other rank's)
    interrupt: str = ""  # "all" / "bad": interrupted once those ranks printed "ready"
    timeout: float | None = None
    want_values: bool = False
    freed: bool = False  # the others are named as freed from a collective, in one line
    where: tuple[str, ...] = ()  # regexes the "where the ranks were" lines must match
    output: tuple[str, str] | None = None  # (stream, text) the failing rank printed
    died: bool = False  # the failing rank's process ends: a new one takes its place
    # the failing rank, stuck in C past the grace period, is stopped alone: a new process
    # takes its place as for a death, the others keep theirs
    restarted: bool = False


CASES = [
    Case(
        "raise before a collective",
        HEAD + "if rank == BAD:\n    raise ValueError('before')\ndist.all_reduce(t)",
        r"rank BAD: ValueError: before",
        True,
        freed=True,
    ),
    Case(
        "raise between collectives",
        HEAD + "dist.all_reduce(t)\nif rank == BAD:\n    raise ValueError('between')\n"
        "dist.all_reduce(t)",
        r"rank BAD: ValueError: between",
        True,
        freed=True,
    ),
    Case(
        "raise inside a collective loop",
        HEAD + "for step in range(1000):\n    if rank == BAD and step == 50:\n"
        "        raise ValueError(f'step {step}')\n    dist.all_reduce(t)",
        r"rank BAD: ValueError: step 50",
        True,
        freed=True,
    ),
    Case(
        "raise before a collective on a subgroup made in the cell",
        HEAD + "g = dist.new_group(list(range(world_size)))\nif rank == BAD:\n"
        "    raise ValueError('subgroup')\ndist.all_reduce(t, group=g)",
        r"rank BAD: ValueError: subgroup",
        True,
        freed=True,
    ),
    Case(
        "raise after the collectives",
        HEAD + "dist.all_reduce(t)\nif rank == BAD:\n    raise ValueError('after')",
        r"rank BAD: ValueError: after",
        True,
    ),
    Case(
        "sys.exit",
        HEAD + "import sys\nif rank == BAD:\n    sys.exit(3)\ndist.all_reduce(t)",
        r"rank BAD: SystemExit: 3",
        True,
        freed=True,
    ),
    Case("exit()", "if rank == BAD:\n    exit(4)", r"rank BAD: SystemExit: 4", True),
    Case(
        "raise SystemExit", "if rank == BAD:\n    raise SystemExit", r"rank BAD: SystemExit$", True
    ),
    Case(
        "os._exit",
        HEAD + "import os\nif rank == BAD:\n    print('bye', flush=True)\n    os._exit(7)\n"
        "dist.all_reduce(t)",
        r"rank BAD died \(exit code 7\)",
        True,
        freed=True,
        output=("stdout", "bye\n"),
        died=True,
    ),
    Case(
        "SIGKILL before a collective",
        HEAD + "import os, signal\nif rank == BAD:\n    os.kill(os.getpid(), signal.SIGKILL)\n"
        "dist.all_reduce(t)",
        r"rank BAD died \(killed by SIGKILL\)",
        True,
        freed=True,
        died=True,
    ),
    Case(
        "SIGSEGV",
        HEAD + "import ctypes\nif rank == BAD:\n    ctypes.string_at(0)\ndist.all_reduce(t)",
        r"rank BAD died \(killed by SIGSEGV\)",
        True,
        freed=True,
        output=("stderr", "Fatal Python error: Segmentation fault"),
        died=True,
    ),
    Case(
        "unpicklable value",
        "import threading\nthreading.Lock() if rank == BAD else rank",
        r"rank BAD: PicklingError: the cell's value \(lock\) cannot be pickled: .*",
        True,
        want_values=True,
    ),
    Case(
        "infinite loop + interrupt",
        READY + "while True:\n    pass",
        r"cell interrupted \(KeyboardInterrupt\)",
        True,
        interrupt="all",
        where=(r"ranks? [\d, -]+: cell line [23]: (while True:|pass)",),
    ),
    Case(
        "sleep + interrupt while the others wait in a collective",
        HEAD + "import time\n" + READY + "if rank == BAD:\n    time.sleep(60)\ndist.all_reduce(t)",
        r"cell interrupted \(KeyboardInterrupt\)",
        True,
        interrupt="all",
        where=(r"rank BAD: cell line 6: time.sleep\(60\)", r"all_reduce, cell line 7"),
    ),
    Case(
        "mismatched collectives + interrupt",
        HEAD + READY + "if rank == BAD:\n    dist.barrier()\nelse:\n    dist.all_reduce(t)",
        r"cell interrupted \(KeyboardInterrupt\)",
        True,
        interrupt="all",
        where=(r"rank BAD: barrier, cell line 5", r"all_reduce, cell line 7"),
    ),
    Case(
        "stuck in C ignoring SIGINT + interrupt",
        "import signal, time\nif rank == BAD:\n    signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        "    " + READY + "    time.sleep(60)",
        r"cell interrupted \(KeyboardInterrupt\)",
        True,
        interrupt="bad",
        where=(r"rank BAD: cell line 5: time.sleep\(60\)",),
        restarted=True,
    ),
    Case(
        "--timeout",
        HEAD + "import time\nif rank == BAD:\n    time.sleep(60)\ndist.all_reduce(t)",
        r"cell timed out \(the ranks got a KeyboardInterrupt\)",
        True,
        timeout=1.0,
        where=(r"rank BAD: cell line 5: time.sleep\(60\)",),
    ),
]


@pytest.fixture(scope="module", params=sizes(*SIZES))
def sized_pool(request):
    with Pool(request.param, grace=1.0) as pool:
        yield pool


def interrupt_when_ready(pool: Pool, events, ranks: int, settle: float = 0.3):
    """Pass events on; interrupt once ``ranks`` ranks printed "ready" and ``settle`` s passed
    (they are then blocked on the next line). Ticks make the clock advance."""
    ready, at = 0, None
    for event in events:
        if isinstance(event, P.Output) and event.text.startswith("ready"):
            ready += 1
            if ready == ranks:
                at = time.monotonic() + settle
        if at is not None and time.monotonic() >= at:
            pool.interrupt()
            at = None
        yield event


@pytest.mark.timeout(90)
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_fault_matrix(sized_pool, case):
    pool, n = sized_pool, sized_pool.world_size
    if pool.needs_restart or not pool.started:
        pool.restart()
    pool.roster.deaths.clear()  # each case's death is its own (3 in a minute stop the pool)
    check_case(pool, case, n - 2 if n > 2 else 0)


def check_case(pool, case: Case, bad: int) -> None:
    """Run ``case`` with ``bad`` failing on ``pool`` (a local pool, or a detached one: see
    test_detached.py) and check everything the fault matrix promises."""
    n = pool.world_size
    pool.execute("import torch.distributed as dist\nkept = rank + 100")
    pids = list(pool.pids)
    code = case.code.replace("BAD", str(bad))
    events = pool.run(code, want_values=case.want_values, timeout=case.timeout, tick=0.05)
    if case.interrupt:
        events = interrupt_when_ready(pool, events, n if case.interrupt == "all" else 1)
    text, seen, end = collect(events)

    with pytest.raises(CellFailed) as failed:
        raise_for_end(end)
    message = str(failed.value)
    first = message.splitlines()[0]
    assert re.fullmatch(case.first.replace("BAD", str(bad)), first), message
    others = [r for r in range(n) if r != bad]
    freed_line = re.search(
        r"^ranks? ([\d, -]+): freed from a collective \((\w+)\) after (.*)$", message, re.M
    )
    if case.freed:
        assert freed_line, message
        how = "died" if case.died else "failed"
        assert freed_line.group(3) == f"rank {bad} {how}; state kept", message
        assert sorted(f.rank for f in failed.value.consequences) == others
        # in the dashboard, the root cause is red and the others are "freed"
        assert P.RankState(bad, "dead" if case.died else "failed") in seen
        assert all(P.RankState(r, "freed") in seen for r in others), seen
    else:
        assert freed_line is None, message
    if case.where:
        assert isinstance(failed.value, CellInterrupted)
        for pattern in case.where:
            assert re.search(pattern.replace("BAD", str(bad)), message), message
    if case.output:
        stream, expected = case.output
        assert expected in text.get((bad, stream), ""), text

    # which ranks kept their state, and the next cell (a collective) works
    nxt = pool.execute("(kept if 'kept' in globals() else None, rank)")
    if case.restarted:
        assert any(
            n.startswith(f"rank {bad} did not stop within ")
            and n.endswith(
                "stopped and given a new process (what it held is said below); every other rank "
                "kept its namespace"
            )
            for n in end.notes
        ), end.notes
    if case.died or case.restarted:  # every other rank kept its state; a new process took
        # the failed one's place (and re-ran the cell that made `kept`: no collective in it)
        assert nxt == [(100 + r, r) for r in range(n)]
        assert any(note.startswith(f"rank {bad} re-ran ") for note in end.notes), end.notes
        assert [p for r, p in enumerate(pool.pids) if r != bad] == [
            p for r, p in enumerate(pids) if r != bad
        ]
        assert pool.pids[bad] != pids[bad]
        assert P.RankState(bad, "replaced") in seen
        had = [m for n in end.notes if (m := re.fullmatch(HAD.format(bad), n))]
        assert had, end.notes
        assert "kept" in had[0].group(1).split(", "), end.notes  # (and earlier cases')
        assert "dist" in had[0].group(2).split(", "), end.notes
        assert not any("lost" in note for note in end.notes), end.notes
    elif case.kept:
        assert nxt == [(100 + r, r) for r in range(n)]
        assert pool.pids == pids  # the same processes
        assert not any("lost" in note for note in end.notes), end.notes
    else:
        assert nxt == [(None, r) for r in range(n)]
        assert any("state is lost" in note for note in end.notes), end.notes
    check = "import torch.distributed as dist\nt = torch.ones(1)\ndist.all_reduce(t)\nt.item()"
    assert pool.execute(check) == [float(n)] * n


@pytest.mark.timeout(90)
@pytest.mark.parametrize("n", SIZES)
def test_mismatched_collectives_fail_at_once_with_debug(n):
    """``%ddp start --debug``: torch's own collective checks, instead of a hang."""
    bad = n - 2 if n > 2 else 0
    with Pool(n, debug=True) as pool:
        pool.execute("import torch.distributed as dist\nkept = rank")
        code = HEAD + f"if rank == {bad}:\n    dist.barrier()\nelse:\n    dist.all_reduce(t)"
        _, _, end = collect(pool.run(code))
        assert not end.interrupted
        with pytest.raises(CellFailed) as failed:
            raise_for_end(end)
        assert "Detected mismatch between collectives on ranks" in str(failed.value)
        assert pool.execute("kept") == list(range(n))


def test_a_collective_failure_says_the_group_was_re_formed(pool):
    code = "import torch.distributed as dist\nif rank == 1:\n    raise ValueError('x')\n"
    code += "dist.barrier()"
    generation = pool.generation
    _, _, end = collect(pool.run(code))
    # the same ranks, namespaces kept: no re-shipping of captured objects or imports
    assert pool.generation == generation
    (note,) = end.notes
    assert "rank 1 had stopped while rank 0 still ran (waiting in barrier)" in note
    assert "re-formed" in note
    # then what the ranks hold that a re-form binds again or names (the session's pool
    # may keep an earlier test's objects: `sub`, a DDP over a subgroup a cell made)
    bound = words(pool.roster.ranks.values(), pool.world_size)
    assert note.endswith("kept its namespace" + (f"; {bound}" if bound else "")), note


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", sizes(3, 8))
def test_ranks_an_abort_cannot_free_are_restarted_after_grace_the_others_keep_their_state(n):
    """The last resort: a collective the abort does not reach (here, both ways of
    aborting are disabled in every rank but the one that fails) ends the cell ``grace`` s
    after the abort. Only the stuck ranks are stopped and given new processes (their own
    state lost, and said); the rank that failed keeps its state, and the next cell has
    a working group (DESIGN: ranks stuck in C past a grace period are restarted)."""
    bad = 1
    others = [r for r in range(n) if r != bad]
    with Pool(n, grace=1.0) as pool:
        pool.execute(
            "import torch.distributed as dist, nbddp.rank.group as G\n"
            "kept = rank + 100\n"
            f"if rank != {bad}:\n"
            "    G.shut_down_sockets = lambda sockets, keep: 0\n"
            "    G.GroupKeeper.abort = lambda self: None"
        )
        pids = pool.pids
        code = HEAD + f"if rank == {bad}:\n    raise ValueError('x')\ndist.all_reduce(t)"
        _, seen, end = collect(pool.run(code))  # without the last resort: a hang
        with pytest.raises(CellFailed) as failed:
            raise_for_end(end)
        assert str(failed.value).startswith(f"rank {bad}: ValueError: x"), str(failed.value)
        (note,) = [n for n in end.notes if "still ran" in n]
        stuck = rank_set(others)
        assert re.search(rf"{stuck} still ran \d+ s after the process group was abort", note)
        assert "stopped and given new processes (what each held is said below)" in note, note
        assert note.endswith("; every other rank kept its namespace"), note
        for r in others:  # where each was (it was not seen otherwise: issue 46)
            assert f"rank {r} last seen at all_reduce, cell line 5: dist.all_reduce(t)" in note
            assert f"rank {r}: a new process took its place; it had kept" in " ".join(end.notes)
            assert P.RankState(r, "replaced") in seen
        assert not any("out-of-memory killer" in note for note in end.notes), end.notes
        assert not pool.needs_restart
        assert pool.pids[bad] == pids[bad]
        assert all(pool.pids[r] != pids[r] for r in others)
        # the new processes re-ran the cell that made `kept` (rank 1 kept its own)
        assert f"{stuck} re-ran cell 1: dist, G, kept" in end.notes, end.notes
        assert pool.execute("kept") == [100 + r for r in range(n)]
        check = "import torch.distributed as dist\nt = torch.ones(1)\ndist.all_reduce(t)\nt.item()"
        assert pool.execute(check) == [float(n)] * n


def test_the_waiting_place_of_a_long_collective_is_sampled_for_the_dashboard(pool, tmp_path):
    """A rank blocked in a collective is reported as waiting in it (RankWhere events).

    Rank 1 holds the others in the barrier until the test has seen both places sampled
    (pytest-timeout bounds the wait; no sleep decides what is seen)."""
    go = tmp_path / "go"
    code = (
        "import torch.distributed as dist, os, time\n"
        "if rank == 1:\n"
        f"    while not os.path.exists({str(go)!r}):\n"
        "        time.sleep(0.01)\n"
        "dist.barrier()"
    )
    where, end = [], None
    for event in pool.run(code):
        if isinstance(event, P.RankWhere):
            where.append(event)
            waiting = any(e.rank == 0 and e.waiting == "barrier" for e in where)
            polling = any(
                e.rank == 1 and e.waiting is None and "time.sleep" in e.where for e in where
            )
            if waiting and polling:
                go.touch()
        elif isinstance(event, P.CellEnd):
            end = event
    assert not end.errors
    assert go.exists(), where


def test_stacks_between_cells_say_every_rank_is_idle(pool):
    assert pool.stacks() == {0: (), 1: ()}


def test_a_worker_whose_connection_drops_exits(pool):
    pool.execute("1")
    victim = pool.roster[1]
    pid = victim.pid
    victim.link.conn.close()
    assert wait_gone([pid], zombies=False) == []
    pool.restart()


def test_the_interrupt_reaches_only_ranks_running_the_cell(pool):
    pool.execute("import time")
    threading.Timer(0.5, pool.interrupt).start()
    _, seen, end = collect(pool.run("time.sleep(60)", ranks=[1]))
    assert end.interrupted == "interrupt"
    assert end.ranks == (1,)
    assert P.RankState(1, "interrupted") in seen
    assert pool.execute("rank") == [0, 1]


def test_soak_many_cells_leak_no_fds_threads_or_processes():
    """500 cells, some failing on a rank, a few leaving peers in a collective (4 ranks)."""
    me = psutil.Process()
    with Pool(4) as pool:
        pool.execute("import torch.distributed as dist")

        def snapshot():
            procs = [me, *(psutil.Process(p) for p in pool.pids)]
            return (
                [p.num_fds() for p in procs],
                [p.num_threads() for p in procs],
                len(me.children(recursive=True)),
            )

        def cells(n):
            for i in range(n):
                if i % 100 == 50:
                    code = "if rank == 2:\n    raise ValueError()\ndist.barrier()"
                elif i % 10 == 3:
                    code = "1 / (rank - 1)"
                else:
                    code = f"x = {i} + rank\nprint(x)"
                collect(pool.run(code))

        cells(60)  # warm up: lazy imports, first re-form
        pids = list(pool.pids)
        before = snapshot()
        cells(500)
        after = snapshot()
        assert pool.pids == pids  # no restart was needed
        fds0, threads0, children0 = before
        fds1, threads1, children1 = after
        assert all(b <= a + 2 for a, b in zip(fds0, fds1, strict=True)), (fds0, fds1)
        # none more (the notebook's authenticating threads end 2 s after their last
        # handshake, so there may be fewer)
        assert all(b <= a for a, b in zip(threads0, threads1, strict=True)), (before, after)
        assert children1 == children0, (before, after)
        assert os.getpid() == me.pid


def test_the_process_group_timeout_ends_a_collective_nobody_joins(monkeypatch):
    monkeypatch.setenv("NBDDP_DEADLOCKS", "0")  # (else the deadlock is found first)
    with Pool(2, pg_timeout=2) as pool:
        pool.execute("import torch.distributed as dist\nkept = rank")
        _, _, end = collect(pool.run("if rank == 0:\n    dist.barrier()"))
        assert list(end.errors) == [0]
        assert "Timed out" in end.errors[0].message
        assert pool.execute("kept") == [0, 1]


def test_a_sigkill_death_hints_at_the_oom_killer_unless_the_cell_sent_it(pool):
    """Killed from outside (the test, as the OOM killer would): the hint; the cell's own
    os.kill(..., 9): no hint, the cell named the sender itself."""

    def killed_from_outside(events):
        pid = pool.pids[0]
        for ev in events:
            if isinstance(ev, P.Output) and ev.rank == 0 and "ready" in ev.text:
                os.kill(pid, signal.SIGKILL)
            yield ev

    code = "import time\nprint('ready', flush=True)\nif rank == 0:\n    time.sleep(60)"
    _, _, end = collect(killed_from_outside(pool.run(code)))
    assert end.exits[0].returncode == -signal.SIGKILL
    assert any("out-of-memory killer" in note for note in end.notes)
    _, _, end = collect(pool.run("import os\nif rank == 0:\n    os.kill(os.getpid(), 9)"))
    assert end.exits[0].returncode == -signal.SIGKILL
    assert not any("out-of-memory killer" in note for note in end.notes), end.notes
