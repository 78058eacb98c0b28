"""The listener alone (nbddp.wire.listener): accept, authenticate, refuse and count.

Peers are played by hand on a Unix socket: ``nbddp.HS.connect`` with the right or a
wrong token, raw sockets that send garbage or nothing. Crowds of them, and real ranks
past a crowd: tests/wire/test_listener_crowd.py.
"""

from __future__ import annotations

import errno
import os
import pickle
import queue
import socket
import threading

import pytest

from nbddp.wire import frames
from nbddp.wire import handshake as HS
from nbddp.wire import listener as L
from nbddp.wire import protocol as P

TOKEN = b"the-pools-token"
WAIT = 30  # seconds a queue is waited on before the test fails (never reached when it passes)
WRONG_TOKEN = "it did not prove it holds the token (a wrong token?)"


def client(path: str, token: bytes = TOKEN) -> frames.Channel:
    """An authenticated connection to the listener (``HS.Refused`` for a wrong token)."""
    return HS.connect(path, "AF_UNIX", token, timeout=WAIT)


def hello(rank: int = 0) -> P.Hello:
    return P.Hello(rank, 2, rank, 2, 1000 + rank, "here", False)


class Recording(L.Listener):
    """A listener whose refusals also go to a queue, to wait on them without sleeping."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.refused_q: queue.SimpleQueue = queue.SimpleQueue()

    def refuse_line(self, line: str) -> None:
        super().refuse_line(line)
        self.refused_q.put(line)

    def next_refusal(self) -> str:
        return self.refused_q.get(timeout=WAIT)


class Flaky(socket.socket):
    """A listening socket whose next ``fail`` accepts fail as with too many open files."""

    fail = 0

    def accept(self):
        if self.fail:
            self.fail -= 1
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        return super().accept()


@pytest.fixture
def path(tmp_path):
    return str(tmp_path / "pool.sock")


@pytest.fixture
def started(path):
    """Start a listener (``started(sock=None)``); each is closed and its thread joined."""
    made = []

    def start(sock=None, name="t-listen", **kwargs):
        peers: queue.SimpleQueue = queue.SimpleQueue()
        lis = Recording(
            sock or L.bind_unix(path), TOKEN, lambda *a: peers.put(a), name=name, **kwargs
        ).start()
        lis.peers = peers
        made.append(lis)
        return lis

    yield start
    for lis in made:
        lis.close()  # its thread ends within 0.5 s (test_close_... joins one)


def good_peer(path: str, msg: object = None):
    c = client(path)
    c.send_bytes(P.dumps(msg or hello()))
    return c


def test_a_good_peer_reaches_on_peer_with_its_hello_and_raw_bytes(started, path):
    lis = started()
    c = good_peer(path, hello(1))
    conn, got, raw = lis.peers.get(timeout=WAIT)
    assert got == hello(1)
    assert raw == P.dumps(hello(1))
    conn.send_bytes(b"reply")  # the connection is the peer's, authenticated both ways
    assert c.recv_bytes() == b"reply"
    assert lis.refusals() == []
    conn.close()
    c.close()


def test_a_wrong_token_is_refused(started, path):
    lis = started()
    with pytest.raises(HS.Refused):
        client(path, b"another token")
    assert lis.next_refusal() == f"refused a connection: {WRONG_TOKEN}"
    assert lis.peers.empty()
    assert lis.refusals() == [f"refused a connection: {WRONG_TOKEN}"]


def test_garbage_is_refused(started, path):
    lis = started()
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(path)
        # as many bytes as the answer to the challenge (a nonce and a proof), all garbage
        s.sendall(b"garbage!" * ((HS.NONCE + frames.TAG) // 8))
        line = lis.next_refusal()
    assert line == f"refused a connection: {WRONG_TOKEN}"
    assert lis.peers.empty()


@pytest.mark.parametrize(
    ("first", "says"),
    [
        (b"not a pickle at all", "UnpicklingError"),
        (pickle.dumps({"a": "dict"}), "not a protocol message: dict"),
        (pickle.dumps(print), "UnpicklingError: a control message may not name builtins.print"),
        (pickle.dumps(os.system), f"may not name {os.system.__module__}.system"),
    ],
)
def test_an_authenticated_peer_whose_hello_is_not_a_message_is_refused(started, path, first, says):
    lis = started()
    c = client(path)
    c.send_bytes(first)
    assert says in lis.next_refusal()
    assert lis.peers.empty()
    c.close()


def test_a_silent_peer_does_not_delay_a_good_peer_after_it(started, path, monkeypatch):
    monkeypatch.setattr(L, "HANDSHAKE_TIMEOUT", 3600)  # the silent one would wait an hour
    lis = started()
    silent = socket.socket(socket.AF_UNIX)
    silent.connect(path)
    silent.recv(1)  # the listener is now waiting for its answer to the challenge
    c = good_peer(path, hello(1))
    assert lis.peers.get(timeout=WAIT)[1] == hello(1)
    assert lis.refusals() == []  # the silent one still waits
    silent.close()  # it goes: now it is refused (its unread greeting: reset, or ended)
    assert lis.next_refusal().startswith("refused a connection: ")
    assert lis.peers.empty()
    c.close()


def test_a_first_frame_over_the_hello_limit_is_refused_unread(started, path):
    lis = started()
    c = client(path)
    # a header claiming a terabyte, and no payload: refused on the header alone
    c.sock.sendall(frames.HEADER.pack(0, 1 << 40))
    assert lis.next_refusal() == (
        f"refused a connection: FrameError: a frame of {1 << 40:,} bytes is over the limit "
        f"of {L.HELLO_LIMIT:,}"
    )
    assert lis.peers.empty()
    c.close()


def _closed(sock: socket.socket) -> bool:
    """Whether the listener closed ``sock`` (what it said before is read and dropped)."""
    sock.settimeout(WAIT)
    try:
        while sock.recv(4096):
            pass
    except (ConnectionResetError, BrokenPipeError):
        pass
    return True


def _future_message(monkeypatch) -> bytes:
    """The pickle of a message class that ``nbddp.wire.protocol`` of this version lacks."""

    class NoSuchMessage:
        pass

    NoSuchMessage.__module__ = "nbddp.wire.protocol"
    NoSuchMessage.__qualname__ = "NoSuchMessage"
    monkeypatch.setattr(P, "NoSuchMessage", NoSuchMessage, raising=False)
    data = pickle.dumps(NoSuchMessage())
    monkeypatch.delattr(P, "NoSuchMessage")
    return data


def test_a_hello_naming_a_class_this_version_lacks_says_another_version(started, path, monkeypatch):
    data = _future_message(monkeypatch)
    assert b"NoSuchMessage" in data
    lis = started()
    c = client(path)
    c.send_bytes(data)
    line = lis.next_refusal()
    assert "another nbddp version" in line
    assert f"protocol {P.PROTOCOL_VERSION}" in line
    assert "NoSuchMessage" in line
    c.close()


def test_a_hundred_refusals_for_one_reason_are_one_line(started, path):
    lis = started()
    for _ in range(100):
        with pytest.raises(HS.Refused):
            client(path, b"wrong")
    lines = {lis.next_refusal() for _ in range(100)}
    assert len(lines) == 1
    assert lis.refusals() == [f"{lines.pop()} (100 times)"]


def test_distinct_reasons_are_capped():
    lis = L.Listener(socket.socket(socket.AF_UNIX), TOKEN, lambda *a: None)
    for i in range(L.REASONS_KEPT + 8):
        lis.refuse(("10.0.0.9", 4000 + i), f"reason {i}")
    lis.refuse(("10.0.0.9", 1), "reason 0")  # a reason already kept is still counted
    lines = lis.refusals()
    assert len(lines) == L.REASONS_KEPT + 1
    assert lines[0] == "refused a connection from 10.0.0.9: reason 0 (2 times)"
    assert lines[-1] == "refused connections for other reasons too (8 times)"
    lis.sock.close()


def test_taking_the_refusals_empties_them():
    lis = L.Listener(socket.socket(socket.AF_UNIX), TOKEN, lambda *a: None)
    lis.refuse_line("refused rank 9 of a world of 10: this pool waits for 2 ranks")
    assert lis.refusals(take=True) == [
        "refused rank 9 of a world of 10: this pool waits for 2 ranks"
    ]
    assert lis.refusals() == []
    assert lis.refusals(take=True) == []
    lis.sock.close()


def test_the_accept_loop_survives_a_failed_accept(started, path):
    sock = L.bind_unix(path)
    flaky = Flaky(fileno=sock.detach())
    flaky.fail = 1
    lis = started(flaky)
    c = good_peer(path, hello(1))  # its first accept fails; the next one takes it
    assert lis.peers.get(timeout=WAIT)[1] == hello(1)
    assert flaky.fail == 0
    (line,) = lis.refusals()
    assert "accepting failed" in line
    assert "still listening" in line
    c2 = good_peer(path, hello(0))  # and it goes on accepting
    assert lis.peers.get(timeout=WAIT)[1] == hello(0)
    c.close()
    c2.close()


def test_close_stops_accepting_and_leaves_no_thread(started, path):
    lis = started(name="t-closing")
    (accepting,) = [t for t in threading.enumerate() if t.name == "t-closing-accept"]
    assert lis.open
    silent = socket.socket(socket.AF_UNIX)
    silent.connect(path)
    silent.recv(1)  # in its handshake
    fds = open_fds()
    lis.close()
    assert not lis.open
    assert not lis.running  # once close returned: its thread ended
    assert lis.pending == 0
    assert _closed(silent)  # the handshake in flight was dropped
    assert open_fds() <= fds - 4  # its socket, the listening one, the selector, the wake pipe
    silent.close()
    accepting.join(WAIT)  # it sees the close within its 0.5 s select cycle
    assert not accepting.is_alive()
    with pytest.raises(ConnectionRefusedError):
        HS.connect(path, "AF_UNIX", TOKEN, timeout=0)  # (no retry: nothing listens)
    lis.refuse_line("still readable")
    assert lis.refusals() == ["still readable"]


def open_fds() -> int:
    """Descriptors this process holds now."""
    return len(os.listdir("/proc/self/fd"))
