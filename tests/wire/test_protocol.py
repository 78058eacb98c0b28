from __future__ import annotations

import pickle

import pytest

from nbddp.wire import protocol as P


def test_messages_round_trip():
    msg = P.Run(3, "x = 1", "import os", b"abc", True)
    assert P.loads(P.dumps(msg)) == msg


def test_only_protocol_messages_are_encoded_or_decoded():
    with pytest.raises(TypeError):
        P.dumps({"not": "a message"})
    with pytest.raises(TypeError):
        P.loads(pickle.dumps(["a", "list"]))


def test_end_markers_are_split_out_of_text():
    text = "a\n" + P.end_marker(7).decode() + "b"
    pieces, held = P.split_markers(text)
    assert pieces == ["a\n", 7, "b"]
    assert held == ""


@pytest.mark.parametrize("cut", range(1, len(P.end_marker(12))))
def test_a_marker_split_across_reads_is_held_back_then_found(cut):
    marker = P.end_marker(12).decode()
    pieces, held = P.split_markers("out" + marker[:cut])
    assert pieces == ["out"]
    pieces, held = P.split_markers(held + marker[cut:] + "next")
    assert pieces == [12, "next"]
    assert held == ""


def test_a_nul_that_cannot_start_a_marker_is_not_held():
    pieces, held = P.split_markers("a\x00b")
    assert pieces == ["a\x00b"]
    assert held == ""


def test_slurm_of_keeps_only_plain_values() -> None:
    """A rank's SLURM origin is shown to the user: digits for the job, an int node rank, a plain
    host; anything else (or a part missing) drops it all."""
    ok = {"SLURM_JOB_ID": "4711", "PET_NODE_RANK": "2", "MASTER_ADDR": "node-1.cluster"}
    assert P.slurm_of(ok) == P.Slurm("4711", 2, "node-1.cluster")
    assert P.slurm_of({**ok, "GROUP_RANK": "3"}).node_rank == 3
    assert P.loads(P.dumps(P.Hello(0, 2, 0, 2, 1, "h", False, slurm=P.slurm_of(ok)))).slurm
    for bad in (
        {"SLURM_JOB_ID": "47a1"},
        {"SLURM_JOB_ID": ""},
        {"PET_NODE_RANK": "-1"},
        {"PET_NODE_RANK": "99999999"},
        {"MASTER_ADDR": "host; rm -rf /"},
        {"MASTER_ADDR": "x\nsecond line"},
        {"MASTER_ADDR": ""},
    ):
        assert P.slurm_of({**ok, **bad}) is None, bad


def test_a_slurm_origin_is_checked_on_receipt_and_quoted_in_the_recipe() -> None:
    """Issue 47, item 11: the fields were bounded by the sender only; one holding the token
    could put a shell command into the recipe the notebook tells the user to run."""
    from types import SimpleNamespace

    from nbddp.pool.hosts_lost import recipe
    from nbddp.pool.roster import Roster
    from nbddp.wire.slurm import checked

    good = P.Slurm("4711", 2, "node-1.cluster")
    assert checked(good) == good
    hostile = [
        P.Slurm("1; rm -rf ~", 2, "node-1"),
        P.Slurm("4711", 2, "node-1 $(reboot)"),
        P.Slurm("4711", -1, "node-1"),
        P.Slurm("4711", "2; id", "node-1"),  # type: ignore[arg-type]
        ("4711", 2, "node-1"),
    ]
    for bad in hostile:
        assert checked(bad) is None, bad
    roster = Roster(2, attached=True)
    for rank, slurm in ((0, hostile[0]), (1, good)):
        roster.add(rank, 100 + rank)
        hello = P.Hello(rank, 2, 0, 2, 1, "h", False, slurm=slurm)
        roster._hello(roster[rank], object(), hello, SimpleNamespace(ranks=set()))  # (relayed)
    assert roster[0].slurm is None
    assert roster[1].slurm == good
    said = recipe(SimpleNamespace(roster=roster), [1])
    assert "scontrol write batch_script 4711 nbddp.sh" in said, said
    assert "NBDDP_MASTER_ADDR=node-1.cluster nbddp.sh" in said, said
    assert recipe(SimpleNamespace(roster=roster), [0]) == (
        "start the same launch command on a replacement host"
    )
