"""The pool through real worker processes (gloo on CPU)."""

from __future__ import annotations

import contextlib
import gc
import os
import socket
import stat
import subprocess
import sys
import threading

import psutil
import pytest

from helpers import collect, wait_gone
from nbddp import CellFailed, CellInterrupted, Pool, PoolStartError
from nbddp.pool.facade import raise_for_end
from nbddp.wire import protocol as P


def test_the_first_cell_right_after_start_runs():
    with Pool(2) as pool:
        assert pool.execute("rank") == [0, 1]


def test_ranks_form_one_process_group_with_torchrun_environment(pool):
    code = """
import os, torch.distributed as dist
t = torch.ones(3) * rank
dist.all_reduce(t)
env = {k: os.environ[k] for k in
       ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
(t.tolist(), dist.get_backend(), env, local_rank, world_size, str(device))
"""
    values = pool.execute(code)
    for rank, (t, backend, env, local_rank, world_size, device) in enumerate(values):
        assert t == [1.0, 1.0, 1.0]
        assert backend == "gloo"
        assert device == "cpu"
        assert (local_rank, world_size) == (rank, 2)
        assert env["RANK"] == env["LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "2"
        assert int(env["MASTER_PORT"]) > 0
    assert values[0][2]["MASTER_PORT"] == values[1][2]["MASTER_PORT"]


def test_the_heap_is_frozen_for_the_collector_only_while_a_cell_runs(pool):
    assert gc.get_freeze_count() == 0
    during = [gc.get_freeze_count() for _ in pool.run("print('x')")]
    assert min(during[:-1]) > 0
    assert during[-1] == gc.get_freeze_count() == 0
    events = list(pool.run("1 / (rank - 1)"))  # a failing cell unfreezes too
    assert events[-1].errors
    assert gc.get_freeze_count() == 0


def test_state_persists_across_cells(pool):
    pool.execute("counter = rank * 100")
    pool.execute("counter += 1")
    assert pool.execute("counter") == [1, 101]


def test_output_streams_live_per_rank_with_stdout_and_stderr_apart(pool):
    code = """
import sys, os, ctypes
print("py out", rank)
print("py err", rank, file=sys.stderr)
os.write(1, b"fd out\\n")
ctypes.CDLL(None).printf(b"c printf %d\\n", rank)   # C stdio, flushed at cell end
"""
    text, _, end = collect(pool.run(code))
    assert not end.errors
    for rank in (0, 1):
        out = text[rank, "stdout"]
        assert f"py out {rank}\n" in out
        assert "fd out\n" in out
        assert f"c printf {rank}\n" in out
        assert text[rank, "stderr"] == f"py err {rank}\n"


def test_output_arrives_while_the_rank_still_runs(pool, tmp_path):
    """The rank waits for a file that the test writes only once the output has arrived."""
    flag = tmp_path / "seen"
    code = (
        "import os, time\nprint('early', flush=True)\n"
        f"for _ in range(600):\n    if os.path.exists({str(flag)!r}):\n        break\n"
        "    time.sleep(0.05)\n"
        f"os.path.exists({str(flag)!r})"
    )
    for ev in pool.run(code, ranks=[0], want_values=True):
        if isinstance(ev, P.Output) and "early" in ev.text:
            flag.touch()
        if isinstance(ev, P.CellEnd):
            end = ev
    assert flag.exists(), "the output never arrived"
    assert end.values == {0: True}  # the rank saw the file: its output came while it ran


def test_values_and_selected_ranks(pool):
    _, seen, end = collect(pool.run("rank * 2", ranks=[1], want_values=True))
    assert end.values == {1: 2}
    assert end.ranks == (1,)
    assert P.RankResult(1, "2") in seen
    assert not any(getattr(ev, "rank", None) == 0 for ev in seen)


def test_a_rank_error_names_rank_type_message_and_cell_lines_and_keeps_state(pool):
    pool.execute("kept = 'yes'")
    _, _, end = collect(pool.run("x = 1\nif rank == 1:\n    1 / 0\n'ok'"))
    assert list(end.errors) == [1]
    err = end.errors[1]
    assert (err.exc_type, err.message) == ("ZeroDivisionError", "division by zero")
    assert 'File "<ddp-cell-' in err.traceback
    assert '", line 3, in <module>' in err.traceback
    with pytest.raises(CellFailed, match=r"^rank 1: ZeroDivisionError: division by zero$"):
        raise_for_end(end)
    assert pool.execute("kept") == ["yes", "yes"]


def test_needs_and_imports_are_bound_before_the_cell(pool):
    def scaled(x):
        return x * factor + rank  # noqa: F821  (factor and rank live on the rank)

    values = pool.execute(
        "scaled(data)",
        needs={"scaled": scaled, "data": 3, "factor": 10},
        imports="import math; from os import path as ospath",
    )
    assert values == [30, 31]
    assert pool.execute("(math.pi > 3, ospath.sep)") == [(True, "/")] * 2


def test_an_unpicklable_value_is_reported_not_lost(pool):
    _, _, end = collect(pool.run("import threading\nthreading.Lock()", want_values=True))
    assert sorted(end.errors) == [0, 1]
    assert "cannot be pickled" in end.errors[0].message


def test_output_before_a_death_is_kept_and_the_death_named(pool):
    code = "import os\nprint('last words', flush=True)\nif rank == 1:\n    os._exit(7)\n"
    code += "import torch.distributed as dist\ndist.barrier()"
    text, _, end = collect(pool.run(code))
    assert text[1, "stdout"] == "last words\n"
    assert end.exits[1].returncode == 7
    assert not end.exits[1].stopped_by_pool
    assert list(end.exits) == [1]  # rank 0 was freed from its barrier, not stopped
    with pytest.raises(CellFailed, match=r"rank 1 died \(exit code 7\)"):
        raise_for_end(end)
    assert not pool.needs_restart  # a new process took rank 1's place
    assert pool.execute("rank") == [0, 1]


def test_a_rank_killed_between_cells_is_noticed_at_the_next_cell(pool):
    os.kill(pool.pids[0], 9)
    assert wait_gone([pool.pids[0]], zombies=False) == []  # reaped by the fork server
    _, _, end = collect(pool.run("rank", want_values=True))
    assert end.values == {0: 0, 1: 1}
    assert any("rank 0 died (killed by SIGKILL)" in note for note in end.notes)


def test_a_timeout_interrupts_and_the_namespace_survives(pool):
    pool.execute("before = rank")
    _, _, end = collect(pool.run("import time\ntime.sleep(30)", timeout=0.5))
    assert end.interrupted == "timeout"  # not the 30 s sleep's own end
    with pytest.raises(CellInterrupted, match="cell timed out"):
        raise_for_end(end)
    assert pool.execute("before") == [0, 1]


def test_interrupt_from_another_thread_stops_an_infinite_loop(pool):
    threading.Timer(0.5, pool.interrupt).start()
    _, seen, end = collect(pool.run("while True:\n    pass"))
    assert end.interrupted == "interrupt"
    assert P.RankState(0, "interrupted") in seen
    assert pool.execute("rank") == [0, 1]


def test_ranks_that_ignore_the_interrupt_are_stopped_after_the_grace_period():
    with Pool(2, grace=0.5) as pool:
        code = "import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\ntime.sleep(30)"
        _, _, end = collect(pool.run(code, timeout=0.3))
        assert end.interrupted == "timeout"
        assert any("did not stop within 0.5 s" in note for note in end.notes)
        assert pool.needs_restart
        assert pool.execute("rank") == [0, 1]


def test_status_reports_every_rank(pool):
    rows = pool.status()
    assert [r.rank for r in rows] == [0, 1]
    for row in rows:
        assert row.pid in pool.pids
        assert row.host
        assert row.device == "cpu"
        assert row.state == "idle"
        assert row.uptime >= 0
        assert row.rss > 10 * 2**20


def test_restart_gives_fresh_ranks_through_the_same_fork_server(pool):
    pool.execute("mine = 1")
    old = pool.pids
    server = pool.procs.launcher._proc.pid
    pool.restart()
    assert pool.procs.launcher._proc.pid == server
    assert set(pool.pids).isdisjoint(old)
    assert wait_gone(old) == []
    _, _, end = collect(pool.run("mine"))
    assert end.errors[0].exc_type == "NameError"


@pytest.mark.parametrize("method", ["forkserver", "spawn", "fork"])
def test_every_start_method_runs_cells_and_stop_leaves_no_process(method):
    pool = Pool(2, start_method=method).start()
    pids = pool.pids
    helper = getattr(getattr(pool.procs.launcher, "_proc", None), "pid", None)
    assert pool.execute("rank") == [0, 1]
    pool.stop()
    assert wait_gone(pids + ([helper] if helper else [])) == []


def _open_fds() -> set[str]:
    """The pipes, epolls and nbddp folders this process holds open: fd and target (a
    reused number with a new target is a different file). Not eventfds and the like,
    which libraries other tests loaded open on their own."""
    held = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith(("pipe:", "anon_inode:[eventpoll]")) or "nbddp-" in target:
                held.add(f"{fd} {target}")
    return held


def test_a_stopped_pool_holds_no_descriptor_and_starts_again():
    """A session that started and stopped pools gathered three descriptors a pool (the
    hub's selector and wake pipe, held until the Pool object was collected): the full
    suite reached 1,024, where select() failed. Each pool here is still referenced, as a
    notebook's variables and the tests' fixtures keep them."""
    kept = [Pool(2)]
    kept[0].start().stop()
    before = _open_fds()
    for _ in range(3):
        pool = Pool(2).start()
        assert pool.execute("rank") == [0, 1]
        pool.stop()
        kept.append(pool)
    assert _open_fds() - before == set()
    pool.start()  # the same object, started again after a stop
    assert pool.execute("rank") == [0, 1]
    pool.stop()
    pool.stop()  # (twice: nothing left to close)
    assert _open_fds() - before == set()


def _epoll_targets(pool: Pool) -> set[int]:
    """The fds the kernel's epoll set of the pool's hub holds (not the selector's map)."""
    fd = pool.hub._selector.fileno()
    with open(f"/proc/self/fdinfo/{fd}") as f:
        return {int(line.split()[1]) for line in f if line.startswith("tfd:")}


@pytest.mark.parametrize("method", ["forkserver", "spawn", "fork"])
def test_after_a_restart_every_exit_sentinel_is_watched(method):
    with Pool(2, start_method=method) as pool:
        pool.execute("rank")
        pool.restart()
        pool.hub.pump(0)  # (registers the sentinels of the moment)
        sentinels = {s if isinstance(s, int) else s.fileno() for s in pool.procs.sentinels()}
        assert sentinels
        assert sentinels <= _epoll_targets(pool)


def test_children_a_rank_started_end_with_the_pool():
    pool = Pool(1).start()
    (child,) = pool.execute("import subprocess\nsubprocess.Popen(['sleep', '60']).pid")
    assert psutil.pid_exists(child)
    pool.stop()
    assert wait_gone([child]) == []


def test_a_rank_that_cannot_start_is_named():
    with pytest.raises(PoolStartError, match="rank 0 failed to start"):
        Pool(1, env={"NBDDP_BACKEND": "nccl"}, start_method="fork").start()


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match=r"at least|>= 1"):
        Pool(0)
    with pytest.raises(ValueError, match="unknown start method"):
        Pool(2, start_method="thread")


def test_nothing_listens_beyond_loopback_and_the_listener_is_private(pool):
    listener_dir = os.path.dirname(pool.address)
    assert stat.S_IMODE(os.stat(listener_dir).st_mode) == 0o700
    assert pool.listener.sock.family == socket.AF_UNIX
    pool.execute("import torch.distributed as dist\ndist.barrier()")
    store = pool.procs.store[0]  # the group's store, in a process of its own
    listening = 0
    for pid in [*pool.pids, os.getpid(), store]:
        for conn in psutil.Process(pid).net_connections(kind="inet"):
            listening += pid == store and conn.status == psutil.CONN_LISTEN
            if conn.status == psutil.CONN_LISTEN:
                assert conn.laddr.ip in ("127.0.0.1", "::1"), (pid, conn)
    assert listening == 1


def test_fork_is_refused_when_cuda_is_initialised_in_the_notebook(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(ValueError, match="'fork' is unsafe: CUDA is initialised"):
        Pool(1, start_method="fork")  # checked before anything starts


def test_progress_and_rich_output_come_as_events_from_the_display_ranks(pool):
    code = """
from nbddp import progress
for _ in progress(range(3), desc="steps"):
    pass
display({"from": rank})
class Rich:
    def _repr_html_(self):
        return f"<b>{rank}</b>"
Rich()
"""
    _, seen, end = collect(pool.run(code, display_ranks=[1]))
    assert not end.errors
    assert P.RankProgress(0, 3, 3, "steps") in seen
    assert P.RankProgress(1, 3, 3, "steps") in seen
    shown = [ev for ev in seen if isinstance(ev, P.RankDisplay)]
    assert [ev.rank for ev in shown] == [1, 1]
    assert shown[0].data == {"text/plain": "{'from': 1}"}
    assert shown[1].data["text/html"] == "<b>1</b>"


def test_figures_are_sent_as_png_and_closed(pool):
    pytest.importorskip("matplotlib")
    code = "import matplotlib.pyplot as plt\nplt.plot([1, 2])\nplt.show()\nplt.get_fignums()"
    _, seen, end = collect(pool.run(code, want_values=True))
    pngs = [ev for ev in seen if isinstance(ev, P.RankDisplay) and "image/png" in ev.data]
    assert len(pngs) == 1
    assert pngs[0].rank == 0
    assert end.values == {0: [], 1: []}  # every rank closed its figures


def test_a_pool_raises_the_open_file_limit_as_far_as_it_needs():
    """3 connections per rank: with a low soft limit, 8 ranks only fit once it is raised."""
    code = (
        "import os, resource\n"
        "from nbddp import Pool\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "low = len(os.listdir('/proc/self/fd')) + 12\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))\n"
        "with Pool(8) as pool:\n"
        "    ranks = pool.execute('rank')\n"
        "now = resource.getrlimit(resource.RLIMIT_NOFILE)[0]\n"
        "print(ranks == list(range(8)), low < now < hard or hard == resource.RLIM_INFINITY)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["True", "True"], out.stderr[-2000:]
