"""A detached pool never drops a kernel at a rank's pdb prompt, and a kernel it cuts off
is told the truth (issue 47, item 4).

At a prompt the kernel reads nothing until the user answers. Before the fix, the
supervisor kept sending it Ticks (10 a second) and the other ranks' output, the socket
filled, and the kernel was dropped after the send deadline (about a minute with Ticks
alone) and told "its ranks' state is lost", which was false: the pool and the rank in
pdb lived on. Here the send deadline is 1 s and the other ranks print about 4 MB
while the user "thinks" for 3 s.
"""

from __future__ import annotations

import contextlib
import time

import pytest
from test_detached import _every_test_has_its_home, home  # noqa: F401

from helpers import DetachedFamily, namespace_digests
from nbddp.detached import client as detached_client
from nbddp.pool.errors import NbddpError, PoolClosedError
from nbddp.wire import protocol as P

THINK = 3.0  # s the user takes to answer the prompt: past the 1 s send deadline
CHATTER = "any(print('x' * 200) for _ in range(20_000))\n"  # about 4 MB from each rank


@contextlib.contextmanager
def _pool(name: str, n: int):
    pool = detached_client.start(name, n, send_deadline=1.0)
    family = DetachedFamily(name)
    try:
        yield pool, family
    finally:
        with contextlib.suppress(NbddpError):
            pool.disconnect()
        if family.supervisor.pid in family.alive(timeout=0):
            with contextlib.suppress(NbddpError):
                detached_client.stop(name)
        family.clean()


@pytest.mark.timeout(180)
def test_a_kernel_at_a_ranks_pdb_prompt_is_never_dropped(home):  # noqa: F811
    with _pool("prompt", 3) as (pool, family):
        pool.execute("kept = rank + 3")
        code = f"if rank == 1:\n    breakpoint()\n    x = 'asked'\nelse:\n    {CHATTER}"
        prompts, lines, end = 0, 0, None
        for event in pool.run(code, tick=0.05):
            if isinstance(event, P.RankDebug):
                prompts += 1
                if prompts == 1:
                    time.sleep(THINK)  # reading nothing: Ticks and output pile up
                pool.debug_reply(event, "c")
            elif isinstance(event, P.Output):
                lines += event.text.count("\n")
            elif isinstance(event, P.CellEnd):
                end = event
        assert end is not None
        assert end.errors == {}, end.errors
        assert not any("disconnected" in n for n in end.notes), end.notes
        assert lines >= 2 * 20_000  # every line of both chattering ranks
        assert pool.execute("kept") == [3, 4, 5]
        family.record()
        pool.stop()
        assert family.alive() == []


@pytest.mark.timeout(180)
def test_a_kernel_cut_off_is_told_the_pool_runs_on_with_every_ranks_state(home):  # noqa: F811
    with _pool("cutoff", 2) as (pool, family):
        pool.execute("kept = rank + 3")
        before = namespace_digests(pool)
        events = pool.run(CHATTER)  # read nothing: dropped after the 1 s deadline
        deadline = time.monotonic() + 60
        while {p["name"]: p for p in detached_client.listing()}["cutoff"]["connected"]:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        with pytest.raises(PoolClosedError) as cut:
            for _ in events:
                pass
        said = str(cut.value)
        assert "the pool runs on, every rank's state kept" in said, said
        assert "`%ddp connect cutoff` again" in said, said
        assert "lost" not in said, said
        again = detached_client.connect("cutoff")
        list(again.resume())
        assert namespace_digests(again) == before
        family.record()
        again.stop()
        assert family.alive() == []


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [3, 8])
def test_an_interrupt_sent_right_after_run_stops_the_cell(home, n):  # noqa: F811
    """Issue 47, item 7: the interrupt reached the supervisor before it had started the
    cell, was dropped, and the cell ran to its end (15 s, 2 of 2). Now it holds for the
    cell, which is interrupted as it starts; every rank keeps its state."""
    with _pool(f"early{n}", n) as (pool, family):
        pool.execute("kept = rank + 3")
        for _ in range(3):
            events = pool.run("import time\ntime.sleep(15)\nslept = True")
            pool.interrupt()  # at once: the supervisor has not started the cell yet
            end = next(e for e in events if isinstance(e, P.CellEnd))
            assert end.interrupted == "interrupt", end
            assert end.kept, (end.notes, end.exits, end.stacks)
            assert not any("lost" in note for note in end.notes), end.notes
        assert pool.execute("('slept' in globals(), kept)") == [(False, r + 3) for r in range(n)]
        family.record()
        pool.stop()
        assert family.alive() == []


def test_a_pool_that_hangs_up_after_the_handshake_is_said_stopping_in_one_line(home):  # noqa: F811
    """A supervisor that is ending proves the token, then closes: ``%ddp stop NAME`` or
    ``connect`` met a raw EOFError there (a clean-clone run's teardown did)."""
    import os
    import secrets
    import shutil
    import socket
    import threading

    from nbddp.detached import messages as W
    from nbddp.wire import handshake
    from nbddp.wire.private import write_private

    folder = W.folder_of("ending")
    os.makedirs(folder, mode=0o700)
    token = secrets.token_hex(32).encode()
    write_private(os.path.join(folder, "token"), token)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(os.path.join(folder, W.SOCKET))
    listener.listen()

    def hang_up() -> None:
        sock, _ = listener.accept()
        handshake.server_handshake(sock, token, 5.0)
        sock.close()

    ending = threading.Thread(target=hang_up)
    ending.start()
    try:
        with pytest.raises(PoolClosedError, match="closed the connection: it is stopping"):
            detached_client.connect("ending")
    finally:
        ending.join(10)
        listener.close()
        shutil.rmtree(folder)
