"""``%ddp attach --tls``: ranks and host relays reach the notebook over TLS, pinned to the
certificate whose SHA-256 the token file names.

A lone worker started by hand, two torchrun nodes of two ranks (each behind its host
relay, TLS from the relay up), workers whose token file pins nothing or the wrong
certificate, and the magic.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import pytest
from IPython.core.interactiveshell import InteractiveShell

from helpers import (
    collect,
    end_all,
    free_port,
    lone_worker_env,
    start,
    torchrun_node_cmd,
    wait_gone,
    worker_cmd,
)
from nbddp import Pool
from nbddp.notebook import remote
from nbddp.wire.private import read_token_file
from nbddp.wire.tls import make_server_tls


@pytest.fixture
def tls_token(tmp_path):
    """A token file pinning a new certificate: (path, token, the server's Tls, the pin)."""
    server, pin = make_server_tls()
    path = tmp_path / "nbddp" / "token"
    token = remote.read_or_create_token(str(path), pin)
    return path, token, server, pin


def test_the_token_file_pins_the_certificate_and_attach_without_tls_unpins_it(tmp_path):
    path = tmp_path / "token"
    token = remote.read_or_create_token(str(path))
    assert path.read_text() == token.decode() + "\n"
    _, pin = make_server_tls()
    assert len(pin) == 64
    assert set(pin) <= set("0123456789abcdef")
    assert remote.read_or_create_token(str(path), pin) == token  # the token stays
    assert path.read_text() == f"{token.decode()}\ntls-sha256 {pin}\n"
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert read_token_file(str(path)).pin == pin
    assert remote.read_or_create_token(str(path), "") == token
    assert path.read_text() == token.decode() + "\n"
    assert read_token_file(str(path)).pin == ""


def test_a_later_attach_leaves_an_earlier_pools_pin_for_its_hosts_that_come_back(tmp_path):
    """Issue 47, item 12: one token file, one pin. A later attach (with --tls or without)
    rewrote it, and a host of the earlier --tls pool that came back (a lost host's
    replacement) read the later pool's pin and was refused. Each pool's pin is kept by its
    port now, and a rank reads the pin of the pool it connects to."""
    from nbddp.rank.worker import _read_token
    from nbddp.wire.tls import pin_listener

    path = str(tmp_path / "token")
    a, pin_a = make_server_tls()
    c, pin_c = make_server_tls()
    token = remote.read_or_create_token(path, pin_a)  # pool A, --tls, on port 4001
    pin_listener(path, a, "0.0.0.0:4001")
    remote.read_or_create_token(path, "")  # pool B, no TLS, on 4002
    pin_listener(path, None, "127.0.0.1:4002")
    remote.read_or_create_token(path, pin_c)  # pool C, --tls, on 4003
    pin_listener(path, c, "127.0.0.1:4003")
    held = read_token_file(path)
    assert held.token == token
    assert (held.pin_for(4001), held.pin_for(4002), held.pin_for(4003)) == (pin_a, "", pin_c)
    assert held.pin_for(None) == held.pin_for(4999) == pin_c  # else: the last pool's
    assert _read_token(path, "node-a:4001")[1].pin == pin_a
    assert _read_token(path, "node-a:4002")[1] is None
    assert _read_token(path, "node-a:4003")[1].pin == pin_c
    for port in range(5000, 5040):  # bounded: the latest pools' pins
        pin_listener(path, None, f"127.0.0.1:{port}")
    assert len(read_token_file(path).pins) == 16
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"


@pytest.fixture
def lone_tls(tls_token, tmp_path):
    """A pool of one rank, started by hand, attached over TLS."""
    path, token, server, _ = tls_token
    pool = Pool(1, listen=("127.0.0.1", 0), token=token, tls=server, start_timeout=60)
    address = pool.listen()
    log = open(tmp_path / "lone.log", "wb")  # noqa: SIM115
    proc = start(worker_cmd(address, path), log, lone_worker_env())
    try:
        pool.start()
        yield pool, address, proc
    finally:
        pool.stop()
        end_all([proc])
        log.close()


def test_a_lone_worker_runs_cells_over_tls(lone_tls):
    pool, _, proc = lone_tls
    link = pool.roster.ranks[0].link
    assert link.conn.mode == "tls"
    assert {s.conn.mode for s in link.streams.values()} == {"tls"}
    assert pool.tls is not None
    code = (
        "import sys\nprint('out', rank)\nprint('err', rank, file=sys.stderr)\n"
        "print('x' * 200000)\n"  # more than one TLS record (16 kB) on the stream
        "{'rank': rank, 'big': torch.arange(1 << 18)}"  # a value of 2 MB
    )
    for _ in range(3):
        text, _, end = collect(pool.run(code, want_values=True))
        assert not end.errors
        assert text[0, "stdout"] == "out 0\n" + "x" * 200000 + "\n"
        assert text[0, "stderr"] == "err 0\n"
        value = end.values[0]
        assert value["rank"] == 0
        assert value["big"].equal(__import__("torch").arange(1 << 18))
    # a value shipped to the rank and back, over TLS
    assert pool.execute("y = 41\ny + 1") == [42]
    pool.stop()
    assert proc.wait(30) == 0


@pytest.mark.timeout(300)
def test_two_torchrun_nodes_of_two_ranks_attach_over_tls_through_relays(tls_token, tmp_path):
    path, token, server, _ = tls_token
    pool = Pool(4, listen=("127.0.0.1", 0), token=token, tls=server, start_timeout=180)
    address = pool.listen()
    master = free_port()
    logs = [open(tmp_path / f"node{i}.log", "wb") for i in range(2)]  # noqa: SIM115
    nodes = [start(torchrun_node_cmd(i, master, address, path), logs[i]) for i in range(2)]
    relays: list[int] = []
    try:
        pool.start()
        relays = [r.pid for r in pool.hub.relays]
        assert len(relays) == 2  # one per node: the ranks reach the notebook through it
        assert {r.conn.mode for r in pool.hub.relays} == {"tls"}
        assert all(r.link.relay is not None for r in pool.roster.ranks.values())
        code = (
            "import os, sys, torch.distributed as dist\n"
            "t = torch.ones(1) * rank\n"
            "dist.all_reduce(t)\n"
            "print('sum', rank, t.item())\n"
            "print('err', rank, file=sys.stderr)\n"
            "(t.item(), os.environ['GROUP_RANK'], local_rank)"
        )
        text, _, end = collect(pool.run(code, want_values=True))
        assert not end.errors
        for rank in range(4):
            assert text[rank, "stdout"] == f"sum {rank} 6.0\n"
            assert text[rank, "stderr"] == f"err {rank}\n"
        assert end.values == {
            0: (6.0, "0", 0),
            1: (6.0, "0", 1),
            2: (6.0, "1", 0),
            3: (6.0, "1", 1),
        }
        pool.stop()
        assert [n.wait(60) for n in nodes] == [0, 0]  # torchrun ends cleanly
        assert wait_gone(relays) == []  # and so do the relays
    finally:
        pool.stop()
        end_all(nodes)
        for log in logs:
            log.close()
        for pid in wait_gone(relays, timeout=0):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("pin", ["", "wrong"], ids=["no-pin", "wrong-pin"])
def test_a_worker_that_does_not_pin_the_certificate_fails_clearly(lone_tls, tmp_path, pin):
    pool, address, _ = lone_tls
    token = read_token_file(str(tmp_path / "nbddp" / "token")).token
    other = tmp_path / "other"
    if pin == "wrong":
        pin = make_server_tls()[1]  # a certificate of another pool
    other.write_text(token.decode() + "\n" + (f"tls-sha256 {pin}\n" if pin else ""))
    other.chmod(0o600)
    out = subprocess.run(
        worker_cmd(address, other, timeout=10),
        env=lone_worker_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith(f"nbddp.worker: cannot reach the notebook at {address}: ")
    if pin:
        assert "is not the one the token file pins" in lines[0]
    else:
        assert "uses TLS (attach --tls)" in lines[0]
    _, _, end = collect(pool.run("rank", want_values=True))
    assert end.values == {0: 0}  # the pool goes on
    assert any("refused a connection from 127.0.0.1" in n for n in end.notes), end.notes


def test_attach_tls_through_the_magic(tmp_path, capsys):
    token_file = tmp_path / "nbddp" / "token"
    token = remote.read_or_create_token(str(token_file))
    assert read_token_file(str(token_file)).pin == ""
    port = free_port()
    log = open(tmp_path / "w.log", "wb")  # noqa: SIM115
    shell = InteractiveShell.instance()
    shell.run_cell("%load_ext nbddp")
    procs: list[subprocess.Popen] = []

    def launch() -> None:
        # a worker reads its token file once: it starts once the magic wrote the pin
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not read_token_file(str(token_file)).pin:
            time.sleep(0.05)
        procs.append(start(worker_cmd(f"127.0.0.1:{port}", token_file), log, lone_worker_env()))

    launcher = threading.Thread(target=launch)
    launcher.start()
    try:
        result = shell.run_cell(
            f"%ddp attach --tls --world-size 1 --listen 127.0.0.1:{port} "
            f"--token-file {token_file} --timeout 60"
        )
        launcher.join()
        assert result.success
        out = capsys.readouterr().out
        assert f"listening on 127.0.0.1:{port} (TLS); on each node run:" in out
        assert "attached 1 ranks on 1 host" in out
        held = read_token_file(str(token_file))
        assert held.token == token  # the same token, now with the pin
        assert len(held.pin) == 64
        assert token_file.read_text() == (
            f"{token.decode()}\ntls-sha256 {held.pin}\ntls-sha256 {held.pin} {port}\n"
        )  # the last pool's pin, and this pool's own by its port
        assert shell.run_cell("%%ddp --text\nprint('secret', rank)").success
        assert "[rank 0] secret 0" in capsys.readouterr().out
        shell.run_cell("%ddp stop")
        assert procs[0].wait(30) == 0
    finally:
        launcher.join()
        shell.run_cell("%unload_ext nbddp")
        end_all(procs)
        log.close()
