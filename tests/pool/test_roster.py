"""The roster alone (nbddp.pool.roster): the rank table, how ranks attach, the handshake.

Connections are fakes that record what is sent and whether they were closed; the
hub is a fake that records what the roster asks of it and whose ``pump`` plays a
script of items.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import pytest

from nbddp.pool.errors import PoolStartError
from nbddp.pool.hub import Gone, Msg, RelayLink, Text
from nbddp.pool.roster import Roster
from nbddp.wire import protocol as P

_fds = itertools.count(100)


@dataclass
class FakeConn:
    fd: int = field(default_factory=lambda: next(_fds))
    sent: list = field(default_factory=list)
    closed: bool = False
    mode: str = "plain"  # (a Unix socket's channel)

    def fileno(self) -> int:
        return self.fd

    def send_bytes(self, data: bytes) -> None:
        self.sent.append(P.loads(data))

    def close(self) -> None:
        self.closed = True


class FakeHub:
    def __init__(self, script=()) -> None:
        self.script = list(script)
        self.watched: list = []
        self.relays: list = []
        self.delivered: list = []

    def watch(self, fd, data) -> None:
        self.watched.append((fd, data))

    def add_relay(self, relay) -> None:
        self.relays.append(relay)

    def deliver(self, ranks, data, cell=0) -> None:
        self.delivered.append((list(ranks), P.loads(data)))

    def pump(self, timeout):
        assert self.script, "the handshake waited for more than the script has"
        return self.script.pop(0)


def roster(n: int = 2, attached: bool = False, script=()) -> Roster:
    ros = Roster(n, attached)
    ros.hub = FakeHub(script)
    if not attached:
        for rank in range(n):
            ros.add(rank, 1000 + rank)
    return ros


def hello(rank: int, n: int = 2, version: int = P.PROTOCOL_VERSION, host="here") -> P.Hello:
    return P.Hello(rank, n, rank, n, 2000 + rank, host, rank == 0, version)


def connect(ros: Roster, rank: int, relay=None, **kw) -> dict[str, FakeConn]:
    """Rank ``rank`` says Hello and its two StreamHellos: its connections."""
    conns = {"control": FakeConn(), "stdout": FakeConn(), "stderr": FakeConn()}
    ros.attach(conns["control"], hello(rank, ros.world_size, **kw), relay)
    for name in ("stdout", "stderr"):
        ros.attach(conns[name], P.StreamHello(rank, 2000 + rank, name), relay)
    return conns


def no_exit(_r):
    return None


def no_tail(_rank):
    return ""


# ---------------------------------------------------------------- attaching


def test_a_local_ranks_hello_and_streams_complete_its_record():
    ros = roster()
    conns = connect(ros, 1, host="node-a")
    r = ros[1]
    assert r.link.conn is conns["control"]
    assert (r.pid, r.host) == (2001, "node-a")
    assert r.link.connected
    assert set(r.link.streams) == {"stdout", "stderr"}
    assert ros.hub.watched == [
        (conns["control"].fd, (1, None)),
        (conns["stdout"].fd, (1, r.link.streams["stdout"])),
        (conns["stderr"].fd, (1, r.link.streams["stderr"])),
    ]
    assert not ros[0].link.connected


def test_a_hello_from_a_rank_a_local_pool_did_not_start_is_closed():
    ros = roster()
    stranger = FakeConn()
    ros.attach(stranger, hello(5, 6))
    assert stranger.closed
    assert 5 not in ros.ranks
    ros[1].state = "dead"
    late = FakeConn()
    ros.attach(late, hello(1))
    assert late.closed
    assert ros[1].link.conn is None


def test_on_join_counts_the_ranks_as_they_say_hello():
    ros = roster(3)
    joins = []
    ros.on_join = lambda *a: joins.append(a)
    connect(ros, 2)
    connect(ros, 0)
    assert joins == [(3, 3), (3, 3)]  # a local pool knows its ranks from the start
    att = roster(3, attached=True)
    att.on_join = lambda *a: joins.append(a)
    connect(att, 2)
    connect(att, 0)
    assert joins[2:] == [(1, 3), (2, 3)]


def test_a_relays_hello_adds_a_relay_and_its_ranks_attach_through_it():
    ros = roster(2, attached=True)
    relay_conn = FakeConn()
    ros.attach(relay_conn, P.RelayHello("node-b", 55))
    (relay,) = ros.hub.relays
    assert isinstance(relay, RelayLink)
    assert (relay.conn, relay.host, relay.pid) == (relay_conn, "node-b", 55)
    connect(ros, 1, relay=relay)
    r = ros[1]
    assert r.link.relay is relay
    assert relay.ranks == {1}
    assert r.link.connected
    assert all(s.conn is None for s in r.link.streams.values())
    assert ros.hub.watched == []  # the relay's connection is the hub's to watch


def test_a_relay_of_another_protocol_version_is_an_error():
    ros = roster(2, attached=True)
    conn = FakeConn()
    with pytest.raises(PoolStartError, match="the relay of node-b speaks protocol 3, the notebook"):
        ros.attach(conn, P.RelayHello("node-b", 55, version=3))
    assert conn.closed
    assert ros.hub.relays == []


def test_a_rank_of_another_protocol_version_is_an_error_naming_both():
    ros = roster()
    conn = FakeConn()
    with pytest.raises(PoolStartError) as err:
        ros.attach(conn, hello(1, version=P.PROTOCOL_VERSION + 1))
    assert f"rank 1 speaks protocol {P.PROTOCOL_VERSION + 1}" in str(err.value)
    assert f"the notebook {P.PROTOCOL_VERSION}" in str(err.value)
    assert conn.closed
    assert ros[1].link.conn is None


# ---------------------------------------------------------------- attached pools


def test_an_attached_pool_refuses_a_hello_of_another_world_size():
    ros = roster(2, attached=True)
    refused = []
    ros.refuse = refused.append
    conn = FakeConn()
    ros.attach(conn, hello(1, 3))
    assert conn.closed
    assert ros.ranks == {}
    assert refused == ["refused rank 1 of a world of 3: this pool waits for 2 ranks"]
    outside = FakeConn()
    ros.attach(outside, P.Hello(2, 2, 0, 1, 9, "h", False))  # rank 2 of a world of 2
    assert outside.closed
    assert len(refused) == 2
    assert ros.ranks == {}


@pytest.mark.parametrize("attached", [False, True])
def test_a_second_hello_for_a_connected_rank_is_refused_and_the_first_kept(attached):
    ros = roster(2, attached=attached)
    refused = []
    ros.refuse = refused.append
    first = connect(ros, 1)
    again = FakeConn()
    ros.attach(again, hello(1))
    assert again.closed
    assert ros[1].link.conn is first["control"]
    assert [w for w in ros.hub.watched if w[1] == (1, None)] == [(first["control"].fd, (1, None))]
    assert refused == ["refused a second connection for rank 1: it is connected"]


def test_a_new_worker_for_a_dead_attached_rank_is_turned_away_with_the_reason():
    """torchrun --max-restarts: the restarted worker hears why at once (it waited forever),
    and the notebook counts it; its streams just close."""
    ros = roster(2, attached=True)
    refused = []
    ros.refuse = refused.append
    connect(ros, 1)
    ros[1].state = "dead"
    again = connect(ros, 1, host="node-b")
    assert [type(m) for m in again["control"].sent] == [P.Refused]
    assert "torchrun --max-restarts" in again["control"].sent[0].reason
    assert again["stdout"].closed
    assert again["stderr"].closed
    assert refused == [f"turned away rank 1 of node-b: {again['control'].sent[0].reason}"]
    ros.clear()
    assert again["control"].closed  # kept open until then: it reads why before the close


class PlainConn(FakeConn):
    """A relay's connection: its frames are plain data (nbddp.hosts.relay)."""

    def send_bytes(self, data: bytes) -> None:
        self.sent.append(P.loads_plain(data))


def test_a_stopped_attached_pool_turns_every_worker_away_as_it_comes():
    ros = roster(2, attached=True)
    ros.refuse = lambda _line: None
    ros.closed_to = "stopped"
    conn, relay = FakeConn(), PlainConn()
    ros.arrive(conn, hello(0))
    assert conn.sent == [P.Refused("stopped")]
    ros.arrive(relay, P.RelayHello("node-b", 7))
    sent = relay.sent  # (what a relay gets: (ranks, cell, message) in one frame)
    assert sent == [((), 0, P.dumps(P.Refused("stopped")))]
    assert ros.ranks == {}


def test_a_stream_before_its_hello_is_kept_and_attached_after():
    ros = roster(2, attached=True)
    out, err, control = FakeConn(), FakeConn(), FakeConn()
    ros.attach(out, P.StreamHello(1, 2001, "stdout"))
    ros.attach(err, P.StreamHello(1, 2001, "stderr"))
    assert ros.ranks == {}
    assert not out.closed
    assert not err.closed
    ros.attach(control, hello(1))
    r = ros[1]
    assert r.link.connected
    assert r.link.streams["stdout"].conn is out
    assert r.link.streams["stderr"].conn is err
    assert (out.fd, (1, r.link.streams["stdout"])) in ros.hub.watched


def test_clear_closes_streams_still_waiting_for_their_rank():
    ros = roster(2, attached=True)
    early = FakeConn()
    ros.attach(early, P.StreamHello(1, 2001, "stdout"))
    connect(ros, 0)
    ros.store_port = 29500
    gone = ros.clear()
    assert early.closed
    assert [r.rank for r in gone] == [0]
    assert ros.ranks == {}
    assert ros.store_port is None
    connect(ros, 1)  # nothing of the early stream is left behind for a new rank 1
    assert ros[1].link.streams["stdout"].conn is not early


# ---------------------------------------------------------------- the table


def test_names_on_is_what_every_chosen_rank_has():
    ros = roster(3)
    ros[0].names = frozenset({"a", "b", "c"})
    ros[1].names = frozenset({"b", "c"})
    ros[2].names = frozenset({"c", "d"})
    assert ros.names_on() == {"c"}
    assert ros.names_on([0, 1]) == {"b", "c"}
    assert ros.names_on([2]) == {"c", "d"}
    assert ros.names_on([]) == frozenset()


def test_hosts_only_when_there_are_several():
    ros = roster(2)
    connect(ros, 0, host="node-a")
    connect(ros, 1, host="node-a")
    assert ros.hosts() == {}
    ros[1].host = "node-b"
    assert ros.hosts() == {0: "node-a", 1: "node-b"}


# ---------------------------------------------------------------- the handshake


def ready(backend="gloo", device="cpu", names=()):
    return P.Ready(backend, device, names)


def test_the_handshake_passes_the_store_port_and_ends_when_all_are_ready():
    ros = roster(3, script=[])
    for rank in (2, 0, 1):
        connect(ros, rank)
    ros.hub.script = [
        [Msg(0, P.StorePort(29511)), Text(1, "stdout", "starting\n")],
        [Msg(1, ready(names=("x", "y"))), Msg(0, ready("nccl", "cuda:0"))],
        [Msg(2, ready())],
    ]
    ros.handshake(60, no_exit, no_tail)
    assert ros.hub.delivered == [([1, 2], P.JoinGroup(29511))]
    assert ros.store_port == 29511
    assert ros.backlog == [P.Output(1, "stdout", "starting\n")]
    assert (ros[0].state, ros[0].backend, ros[0].device) == ("idle", "nccl", "cuda:0")
    assert ros[1].names == {"x", "y"}
    assert ros.started
    assert list(ros.ranks) == [0, 1, 2]
    assert ros.hub.script == []


def test_a_rank_that_says_hello_after_the_store_port_is_told_to_join():
    ros = roster(2)
    connect(ros, 0)
    ros.set_store_port(29512)
    assert ros.hub.delivered == [([], P.JoinGroup(29512))]  # rank 1 had no connection yet
    conns = connect(ros, 1)
    assert conns["control"].sent == [P.JoinGroup(29512)]


def test_the_handshake_waits_for_the_streams_too():
    ros = roster(1)
    control = FakeConn()
    ros.attach(control, hello(0, 1))
    ros.hub.script = [
        [Msg(0, ready())],
        [],  # idle but without streams: not ready yet
    ]
    with pytest.raises(AssertionError, match="more than the script"):
        ros.handshake(60, no_exit, no_tail)
    assert ros[0].state == "idle"
    assert not ros.ready()


def test_a_fatal_rank_fails_the_start_with_its_traceback():
    ros = roster(2)
    connect(ros, 0)
    connect(ros, 1)
    info = P.ErrorInfo("ImportError", "no torch", "Traceback ...\nImportError: no torch\n")
    ros.hub.script = [[Msg(1, P.Fatal(info))]]
    with pytest.raises(PoolStartError) as err:
        ros.handshake(60, no_exit, no_tail)
    assert str(err.value).startswith("rank 1 failed to start:\n")
    assert "ImportError: no torch" in str(err.value)


def test_a_rank_gone_while_starting_fails_the_start_with_its_exit():
    ros = roster(2)
    connect(ros, 0)
    connect(ros, 1)
    ros.hub.script = [[Msg(0, ready()), Gone(1)]]
    asked = []

    def exit_code(r):
        asked.append(r.rank)
        return -9

    with pytest.raises(PoolStartError) as err:
        ros.handshake(60, exit_code, lambda rank: f"\nlog of rank {rank}")
    assert asked == [1]
    assert str(err.value) == "rank 1 exited while starting (killed by SIGKILL)\nlog of rank 1"


def test_a_handshake_past_its_timeout_names_the_ranks_it_waits_for():
    ros = roster(3)
    connect(ros, 0)
    ros[0].state = "idle"
    with pytest.raises(PoolStartError) as err:
        ros.handshake(0, no_exit, lambda rank: f" (tail of {rank})")
    assert str(err.value) == "ranks [1, 2] did not start within 0 s (tail of 1)"


def test_a_cancelled_handshake_stops_waiting():
    ros = roster(2, script=[[]])
    with pytest.raises(PoolStartError, match="interrupted while waiting"):
        ros.handshake(60, no_exit, no_tail, cancelled=lambda: True)
    assert ros.hub.script == [[]]  # it did not wait at all


def test_an_attached_handshake_waits_for_ranks_in_any_order():
    ros = roster(2, attached=True)
    ros.hub.script = [[Msg(1, ready())], [Msg(0, ready())]]
    connect(ros, 1)
    connect(ros, 0)
    ros.handshake(60, no_exit, no_tail)
    assert list(ros.ranks) == [0, 1]
    assert ros.started
