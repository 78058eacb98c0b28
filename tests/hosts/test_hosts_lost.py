"""A lost host (nbddp.pool.hosts_lost) with simulated hosts of held ranks behind real relays:
cheap at 8 ranks a host and 3 hosts (tests/hosts/test_netns.py does it with torchrun and real
process groups in network namespaces).

A host is lost when its relay and its ranks are SIGKILLed: the others keep their state
and wait, ``%ddp status`` and a cell say which ranks of which host are missing at once,
and ranks started for them again (a replacement host) are taken back at full size.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import secrets
import select
import signal
import threading
import time

import psutil
import pytest

import simranks
from helpers import collect, detached_family, wait_rejoined
from nbddp import CellFailed, Pool, PoolClosedError
from nbddp.dashboard.sinks import TextSink
from nbddp.dashboard.view import Dashboard
from nbddp.detached import client
from nbddp.detached import messages as W
from nbddp.hosts.relay_carry import RENEW_WAIT
from nbddp.notebook import remote, reports
from nbddp.notebook.session import SESSION
from nbddp.pool.hosts_lost import HostsMissing
from nbddp.pool.recovery import RENEW_TIMEOUT
from nbddp.wire import protocol as P
from nbddp.wire.stacks import rank_set
from tiers import slow

SHOW_X = "print(rank, globals().get('x'))"
# a re-form's wait for new processes longer than any test here: a test that passes did not
# wait for it (before, wall-clock bounds said so, and could fail on a busy machine)
NO_WAIT = 600


@contextlib.contextmanager
def sim_hosts(hosts: int, per_host: int, start_timeout: float = 60):
    """(pool, start(ranks)): ``hosts`` simulated hosts of held ranks, one process and one
    relay each; ``start(ranks)`` starts those ranks again, as a replacement host.
    ``start_timeout`` is also how long a re-form waits for new processes: a test that
    must see no such wait makes it longer than its own timeout."""
    world, token = hosts * per_host, secrets.token_bytes(16)
    pool = Pool(world, listen=("127.0.0.1", 0), token=token, start_timeout=start_timeout)
    address, sims = pool.listen(), []

    def start(ranks: range | None = None) -> list:
        procs = 1 if ranks is not None else hosts
        new = simranks.start(
            address, token, world, procs, per_host=per_host, relay=True, held=True, ranks=ranks
        )
        sims.extend(new)
        return new

    try:
        start()
        pool.start()
        yield pool, sims, start
    finally:
        pool.stop()
        for sim in sims:
            with contextlib.suppress(Exception):
                sim.wait(30)
            if sim.poll() is None:
                sim.kill()
                sim.wait()


def lose_host(pool, sim, first: int) -> None:
    """SIGKILL a simulated host: the process serving its ranks, and its relay."""
    relay = next(r for r in pool.hub.relays if r.ranks and min(r.ranks) == first)
    sim.kill()
    os.kill(relay.pid, signal.SIGKILL)
    sim.wait(30)


def _missing_then_back(pool, start, lost: range, world: int) -> None:
    """Host sim1 said lost (its ranks ``lost`` missing, the notes say so); a replacement
    brings them back, every other rank kept x."""
    said = " ".join(pool.take_notes())
    assert "host sim1 (ranks" in said, said
    assert "was lost" in said, said
    assert [s.rank for s in pool.status() if s.state == "missing"] == list(lost)
    start(lost)
    wait_rejoined(pool, 60, "the replacement's ranks were not taken")
    values = shown(pool)  # (the new ranks re-ran `x = rank * 10`: no collective)
    assert values == {r: f"{r} {r * 10}" for r in range(world)}, "the others kept x"
    assert [s.state for s in pool.status()] == ["idle"] * world


def shown(pool) -> dict[int, str]:
    text, _, _ = collect(pool.run(SHOW_X))
    return {rank: t.strip() for (rank, stream), t in text.items() if stream == "stdout"}


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("hosts", "per_host"), [(2, 8), pytest.param(3, 4, marks=slow)], ids=["2x8", "3x4"]
)
def test_a_lost_host_waits_and_its_ranks_rejoin_from_a_replacement(hosts, per_host):
    world, lost = hosts * per_host, range(per_host, 2 * per_host)
    with sim_hosts(hosts, per_host, start_timeout=NO_WAIT) as (pool, sims, start):
        pool.execute("x = rank * 10")
        lose_host(pool, sims[1], per_host)
        deadline = time.monotonic() + 30
        while not any(s.state == "missing" for s in pool.status()):
            assert time.monotonic() < deadline, "the lost host's ranks never showed as missing"
            time.sleep(0.05)
        rows = [(s.rank, s.host) for s in pool.status() if s.state == "missing"]
        assert rows == [(r, "sim1") for r in lost]
        assert "of host sim1 are missing" in reports.status(pool).splitlines()[-1]
        with pytest.raises(HostsMissing, match=rf"ranks {per_host}-{2 * per_host - 1} of host"):
            pool.execute("x = None")  # at once: a wait for the ranks would outlast the test
        start(lost)
        wait_rejoined(pool, 60, "the replacement's ranks were not taken")
        _, _, end = collect(pool.run("1"))
        said = " ".join(end.notes)
        assert "was lost" in said, said
        assert "rejoined from sim1" in said, said
        assert f"re-formed with the new ranks {per_host}-{2 * per_host - 1}" in said, said
        assert f"ranks {per_host}-{2 * per_host - 1} re-ran " in said, said
        values = shown(pool)  # (the new ranks re-ran `x = rank * 10`: no collective)
        assert values == {r: f"{r} {r * 10}" for r in range(world)}, "the others kept x"
        assert [s.state for s in pool.status()] == ["idle"] * world


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("hosts", "per_host"),
    [pytest.param(2, 2, marks=slow), (3, 3), pytest.param(2, 4, marks=slow), (2, 8)],
)
def test_a_host_whose_ranks_end_before_its_relay_is_lost_not_late(hosts, per_host):
    """A host killed process by process, its ranks before its relay: the notebook reads its
    ranks' ends first (plain deaths: their holders should fork new processes) and starts
    the re-form that waits for them; the relay's end then makes them missing at once (before,
    the re-form waited 60 s for processes that could not come, then stopped the pool and
    every rank's state with it). A replacement brings them back, the others kept x."""
    world, lost = hosts * per_host, range(per_host, 2 * per_host)
    with sim_hosts(hosts, per_host, start_timeout=NO_WAIT) as (pool, sims, start):
        pool.execute("x = rank * 10")
        relay = next(r for r in pool.hub.relays if r.ranks and min(r.ranks) == per_host)
        sims[1].kill()
        sims[1].wait(30)
        # the relay told the notebook its ranks ended: there is something to read from it
        assert select.select([relay.conn.fileno()], [], [], 30)[0], "the relay said nothing"
        threading.Timer(1.0, os.kill, (relay.pid, signal.SIGKILL)).start()
        with pytest.raises(HostsMissing, match=rf"{rank_set(lost)} of host sim1 are missing"):
            pool.execute("x = None")  # its mend reads the deaths while the relay still runs
        _missing_then_back(pool, start, lost, world)


@pytest.mark.timeout(240)
def test_a_host_whose_holders_died_while_its_relay_lives_is_lost_after_the_renew_wait():
    """A host's ranks and their holders killed, its relay left running: no new process can
    come, so the relay waits RENEW_WAIT (60 s) for one and then ends by itself; the re-form
    that waits for those ranks (up to RENEW_TIMEOUT, 90 s, longer on purpose) sees the
    host lost, not late: its ranks are missing, the pool and every other rank's state stay,
    and a replacement host brings them back (issue 47: this had no test)."""
    hosts, per_host = 2, 4
    world, lost = hosts * per_host, range(per_host, 2 * per_host)
    with sim_hosts(hosts, per_host, start_timeout=NO_WAIT) as (pool, sims, start):
        pool.execute("x = rank * 10")
        relay = next(r for r in pool.hub.relays if r.ranks and min(r.ranks) == per_host)
        relay_proc = psutil.Process(relay.pid)
        sims[1].kill()  # the ranks and (simulated) holders; the relay lives on
        sims[1].wait(30)
        # the relay told the notebook its ranks ended: the next cell's repair reads it (a
        # cell sent before that would see them die in it: the same wait, said as a failure)
        assert select.select([relay.conn.fileno()], [], [], 30)[0], "the relay said nothing"
        t0 = time.monotonic()
        with pytest.raises(HostsMissing, match=rf"{rank_set(lost)} of host sim1 are missing"):
            pool.execute("x = None")  # waits for the relay to give up on its holders
        took = time.monotonic() - t0
        relay_proc.wait(10)  # it ended by itself (else TimeoutExpired)
        assert RENEW_WAIT - 1 <= took < RENEW_TIMEOUT, took  # the relay's wait ended it
        assert not pool.needs_restart
        _missing_then_back(pool, start, lost, world)


@pytest.mark.timeout(120)
def test_a_lost_host_that_held_the_store_stops_the_pool_and_says_why():
    with sim_hosts(2, 4) as (pool, sims, _):
        lose_host(pool, sims[0], 0)
        # (a cell that starts before the notebook saw the host go fails with the same words)
        with pytest.raises((PoolClosedError, CellFailed)) as caught:  # noqa: PT012
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                pool.execute("1")
                time.sleep(0.05)
        said = str(caught.value)
        assert "host sim0 (ranks 0-3) was lost with torchrun's store" in said, said
        assert "start torchrun again and attach again" in said, said


# ---------------------------------------------- what the user meets while ranks are missing


@pytest.fixture(scope="module")
def shell():
    """An IPython shell with the magics, its session pointed at the test's pool."""
    from IPython.core.interactiveshell import InteractiveShell

    sh = InteractiveShell.instance()
    sh.run_cell("%load_ext nbddp")
    yield sh
    SESSION.pool = None  # (the test's pool is stopped by its own context)
    sh.run_cell("%unload_ext nbddp")


def magic(shell, capsys, line: str) -> tuple[str, str]:
    """Run a line in ``shell``: (what it printed, its error's one line or '')."""
    capsys.readouterr()
    result = shell.run_cell(line)
    printed = capsys.readouterr()
    error = result.error_in_exec or result.error_before_exec
    return printed.out + printed.err, "" if error is None else str(error)


def sunk(events, pool) -> tuple[Dashboard, str]:
    """A cell's events through a dashboard (not shown) and a --text sink: (the dashboard,
    what the text sink wrote)."""
    out, err = io.StringIO(), io.StringIO()
    board = Dashboard(list(range(pool.world_size)), world_size=pool.world_size, hosts=pool.hosts)
    text = TextSink(stdout=out, stderr=err, hosts=pool.hosts)
    end = None
    for event in events:
        board.handle(event)
        text.handle(event)
        end = event if isinstance(event, P.CellEnd) else end
    board.close(end)
    text.close(end)
    return board, out.getvalue() + err.getvalue()


MISSING = r"ranks 2, 3 of host sim1 are missing: the host was lost; nothing ran"


@pytest.mark.timeout(120)
def test_while_a_hosts_ranks_are_missing_each_command_says_so_or_works_on_the_others(
    shell, capsys, tmp_path
):
    """A host lost in a cell: the dashboard's rows, its frozen output and the --text sink
    show its ranks ``missing (host sim1 lost)``; then every %ddp command that needs the
    pool either works on the present ranks (status, stacks) or refuses in one line naming
    the missing ranks and host, with nothing run or lost (never `no pool is running`, and
    never a start that waits for ranks that cannot come); a replacement brings them back,
    and the others kept their values (simulated ranks: no value comes back, so no copy)."""
    with sim_hosts(2, 2, start_timeout=NO_WAIT) as (pool, sims, start):
        SESSION.pool = pool
        pool.execute("x = rank * 10")
        events = pool.run("import time\ntime.sleep(2)")
        threading.Timer(0.3, lose_host, (pool, sims[1], 2)).start()
        board, text = sunk(events, pool)
        for rank in (2, 3):
            row = re.search(rf"<tr [^>]*data-rank='{rank}'.*?</tr>", board.widget.rows).group(0)
            assert "missing (host sim1 lost)" in row, row
        frozen = board.frozen_bundle()
        assert frozen["text/html"].count("missing (host sim1 lost)") == 2, frozen["text/html"]
        assert "rank 3: missing (host sim1 lost)" in frozen["text/plain"], frozen["text/plain"]
        assert "[nbddp] ranks 2, 3: missing (host sim1 lost)" in text, text
        shell.user_ns["x"] = 1  # (each refused at once: a wait for the ranks outlasts the test)
        for line in (
            "%ddp copy x --from 0 --to 2",
            "%ddp debug --rank 0",
            "%ddp push x",
            "%ddp pull x --rank 0",
            f"%ddp run {tmp_path / 'script.py'}",
            "%%ddp\nx = None",
        ):
            (tmp_path / "script.py").write_text("x = None\n")
            _, error = magic(shell, capsys, line)
            assert re.search(MISSING, error), f"{line}: {error!r}"
            assert "\n" not in error, error
        printed, error = magic(shell, capsys, "%ddp status")
        assert not error, error
        assert printed.count(" missing ") == 2, printed
        assert "ranks 2, 3 of host sim1 are missing" in printed.splitlines()[-1], printed
        assert [s.state for s in pool.status()][:2] == ["idle"] * 2
        _stacks_then_rejoin(shell, capsys, pool, start)


def _stacks_then_rejoin(shell, capsys, pool, start) -> None:
    """Host sim1 (ranks 2, 3) lost: ``%ddp stacks`` works on ranks 0, 1 and names the
    missing; the replacement's ranks are taken back (new processes, re-running the cell
    that made ``x``), and ranks 0, 1 kept ``x``."""
    printed, error = magic(shell, capsys, "%ddp stacks")
    assert not error, error
    assert "every rank is idle (ranks 0, 1)" in printed, printed
    assert "ranks 2, 3 of host sim1 are missing" in printed, printed
    assert SESSION.pool is pool
    start(range(2, 4))
    wait_rejoined(pool, 60, "the replacement's ranks were not taken")
    printed, error = magic(shell, capsys, "%%ddp --no-fold\nprint(rank, globals().get('x'))")
    assert not error, error
    for rank, x in ((0, 0), (1, 10), (2, 20), (3, 30)):  # the others kept x; the new
        assert f"{rank} {x}" in printed, printed  # ranks re-ran its cell, each its own
    assert "ranks 2, 3 re-ran " in printed, printed
    assert "missing" not in magic(shell, capsys, "%ddp status")[0]


# ---------------------------------------------- the same through a detached attached pool


@contextlib.contextmanager
def detached_sim_hosts(name: str, hosts: int, per_host: int, token_file: str):
    """As :func:`sim_hosts`, the pool attached with ``%ddp attach --detached NAME``: its
    listener and core in a supervisor; (the kernel's client, sims, start(ranks))."""
    world, token = hosts * per_host, remote.read_or_create_token(token_file)
    sims: list = []
    address: list[str] = []  # where the supervisor listens, once it does

    def start(ranks: range | None = None) -> list:
        procs = 1 if ranks is not None else hosts
        new = simranks.start(
            address[0], token, world, procs, per_host=per_host, relay=True, held=True, ranks=ranks
        )
        sims.extend(new)
        return new

    def watch(folder: str) -> None:  # the kernel's watch: the ranks are called once it listens
        path = os.path.join(folder, W.ADDRESS)
        if not address and os.path.exists(path):
            with open(path) as f:
                address.append(f.read().strip())
            start()

    try:
        pool = client.start(
            name,
            world,
            attach={"token_file": token_file, "tls": False},
            listen=("127.0.0.1", 0),
            start_timeout=NO_WAIT,
            watch=watch,
        )
        with detached_family(name):  # (what a failed test left of it: stopped, removed)
            yield pool, sims, start
            pool.stop()
    finally:
        for sim in sims:
            with contextlib.suppress(Exception):
                sim.wait(30)
            if sim.poll() is None:
                sim.kill()
                sim.wait()


def lose_sim_host(sim) -> None:
    """SIGKILL a simulated host from outside its pool: its relay (forked from its process:
    the same command line), then its process. The relay first: its connection ends with
    its ranks, as when a host goes at once (a relay that outlives its ranks a moment says
    their deaths first, and a `%ddp status` that reads them then takes them for dead ranks
    of a lost pool, not missing ones: a gap of the pool's core, in-kernel too)."""
    (relay,) = [
        p
        for p in psutil.process_iter(["cmdline"])
        if p.info["cmdline"] == sim.args and p.pid != sim.pid
    ]
    relay.kill()
    sim.kill()
    sim.wait(30)


@pytest.mark.timeout(120)
def test_a_detached_attached_pool_says_which_ranks_are_missing_and_takes_them_back(
    shell, capsys, tmp_path
):
    """Through ``%ddp attach --detached``'s supervisor (whose kernel-side client has no
    roster), while a lost host's ranks are missing: ``%ddp status`` shows them, a cell and
    ``%ddp copy`` are refused at once in one line naming them (never `no pool is
    running`, a start or a wait), the pool runs on; the replacement's ranks are taken
    back, and the others kept their values."""
    with detached_sim_hosts("dm", 2, 2, str(tmp_path / "token")) as (pool, sims, start):
        SESSION.pool = pool
        assert not magic(shell, capsys, "%%ddp\nx = rank * 10")[1]
        lose_sim_host(sims[1])
        deadline = time.monotonic() + 30
        while " missing " not in (printed := magic(shell, capsys, "%ddp status")[0]):
            assert time.monotonic() < deadline, f"never shown missing: {printed}"
        assert printed.count(" missing ") == 2, printed
        assert "ranks 2, 3 of host sim1 are missing" in printed.splitlines()[-1], printed
        for line in ("%%ddp\nx = None", "%ddp copy x --from 0 --to 2"):  # (at once, as above)
            printed, error = magic(shell, capsys, line)
            assert re.search(MISSING, error), f"{line}: {error!r} {printed!r}"
            assert "\n" not in error, error
            assert printed.strip() == f"UsageError: {error}", printed  # (no start, no traceback)
        assert not pool.closed
        _stacks_then_rejoin(shell, capsys, pool, start)
        SESSION.pool = None
