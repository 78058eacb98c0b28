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
