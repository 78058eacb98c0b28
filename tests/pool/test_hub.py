"""The hub alone (nbddp.pool.hub): connections in, typed items out, no worker processes.

A rank is played by hand: its control connection is one end of a pair of
``nbddp.wire.frames`` channels (a socket pair that made the handshake: "plain" mode, as a
rank on a Unix socket; a loopback TCP pair where a test needs TCP's "mac" frames),
its streams are such pairs whose far end the test writes raw bytes into, and the
rank table is a dict of small fakes with ``state``, ``link`` and ``send_bytes``.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import pickle
import socket
import threading
from dataclasses import dataclass, field

import pytest

from nbddp.pool.hub import (
    INLINE,
    Closed,
    Dones,
    Gone,
    Hub,
    Link,
    Mark,
    Msg,
    RelayLink,
    Text,
)
from nbddp.wire import frames as wire
from nbddp.wire import handshake as HS
from nbddp.wire import protocol as P
from nbddp.wire.streams import Stream

TOKEN = b"the-pools-token"


def handshake(server: socket.socket, client: socket.socket) -> tuple[wire.Channel, wire.Channel]:
    """The two ends of a connection that made nbddp's handshake: (server's, client's)."""
    made: dict = {}

    def serve() -> None:
        try:
            made["server"] = HS.server_handshake(server, TOKEN, 10)
        except BaseException as exc:  # said by the assert below
            made["error"] = exc

    t = threading.Thread(target=serve)
    t.start()
    try:
        theirs = HS.client_handshake(client, TOKEN, 10)
    finally:
        t.join()
    assert "error" not in made, made
    return made["server"], theirs


def plain_pair() -> tuple[wire.Channel, wire.Channel]:
    """A Unix socket pair: frames without MACs, as a rank's on the notebook's machine."""
    return handshake(*socket.socketpair())


def tcp_pair() -> tuple[wire.Channel, wire.Channel]:
    """A loopback TCP pair: MAC'd, numbered frames, as an attached rank's."""
    with socket.create_server(("127.0.0.1", 0)) as lis:
        client = socket.create_connection(lis.getsockname())
        server, _ = lis.accept()
    ours, theirs = handshake(server, client)
    assert (ours.mode, theirs.mode) == ("mac", "mac")
    return ours, theirs


def mac_frame(ch: wire.Channel, seq: int, data: bytes) -> bytes:
    """The bytes of a frame numbered ``seq`` as ``ch`` (a "mac" channel) would send it: to
    replay one, or send one out of order."""
    header = wire.HEADER.pack(seq, len(data))
    assert len(data) <= wire.SMALL  # (one MAC, over header and payload, after the payload)
    return header + data + hmac.new(ch._out_key, header + data, hashlib.sha256).digest()


def raw_writer(ch: wire.Channel) -> socket.socket:
    """The socket under a channel, blocking: a rank's stream on a Unix socket carries raw
    bytes after its StreamHello (the worker makes the socket its fd 1 or 2)."""
    ch.sock.setblocking(True)
    return ch.sock


@dataclass
class FakeRank:
    state: str
    link: Link
    sent: list = field(default_factory=list)

    def send_bytes(self, data: bytes) -> bool:
        self.sent.append(data)
        return True


class Bench:
    """A hub and the far ends of the connections it watches (closed at the end)."""

    def __init__(self) -> None:
        self.hellos: list = []
        self.hub = Hub({}, lambda *a: self.hellos.append(a), list)
        self._close: list = []

    def direct(self, rank: int, state: str = "idle", pair=plain_pair):
        """A rank connected directly: (its record, its control end, its stream ends). The
        stream ends are raw sockets on Unix-socket (plain) pairs, channels on TCP pairs."""
        ours, theirs = pair()
        link = Link(conn=ours)
        writers = {}
        for name in ("stdout", "stderr"):
            a, b = pair()
            stream = link.streams[name] = Stream(a, name)
            self.hub.watch(stream.fd, (rank, stream))
            writers[name] = raw_writer(b) if b.mode == "plain" else b
            self._close += [stream.conn, b]
        self.hub.watch(ours.fileno(), (rank, None))
        self._close += [ours, theirs]
        r = self.hub.ranks[rank] = FakeRank(state, link)
        return r, theirs, writers

    def relay(self, ranks: dict[int, str]):
        """A relay with ``ranks`` (rank -> state) behind it: (the link, the relay's end)."""
        ours, theirs = plain_pair()
        relay = RelayLink(ours, P.RelayHello("hostb", 77))
        self.hub.add_relay(relay)
        for rank, state in ranks.items():
            streams = {n: Stream(None, n) for n in ("stdout", "stderr")}
            self.hub.ranks[rank] = FakeRank(state, Link(ours, relay, streams))
            relay.ranks.add(rank)
        self._close += [ours, theirs]
        return relay, theirs

    def close(self) -> None:
        for c in self._close:
            c.close()
        self.hub.close()


@pytest.fixture
def bench():
    b = Bench()
    yield b
    b.close()


def pump(hub: Hub) -> list:
    """What the hub has now (everything the test wrote is readable before this)."""
    return hub.pump(10.0)


def frame(*items) -> bytes:
    return pickle.dumps(list(items))


# ---------------------------------------------------------------- streams


def test_text_and_an_end_marker_split_over_two_writes_come_out_in_order(bench):
    _, _, w = bench.direct(0)
    marker = P.end_marker(3)
    w["stdout"].sendall(b"hello " + marker[:6])
    assert pump(bench.hub) == [Text(0, "stdout", "hello ")]  # the marker's start held back
    w["stdout"].sendall(marker[6:] + b"after" + P.end_marker(4))
    assert pump(bench.hub) == [
        Mark(0, "stdout", 3),
        Text(0, "stdout", "after"),
        Mark(0, "stdout", 4),
    ]


def test_each_stream_keeps_its_own_pieces(bench):
    _, _, w = bench.direct(0)
    w["stdout"].sendall(b"out" + P.end_marker(1))
    w["stderr"].sendall(b"err" + P.end_marker(1))
    items = pump(bench.hub)
    assert [i for i in items if i.stream == "stdout"] == [
        Text(0, "stdout", "out"),
        Mark(0, "stdout", 1),
    ]
    assert [i for i in items if i.stream == "stderr"] == [
        Text(0, "stderr", "err"),
        Mark(0, "stderr", 1),
    ]


def test_utf8_split_across_reads_is_decoded_whole(bench):
    _, _, w = bench.direct(0)
    data = "aé€b".encode()  # é: 2 bytes, €: 3 bytes
    w["stdout"].sendall(data[:2])  # "a" and half of é
    assert pump(bench.hub) == [Text(0, "stdout", "a")]
    w["stdout"].sendall(data[2:4])  # the rest of é, the first byte of €
    assert pump(bench.hub) == [Text(0, "stdout", "é")]
    w["stdout"].sendall(data[4:])
    assert pump(bench.hub) == [Text(0, "stdout", "€b")]


def test_a_stream_that_closes_gives_closed_once_and_what_it_held(bench):
    _, _, w = bench.direct(0)
    w["stdout"].sendall(b"x\x00nbddp-")  # could be a marker's start: held back
    assert pump(bench.hub) == [Text(0, "stdout", "x")]
    w["stdout"].close()
    assert pump(bench.hub) == [Text(0, "stdout", "\x00nbddp-"), Closed(0, "stdout")]
    assert bench.hub.pump(0) == []  # unwatched: no second Closed
    assert bench.hub.ranks[0].link.open_streams() == {"stderr"}


def test_a_tcp_stream_comes_in_frames_markers_and_utf8_split_over_them(bench):
    _, _, w = bench.direct(0, pair=tcp_pair)
    marker = P.end_marker(3)
    e = "é".encode()
    w["stdout"].send_bytes(b"hello " + marker[:6])
    assert pump(bench.hub) == [Text(0, "stdout", "hello ")]
    w["stdout"].send_bytes(marker[6:] + b"a" + e[:1])
    assert pump(bench.hub) == [Mark(0, "stdout", 3), Text(0, "stdout", "a")]
    w["stdout"].send_bytes(e[1:])
    assert pump(bench.hub) == [Text(0, "stdout", "é")]
    w["stdout"].close()
    assert pump(bench.hub) == [Closed(0, "stdout")]


def test_a_tcp_stream_whose_frame_fails_its_check_ends_unread(bench):
    _, _, w = bench.direct(0, pair=tcp_pair)
    w["stdout"].send_bytes(b"before ")
    assert pump(bench.hub) == [Text(0, "stdout", "before ")]
    forged = b"injected on the way"
    w["stdout"].sock.sendall(
        wire.HEADER.pack(1, len(forged)) + bytes(wire.HEADER_TAG) + forged + bytes(wire.TAG)
    )
    why = "its stdout failed a check: a frame failed its MAC check (changed or injected on the way)"
    # none of it as text; the stream ends, and its rank is gone, with the reason said
    assert pump(bench.hub) == [Closed(0, "stdout"), Gone(0, why)]
    assert bench.hub.ranks[0].link.streams["stdout"].conn.closed
    assert bench.hub.closed == [f"rank 0's connection was closed: {why}"]


# ---------------------------------------------------------------- control


def test_a_control_message_is_a_msg(bench):
    _, control, _ = bench.direct(2)
    control.send_bytes(P.dumps(P.Progress(3, 10, "epochs")))
    assert pump(bench.hub) == [Msg(2, P.Progress(3, 10, "epochs"))]


def test_a_closed_control_connection_is_gone(bench):
    _, control, _ = bench.direct(1)
    control.close()
    assert pump(bench.hub) == [Gone(1)]


def test_a_tcp_control_message_is_a_msg(bench):
    _, control, _ = bench.direct(2, pair=tcp_pair)
    control.send_bytes(P.dumps(P.Progress(3, 10, "epochs")))
    control.send_bytes(P.dumps(P.Progress(4, 10, "epochs")))
    items = pump(bench.hub)
    if len(items) == 1:  # (the second frame came after the first read)
        items += pump(bench.hub)
    assert items == [Msg(2, P.Progress(3, 10, "epochs")), Msg(2, P.Progress(4, 10, "epochs"))]


def _gone_and_said(bench, rank: int) -> str:
    """The one item of the next pump: the rank's Gone, with the reason also in
    ``hub.closed``; its connection closed. Returns the reason."""
    (gone,) = pump(bench.hub)
    assert type(gone) is Gone
    assert gone.rank == rank
    assert bench.hub.closed == [f"rank {rank}'s connection was closed: {gone.why}"]
    assert bench.hub.ranks[rank].link.conn.closed
    return gone.why


def test_an_injected_frame_on_a_tcp_control_connection_closes_it_and_says_why(bench):
    _, control, _ = bench.direct(1, pair=tcp_pair)
    control.send_bytes(P.dumps(P.Progress(1, 2)))
    assert pump(bench.hub) == [Msg(1, P.Progress(1, 2))]
    # the next frame's number, but a MAC made without the key
    forged = P.dumps(P.Progress(2, 2))
    control.sock.sendall(
        wire.HEADER.pack(1, len(forged)) + bytes(wire.HEADER_TAG) + forged + bytes(wire.TAG)
    )
    why = _gone_and_said(bench, 1)
    assert why == (
        "a frame failed its check: a frame failed its MAC check (changed or injected on the way)"
    )


def test_a_replayed_frame_on_a_tcp_control_connection_closes_it_and_says_why(bench):
    _, control, _ = bench.direct(1, pair=tcp_pair)
    first = mac_frame(control, 0, P.dumps(P.Progress(1, 2)))
    control.sock.sendall(first)
    assert pump(bench.hub) == [Msg(1, P.Progress(1, 2))]
    control.sock.sendall(first)  # recorded on the way and sent again: a valid MAC
    why = _gone_and_said(bench, 1)
    assert "a frame came out of order (number 0, expected 1" in why


def test_a_control_message_naming_another_class_is_not_run_and_closes_it(bench, tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.mkdir, (str(tmp_path / "ran"),))

    _, control, _ = bench.direct(0)
    control.send_bytes(pickle.dumps(Evil()))
    why = _gone_and_said(bench, 0)
    assert why == (
        "it sent what is not a message "
        f"(a control message may not name {os.mkdir.__module__}.mkdir)"
    )
    assert not (tmp_path / "ran").exists()


def test_a_dead_ranks_connections_are_unwatched_and_give_nothing(bench):
    r, control, w = bench.direct(0)
    r.state = "dead"
    control.send_bytes(P.dumps(P.Progress(1, 2)))
    w["stdout"].sendall(b"late")
    assert pump(bench.hub) == []
    r.state = "idle"  # even wanted again, the hub no longer reads those fds
    assert bench.hub.pump(0) == []


def test_a_rank_without_a_connection_is_unwatched(bench):
    r, control, _ = bench.direct(0)
    r.link.conn = None  # the pool closed it
    control.send_bytes(P.dumps(P.Progress(1, 2)))
    assert pump(bench.hub) == []
    assert bench.hub.pump(0) == []


def test_wake_ends_a_pump_without_timeout_from_another_thread(bench):
    bench.direct(0)
    waker = threading.Thread(target=bench.hub.wake)
    waker.start()
    assert bench.hub.pump(None) == []  # (pytest-timeout ends the test if it never returns)
    waker.join()


def test_an_arrived_connection_is_attached_in_the_pumps_thread(bench):
    ours, theirs = plain_pair()
    hello = P.StreamHello(0, 1, "stdout")
    seen = []
    bench.hub.on_hello = lambda *a: seen.append((threading.current_thread(), a))
    t = threading.Thread(target=bench.hub.arrive, args=(ours, hello))
    t.start()
    t.join()
    assert seen == []  # not in the listener's thread
    assert bench.hub.pump(None) == []
    assert seen == [(threading.current_thread(), (ours, hello, None))]
    ours.close()
    theirs.close()


def test_an_exit_sentinel_gives_gone_for_ranks_that_ended_once_each(bench):
    _, control, _ = bench.direct(0)
    bench.direct(1)
    r_fd, w_fd = os.pipe()
    bench.hub.sentinels = lambda: [r_fd]
    bench.hub.exits = lambda: [0, 1]
    control.close()  # rank 0's control connection ends too
    os.close(w_fd)  # the sentinel becomes readable
    try:
        items = pump(bench.hub)
        assert sorted(i.rank for i in items) == [0, 1]
        assert all(type(i) is Gone for i in items)
    finally:
        bench.hub.unwatch(r_fd)
        os.close(r_fd)


def test_a_sentinel_whose_fd_number_was_reused_is_watched(bench):
    bench.direct(0)
    old_r, old_w = os.pipe()
    bench.hub.sentinels = lambda: [old_r]
    bench.hub.exits = lambda: [0]
    assert bench.hub.pump(0) == []  # the sentinel is registered
    # the launcher reaps the rank and closes its pidfd (the pool's teardown says so); the
    # restarted rank's pidfd gets the same number (forced with dup2 here)
    bench.hub.forget_sentinels()
    new_r, new_w = os.pipe()
    os.dup2(new_r, old_r)
    os.close(new_r)
    os.close(old_w)
    os.close(new_w)  # the new rank has ended: its sentinel is readable
    try:
        assert bench.hub.pump(0) == [Gone(0)]
    finally:
        bench.hub.unwatch(old_r)
        os.close(old_r)


# ---------------------------------------------------------------- relays


def test_relay_frames_become_the_same_items_dead_ranks_filtered(bench):
    relay, far = bench.relay({1: "running", 2: "running", 3: "dead"})
    done = P.Done(7, "ok", value_repr="1")
    hello = P.Hello(4, 5, 0, 1, 999, "hostb", False)
    far.send_bytes(
        frame(
            ("out", 1, "stdout", b"hi "),
            ("out", 3, "stdout", b"from the dead"),
            ("done", (1, 2, 3), P.dumps(done)),
            ("msg", 2, P.dumps(P.Progress(1, 2))),
            ("msg", 3, P.dumps(P.Progress(1, 2))),
            ("gone", 3),
            ("gone", 2),
            ("hello", 4, P.dumps(hello)),
        )
    )
    assert pump(bench.hub) == [
        Text(1, "stdout", "hi "),
        Dones((1, 2), done),
        Msg(2, P.Progress(1, 2)),
        Gone(2),
    ]
    assert bench.hellos == [(relay.conn, hello, relay)]


def test_relayed_utf8_is_decoded_across_frames(bench):
    _, far = bench.relay({1: "running"})
    e = "é".encode()
    far.send_bytes(frame(("out", 1, "stderr", b"a" + e[:1])))
    assert pump(bench.hub) == [Text(1, "stderr", "a")]
    far.send_bytes(frame(("out", 1, "stderr", e[1:] + b"b")))
    assert pump(bench.hub) == [Text(1, "stderr", "éb")]


def test_relayed_end_markers_and_text_split_over_frames(bench):
    _, far = bench.relay({1: "running"})
    far.send_bytes(frame(("out", 1, "stdout", b"a\x00nbddp-en")))
    assert pump(bench.hub) == [Text(1, "stdout", "a")]
    far.send_bytes(frame(("out", 1, "stdout", b"d-4\x00b")))
    assert pump(bench.hub) == [Mark(1, "stdout", 4), Text(1, "stdout", "b")]


def test_a_closed_relay_is_gone_for_each_live_rank_behind_it(bench):
    relay, far = bench.relay({1: "running", 2: "idle", 3: "dead"})
    far.close()
    assert pump(bench.hub) == [Gone(1), Gone(2)]
    assert relay.conn.closed
    assert bench.hub.pump(0) == []  # unwatched: said once


class _Evil:
    """Unpickled, it would make a folder: a relay's frame must never run it."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


@pytest.mark.parametrize("where", ["frame", "done"])
def test_a_relay_frame_naming_another_class_is_not_run_and_closes_the_relay(bench, tmp_path, where):
    relay, far = bench.relay({1: "running", 2: "dead"})
    evil = _Evil(str(tmp_path / "ran"))
    if where == "frame":  # the frame itself
        far.send_bytes(pickle.dumps([("out", 1, "stdout", b"x"), evil]))
    else:  # a message inside a well-formed frame
        far.send_bytes(frame(("done", (1,), pickle.dumps(evil))))
    why = f"what it sent failed a check: a control message may not name {os.mkdir.__module__}.mkdir"
    assert pump(bench.hub) == [Gone(1, why)]
    assert bench.hub.closed == [f"the connection of host hostb's relay was closed: {why}"]
    assert relay.conn.closed
    assert not (tmp_path / "ran").exists()
    assert bench.hub.pump(0) == []  # unwatched: said once


def test_a_relay_frame_over_the_limit_closes_the_relay_before_it_is_read(bench, monkeypatch):
    monkeypatch.setattr(wire, "MAX_FRAME", 1 << 20)
    relay, far = bench.relay({1: "running"})
    far.sock.sendall(wire.HEADER.pack(0, 1 << 30))  # a gigabyte claimed, nothing sent
    why = (
        f"what it sent failed a check: a frame of {1 << 30:,} bytes is over the limit "
        f"of {1 << 20:,}"
    )
    assert pump(bench.hub) == [Gone(1, why)]
    assert bench.hub.closed == [f"the connection of host hostb's relay was closed: {why}"]
    assert relay.conn.closed


# ---------------------------------------------------------------- sending


def test_deliver_sends_one_frame_per_relay_and_directly_to_the_others(bench):
    r0, _, _ = bench.direct(0)
    _, far_a = bench.relay({1: "idle", 2: "idle", 3: "dead"})
    _, far_b = bench.relay({4: "idle"})
    data = P.dumps(P.Run(5, "x = 1"))
    bench.hub.deliver([0, 1, 2, 3, 4], data, cell=5)
    assert r0.sent == [data]
    assert pickle.loads(far_a.recv_bytes()) == ((1, 2), 5, data)
    assert not far_a.poll(0)  # one frame for both ranks
    assert pickle.loads(far_b.recv_bytes()) == ((4,), 5, data)
    assert not far_b.poll(0)


def test_a_big_message_follows_its_frame_as_it_is(bench):
    _, far = bench.relay({1: "idle", 2: "idle"})
    data = b"\x01" * (INLINE + 1)
    # (in a thread: the message may be more than the socket holds before it is read)
    sender = threading.Thread(target=bench.hub.deliver, args=([1, 2], data))
    sender.start()
    assert pickle.loads(far.recv_bytes()) == ((1, 2), 0, None)
    assert far.recv_bytes() == data
    sender.join()
    small = b"\x02" * INLINE  # at the limit: inside the frame
    bench.hub.deliver([1], small)
    assert pickle.loads(far.recv_bytes()) == ((1,), 0, small)
    assert not far.poll(0)


# ---------------------------------------------------------------- log and drain


def test_the_log_sees_every_text_and_no_marker(bench):
    _, _, w = bench.direct(0)
    _, far = bench.relay({1: "running"})
    logged = []
    bench.hub.log = lambda *a: logged.append(a)
    w["stdout"].sendall(b"one" + P.end_marker(1) + b"two")
    w["stderr"].sendall(b"three")
    far.send_bytes(frame(("out", 1, "stdout", b"four")))
    items = pump(bench.hub)
    texts = [(i.rank, i.stream, i.text) for i in items if type(i) is Text]
    assert sorted(logged) == sorted(texts)
    assert sorted(logged) == sorted(
        [(0, "stdout", "one"), (0, "stdout", "two"), (0, "stderr", "three"), (1, "stdout", "four")]
    )
    w["stdout"].sendall(b"five")
    w["stdout"].close()
    assert [i.text for i in bench.hub.drain(0)] == ["five"]
    assert logged[-1] == (0, "stdout", "five")


def test_drain_gives_what_a_rank_wrote_without_waiting(bench):
    _, _, w = bench.direct(0)
    w["stdout"].sendall(b"last words" + P.end_marker(2))
    w["stderr"].sendall(b"err")  # still open: drain does not wait for its end
    drained = bench.hub.drain(0)
    assert drained == [Text(0, "stdout", "last words"), Text(0, "stderr", "err")]
