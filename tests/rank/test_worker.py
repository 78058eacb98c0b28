"""The worker's pure parts; the worker as a process is tested through the pool."""

from __future__ import annotations

import pytest

from nbddp.rank.worker import adopt, error_info, parse_address, run_code
from nbddp.wire import protocol as P


def test_run_code_returns_the_last_expression():
    ns: dict = {}
    assert run_code("x = 2\nx * 3", "<ddp-cell-1>", ns) == 6
    assert run_code("y = x", "<ddp-cell-2>", ns) is None
    assert ns["y"] == 2


def test_errors_carry_the_cells_own_line_numbers_and_no_worker_frames():
    try:
        run_code("a = 1\nb = 2\n1 / 0", "<ddp-cell-5>", {})
    except ZeroDivisionError as exc:
        info = error_info(exc)
    assert info.exc_type == "ZeroDivisionError"
    assert info.message == "division by zero"
    assert 'File "<ddp-cell-5>", line 3, in <module>' in info.traceback
    assert "1 / 0" in info.traceback  # the source line is shown
    assert "worker.py" not in info.traceback


def test_syntax_errors_point_into_the_cell():
    with pytest.raises(SyntaxError) as caught:
        run_code("x = (", "<ddp-cell-9>", {})
    info = error_info(caught.value)
    assert info.exc_type == "SyntaxError"
    assert "<ddp-cell-9>" in info.traceback


def test_adopted_functions_see_the_ranks_namespace():
    helper_globals = {"scale": 10}
    exec("def f(x):\n    return x * scale + offset", helper_globals)
    ns = {"offset": 1, "scale": 3}
    g = adopt(helper_globals["f"], ns)
    assert g(2) == 7  # the rank's own scale and offset win
    assert ns["scale"] == 3


def test_adoption_adds_names_the_rank_lacks():
    helper_globals = {"scale": 10}
    exec("def f(x):\n    return x * scale", helper_globals)
    ns: dict = {}
    assert adopt(helper_globals["f"], ns)(2) == 20
    assert ns["scale"] == 10


def test_addresses():
    assert parse_address("/tmp/x/pool.sock") == ("/tmp/x/pool.sock", "AF_UNIX")
    assert parse_address("unix:rel.sock") == ("rel.sock", "AF_UNIX")
    assert parse_address("10.0.0.1:5555") == (("10.0.0.1", 5555), "AF_INET")


def test_a_rank_waits_for_the_stores_address_with_a_deadline_and_keeps_other_messages(
    monkeypatch,
):
    """Issue 35.7: no unbounded wait and no ``assert`` on what the pool sends."""
    import queue

    from nbddp.rank import group as G
    from nbddp.wire import protocol as P

    inbox: queue.Queue = queue.Queue()
    keeper = G.GroupKeeper(1, 2, lambda msg: None, inbox)
    first, later = P.Interrupt(7), P.Interrupt(8)
    for msg in (first, P.JoinGroup(4242), later):
        inbox.put(msg)
    assert keeper._store_port() == 4242
    assert [inbox.get_nowait(), inbox.get_nowait()] == [first, later]  # kept, in order
    inbox.put(P.AbortGroup())
    with pytest.raises(RuntimeError, match="gave up forming the group"):
        keeper._store_port()
    monkeypatch.setattr(G, "JOIN_TIMEOUT", 0.2)
    with pytest.raises(TimeoutError, match=r"rank 1 waited 0\.2 s for rank 0's store address"):
        keeper._store_port()


def test_re_form_prefixes_are_keyed_by_the_pools_token():
    """Issue 47, item 12: the store of a local pool takes any local connection, and re-form
    prefixes were ``nbddp-reform-N``: another user of the host could write there first
    and make the next re-form fail. The prefix now carries an HMAC of the pool's token."""
    import queue

    from nbddp.rank.group import GroupKeeper

    def prefix(token: bytes, generation: int) -> str:
        keeper = GroupKeeper(0, 2, lambda _msg: None, queue.Queue())
        keeper.salt = token
        return keeper._prefix(generation)

    a = prefix(b"token-a", 3)
    assert a.startswith("nbddp-reform-3-")
    assert len(a) == len("nbddp-reform-3-") + 32
    assert a == prefix(b"token-a", 3)  # every rank of the pool meets there
    assert a != prefix(b"token-b", 3)  # not guessable without the token
    assert a != prefix(b"token-a", 4)


def test_a_new_process_takes_only_the_reform_sent_to_it_as_new():
    """Issue 47, item 12: a relay could hand a holder's new process a Reform meant for the
    dead process it replaces (sent before the notebook knew): the new process joined a
    re-form no one else was in. Only a Reform the roster sends it in answer to its hello
    (``new``) takes it in."""
    import queue
    from types import SimpleNamespace

    from nbddp.rank.worker import Worker

    inbox = queue.Queue()
    for msg in (P.Reform(3), P.Run(1, "x"), P.Reform(5, new=True), P.Reform(6, new=True)):
        inbox.put(msg)
    fake = SimpleNamespace(control=SimpleNamespace(inbox=inbox))
    assert Worker._await_reform(fake) == 5


def test_a_read_of_the_positions_waits_for_another_threads_read(monkeypatch):
    """Issue 47/46: the sampler thread reads the positions while the main thread ends its
    cell; the main thread's read found the lock taken and said nothing (``()``), so at 8
    ranks under load a cell left out of step went unjudged (no re-form, no note). A read
    now waits for the other one (a few microseconds), or for an abort up to a bound."""
    import queue
    import threading

    from nbddp.rank import group as G

    monkeypatch.setattr(G, "positions", lambda: (("0", (), 5, False),))
    keeper = G.GroupKeeper(0, 2, lambda _msg: None, queue.Queue())
    held, release = threading.Event(), threading.Event()

    def other_reader() -> None:
        with keeper._abort_lock:
            held.set()
            release.wait(5)

    thread = threading.Thread(target=other_reader)
    thread.start()
    held.wait(5)
    threading.Timer(0.05, release.set).start()
    assert keeper.positions() == (("0", (), 5, False),)
    thread.join()
    monkeypatch.setattr(G, "POSITIONS_WAIT", 0.05)  # an abort that takes longer: nothing said
    with keeper._abort_lock:
        assert keeper.positions() == ()
        said: list = []  # the receiver thread (a sample) never waits: an interrupt may follow
        monkeypatch.setattr(G, "POSITIONS_WAIT", 60.0)
        reader = threading.Thread(target=lambda: said.append(keeper.positions()))
        reader.start()
        reader.join(5)
        assert said == [()]
