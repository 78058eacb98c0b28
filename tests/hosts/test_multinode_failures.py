"""Attached (torchrun) ranks that fail between cells, or come back after torchrun restarted
them: said at once, in one line, never a wait for ranks that cannot come.

The man in the middle is test_wire's TCP proxy between a real worker and the notebook."""

from __future__ import annotations

import os
import select
import socket

import pytest
from test_wire import Proxy, attached_pool, attached_through, forged, token_file  # noqa: F401

from helpers import collect, end_all, free_port, start, torchrun_node_cmd
from nbddp import Pool
from nbddp.pool.errors import PoolClosedError


def _control(proxy: Proxy):
    return next(c for c in proxy.conns if c.kind == "Hello")


def _replay_hello(proxy: Proxy) -> None:
    conn = _control(proxy)
    conn.socks[1].sendall(conn.frames["up"][0].raw)  # the rank's Hello, again


def _inject(proxy: Proxy) -> None:
    conn = _control(proxy)
    last = conn.frames["up"][-1]
    conn.socks[1].sendall(forged(last.seq + 1, b"evil"))  # the next number, a made-up MAC


BETWEEN = {
    "replay the Hello": (_replay_hello, "a frame came out of order"),
    "inject a frame": (_inject, "a frame failed its MAC check"),
}


@pytest.mark.parametrize("attack", list(BETWEEN))
@pytest.mark.timeout(90)  # (less than the pool's 120 s start timeout)
def test_a_bad_frame_between_cells_is_said_at_the_next_cell(attack, token_file, tmp_path):  # noqa: F811
    """The next cell says at once which rank, which host and why, and the pool is stopped
    (it waited 120 s for a rank that could not come, then said only that it did not start)."""
    act, why = BETWEEN[attack]
    pool = attached_pool(token_file)
    proxy = Proxy(pool.listen(), lambda *_: None)
    with attached_through(proxy, pool, token_file, tmp_path) as proc:
        assert pool.execute("rank") == [0]
        act(proxy)
        # (the cell after it arrived: one that begins before is the running cell's case)
        assert select.select([pool.roster[0].link.conn.fileno()], [], [], 10)[0]
        with pytest.raises(PoolClosedError) as raised:  # at once: the start timeout (120 s)
            collect(pool.run("1"))  # outlasts the test's
        said = str(raised.value)
        assert "\n" not in said
        host = socket.gethostname()
        assert said.startswith(
            f"rank 0 ({host}) died (connection lost) since the last cell "
            f"(rank 0's connection was closed (host {host}): a frame failed its check: {why}"
        )
        assert said.endswith("start torchrun again and attach again")
        assert not pool.take_notes()  # said once, in that line
        assert proc.wait(30) == 1  # the notebook closed its connection: the rank ended
        with pytest.raises(PoolClosedError, match="start torchrun again and attach again"):
            collect(pool.run("1"))


@pytest.mark.timeout(240)
def test_workers_torchrun_restarts_are_turned_away_at_once_with_the_reason(token_file, tmp_path):  # noqa: F811
    """torchrun --max-restarts: after a rank died, the pool (stopped) turns the restarted
    workers away at once, each says why in torchrun's log and torchrun ends; the notebook
    says it too. (They waited for the stopped pool forever.)"""
    pool = Pool(2, listen=("127.0.0.1", 0), token=token_file.read_bytes().strip())
    cmd = torchrun_node_cmd(0, free_port(), pool.listen(), token_file, nodes=1)
    cmd[3:3] = ["--max-restarts", "1", "--monitor-interval", "0.1"]
    log_path = tmp_path / "torchrun.log"
    with open(log_path, "wb") as log:
        node = start(cmd, log, dict(os.environ, NBDDP_HOLD="0"))  # (held: it is replaced)
        try:
            pool.start()
            _, _, end = collect(pool.run("import os\nif rank == 1:\n    os._exit(5)"))
            assert 1 in end.exits
            assert node.wait(120) != 0  # its one restart turned away: torchrun gave up
            said = log_path.read_text(errors="replace")
            refused = [line for line in said.splitlines() if "refused this worker" in line]
            # (in one line; the first one turned away ends torchrun, maybe before the others)
            assert refused, said
            assert "torchrun --max-restarts" in refused[0]
            with pytest.raises(PoolClosedError) as raised:
                collect(pool.run("1"))
            assert "turned away the relay of" in str(raised.value)
            assert "\n" not in str(raised.value)
        finally:
            pool.stop()
            end_all([node])


@pytest.mark.timeout(180)
def test_a_torchrun_rank_whose_connection_was_closed_is_replaced(token_file, tmp_path):  # noqa: F811
    """A frame replayed on a held torchrun rank's connection between cells: the next cell
    says which rank, which host and why, and the rank is handled as a dead one: its holder
    forks a new process, which takes its place (said as on a local pool)."""
    pool = Pool(1, listen=("127.0.0.1", 0), token=token_file.read_bytes().strip())
    proxy = Proxy(pool.listen(), lambda *_: None)
    cmd = torchrun_node_cmd(0, free_port(), proxy.address, token_file, nodes=1, per_node=1)
    with open(tmp_path / "torchrun.log", "wb") as log:
        # no relay (a held rank alone on its host has one): the proxy carries the rank's own
        # connection, whose Hello the test replays
        node = start(cmd, log, env={**os.environ, "NBDDP_RELAY": "0"})
        try:
            pool.start()
            pool.execute("y = 1")
            _replay_hello(proxy)
            assert select.select([pool.roster[0].link.conn.fileno()], [], [], 10)[0]
            _, _, end = collect(pool.run("rank", want_values=True))
            assert end.values == {0: 0}
            said = " ".join(end.notes)
            host = socket.gethostname()
            assert "rank 0 died (connection lost) since the last cell" in said
            closed = f"rank 0's connection was closed (host {host}): a frame failed its check"
            assert f"{closed}: a frame came out of order" in said
            assert "rank 0: a new process took its place; it had y (gone)" in said
            assert node.poll() is None
        finally:
            pool.stop()
            proxy.close()
            end_all([node])
