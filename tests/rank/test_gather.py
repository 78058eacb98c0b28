"""``nbddp.gather_objects`` and ``nbddp.gather_tensors`` on one host, at 2, 3, 4 and 8
ranks: to the first rank listed, in the order listed, for all ranks, a subset and a
subgroup; through shared memory, a workspace folder and the process group (the path
taken across hosts, forced here with ``LOCAL_WORLD_SIZE``). Two hosts: test_netns.py.

Each rank's object is made from its rank by ``make``; the expected list is made in
this process by the same function, so the answer is Python's, not ours.
"""

from __future__ import annotations

import os
import textwrap

import pytest
import torch

from helpers import healthy

VIAS = ("shm", "workspace", "group")

SETUP = textwrap.dedent(
    """
    import os, torch, torch.distributed as dist
    from nbddp import gather_objects, gather_tensors

    def make(r):  # a config and weights, one tensor big enough to go as a file of its own
        return {"layer": f"block{r}", "dims": [r, r + 1], "w": torch.full((300_000,), float(r)),
                "b": torch.arange(5) * r}

    def through(via, call):
        before = os.environ.get("LOCAL_WORLD_SIZE")
        if via == "group":  # as if the ranks were on several hosts
            os.environ["LOCAL_WORLD_SIZE"] = "1"
        try:
            return call(WS if via == "workspace" else None)
        finally:
            os.environ["LOCAL_WORLD_SIZE"] = before

    members = list(range(1, world_size)) if world_size > 2 else [0, 1]
    sub = dist.new_group(members)

    import nbddp.rank.collectives as C
    real_gather, seen = C.dist.gather_object, []

    def spy(*args, **kwargs):  # what the folders held when the objects' names came in
        out = real_gather(*args, **kwargs)
        here = lambda d: sorted(n.split("-")[0] for n in os.listdir(d)) if os.path.isdir(d) else []
        seen.append((here(WS), here(os.environ["NBDDP_SHM_DIR"])))
        return out

    C.dist.gather_object = spy

    def mapped():  # files of the workspace this rank still maps (NFS may not keep them)
        with open("/proc/self/maps") as f:
            return [line.split()[-2] for line in f if WS in line]
    """
)


def make(r: int) -> dict:
    return {
        "layer": f"block{r}",
        "dims": [r, r + 1],
        "w": torch.full((300_000,), float(r)),
        "b": torch.arange(5) * r,
    }


def same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return str(tmp_path_factory.mktemp("ws") / "shared")


@pytest.fixture
def gpool(pool_of_size, workspace):
    pool = healthy(pool_of_size)
    if "make" not in pool.names_on():
        pool.execute(f"WS = {workspace!r}\n" + SETUP)
    yield pool
    # every call leaves nothing: not in the workspace, not in the pool's own folder
    assert not os.path.exists(workspace) or os.listdir(workspace) == []
    assert os.listdir(pool.procs.shm) == []


def orders(n: int) -> dict[str, list[int] | None]:
    """Everyone (default), everyone backwards, and a subset led by the last rank."""
    return {
        "all": None,
        "reversed": list(range(n))[::-1],
        "subset": [n - 1, *range(0, n - 1, 2)],
    }


@pytest.mark.timeout(180)
@pytest.mark.parametrize("via", VIAS)
def test_objects_reach_the_first_listed_rank_in_the_order_listed(gpool, via):
    n = gpool.world_size
    for name, ranks in orders(n).items():
        got = gpool.execute(
            f"out = through({via!r}, lambda ws: gather_objects(make(rank), {ranks!r}, "
            "workspace=ws))\nout"
        )
        listed = list(range(n)) if ranks is None else ranks
        for r in range(n):
            if r == listed[0]:
                expected = [make(q) for q in listed]
                assert len(got[r]) == len(listed), (name, r)
                assert all(same(a, b) for a, b in zip(got[r], expected, strict=True)), name
            else:
                assert got[r] == [], (name, r)
        # the objects went the way asked: each listed rank but the first wrote a folder
        folders = gpool.execute("seen[-1]", ranks=[listed[0]])[listed[0]]
        wrote = ["gather"] * (len(listed) - 1)
        assert folders == {"shm": ([], wrote), "workspace": (wrote, []), "group": ([], [])}[via]
        # what came through the workspace was read into memory, not mapped from its files
        assert gpool.execute("mapped()") == [[]] * n
    # the first rank's own entry is its object itself, not a copy
    assert gpool.execute(
        f"obj = make(rank)\nout = through({via!r}, lambda ws: gather_objects(obj, workspace=ws))\n"
        "out[0] is obj if rank == 0 else out"
    ) == [True] + [[]] * (n - 1)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("via", VIAS)
@pytest.mark.parametrize("size", [3, 300_000], ids=["small", "big"])
def test_tensors_reach_the_first_listed_rank_in_the_order_listed(gpool, via, size):
    n = gpool.world_size
    for dtype in ("float32", "int64", "bfloat16"):
        for name, ranks in orders(n).items():
            got = gpool.execute(
                f"t = (torch.arange({size}) * (rank + 1)).to(torch.{dtype})\n"
                f"out = through({via!r}, lambda ws: gather_tensors(t, {ranks!r}, workspace=ws))\n"
                "out"
            )
            listed = list(range(n)) if ranks is None else ranks
            want = [(torch.arange(size) * (q + 1)).to(getattr(torch, dtype)) for q in listed]
            first = got[listed[0]]
            assert [(t.dtype, t.shape) for t in first] == [(w.dtype, w.shape) for w in want]
            assert all(torch.equal(a, b) for a, b in zip(first, want, strict=True)), (name, dtype)
            assert all(got[r] == [] for r in range(n) if r != listed[0]), name


@pytest.mark.timeout(180)
@pytest.mark.parametrize("via", VIAS)
def test_a_subgroup_gathers_to_its_first_rank_and_the_others_do_not_call(gpool, via):
    n = gpool.world_size
    members = list(range(1, n)) if n > 2 else [0, 1]
    for ranks in (None, members[::-1], [members[-1], members[0]]):
        got = gpool.execute(
            f"out = (through({via!r}, lambda ws: gather_objects(make(rank), {ranks!r}, "
            "group=sub, workspace=ws)) if rank in members else 'not called')\nout"
        )
        listed = members if ranks is None else ranks
        for r in range(n):
            if r not in members:
                assert got[r] == "not called"
            elif r == listed[0]:
                expected = [make(q) for q in listed]
                assert all(same(a, b) for a, b in zip(got[r], expected, strict=True)), ranks
            else:
                assert got[r] == [], (ranks, r)
        tensors = gpool.execute(
            f"out = (through({via!r}, lambda ws: gather_tensors(torch.full((4,), rank), "
            f"{ranks!r}, group=sub, workspace=ws)) if rank in members else [])\n"
            "[t.tolist() for t in out]"
        )
        assert tensors[listed[0]] == [[q] * 4 for q in listed]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        ("gather_objects(1, ranks=[0, 0])", "rank 0 is listed twice"),
        ("gather_objects(1, ranks=[])", "ranks is empty: list at least one rank"),
        ("gather_tensors(torch.ones(1), ranks=[0, 99])", "rank 99 is not in the group"),
    ],
    ids=["twice", "empty", "outside"],
)  # fmt: skip
@pytest.mark.timeout(60)  # (a rank that sat in a collective would wait for its 30 min timeout)
def test_a_bad_list_is_one_line_on_every_rank_and_nothing_waits(gpool, call, message):
    got = gpool.execute(
        f"try:\n    {call}\n    r = 'no error'\nexcept ValueError as e:\n    r = str(e)\nr"
    )
    assert all(message in r and "\n" not in r for r in got), got


BAD = {  # what rank n - 1 passes, and what it raises
    "unpicklable": ("threading.Lock()", "WS", "TypeError: cannot pickle '_thread.lock'"),
    "refused-workspace": ("make(rank)", "OPEN", "UnsafeFile: refusing the workspace"),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("via", "bad"),
    # (through shared memory there is no workspace to refuse)
    [
        (via, bad)
        for via in ("shm", "workspace")
        for bad in BAD
        if (via, BAD[bad][1]) != ("shm", "OPEN")
    ],
)
def test_a_rank_that_cannot_write_fails_every_rank_at_once_and_the_pool_lives(
    gpool, via, bad, tmp_path
):
    n = gpool.world_size
    obj, folder, says = BAD[bad]
    open_to_all = tmp_path / "open"
    open_to_all.mkdir()
    open_to_all.chmod(0o777)
    got = gpool.execute(  # (a rank waiting in a collective the others left: the test's timeout)
        f"import threading\nOPEN = {str(open_to_all)!r}\n"
        f"obj = {obj} if rank == {n - 1} else make(rank)\n"
        f"ws = {folder} if rank == {n - 1} else WS\n"
        "try:\n"
        f"    through({via!r}, lambda _: gather_objects(obj, workspace=ws if _ else None))\n"
        "    r = 'no error'\n"
        "except Exception as e:\n"
        "    r = f'{type(e).__name__}: {e}'\n"
        "r"
    )
    assert got[0].startswith(f"RuntimeError: rank {n - 1} could not write its object: {says}")
    assert got[n - 1].startswith(says), got[n - 1]
    assert all(got[r] == "no error" for r in range(1, n - 1)), got
    assert os.listdir(open_to_all) == []
    assert gpool.execute("gather_objects(rank)") == [list(range(n))] + [[]] * (n - 1)


@pytest.mark.at_sizes(3, 4, 8)  # (at 2 ranks the subgroup holds both)
def test_a_rank_outside_the_group_is_told_so(gpool):
    got = gpool.execute(
        "try:\n    gather_objects(1, group=sub)\nexcept ValueError as e:\n    r = str(e)\nr",
        ranks=[0],
    )
    assert got[0] == (f"rank 0 is not in the group (ranks {list(range(1, gpool.world_size))}): "
                   "only they call")  # fmt: skip


def test_one_rank_listed_needs_no_other(gpool):
    n = gpool.world_size
    got = gpool.execute(f"gather_objects(rank, ranks=[{n - 1}]) if rank >= {n - 2} else 'x'")
    assert got[n - 1] == [n - 1]
    assert got[n - 2] == []


@pytest.mark.timeout(120)
def test_copy_goes_through_the_workspace_and_leaves_nothing_there(gpool, workspace):
    n = gpool.world_size
    gpool.execute("w = torch.full((2**19,), float(rank)) + torch.arange(2**19)\ncfg = {'r': rank}")
    gpool.workspace = workspace
    try:
        done = gpool.copy(["w", "cfg"], n - 1)
    finally:
        gpool.workspace = None
    assert done.via == f"through the workspace {workspace}"
    assert done.dst == tuple(range(n - 1))
    assert done.nbytes >= 2 * 2**20
    assert gpool.execute("(w[7].item(), cfg)") == [(n - 1 + 7.0, {"r": n - 1})] * n
    assert gpool.execute("mapped()") == [[]] * n  # read into memory, not mapped
    assert os.listdir(workspace) == []
