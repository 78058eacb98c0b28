"""Healing is one step (issue 35): ``%ddp copy`` of a DDP model, ``--heal``, the death note.

Real pools at 2, 4 and 8 ranks (gloo). A DDP wrapper is copied as its module and
options and wrapped again on every rank with the source's weights, its optimizer
linked to the new parameters; ``Pool(heal=...)`` heals a rank SIGKILLed in a
collective before the next cell, and the next cell's training step works on every
rank; the healed rank's model and optimizer state equal the survivor's (digests).
The death note names modules, optimizers and the largest tensors first, and what
came from the notebook; a copy interrupted while the source packs says so in one
line.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import pytest
import torch

from helpers import collect, healthy, wait_gone
from nbddp import Pool
from nbddp.pool.errors import CaptureError
from nbddp.wire import protocol as P
from tiers import sizes

SIZES = [2, 4, 8]

# the helpers each cell defines again (a healed rank gets model and opt, not these)
HELPERS = """
import hashlib
import torch.distributed as dist

def train_step():
    g = torch.Generator().manual_seed(rank)
    loss = model(torch.randn(16, 8, generator=g)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()

def digest():
    h = hashlib.sha256()
    for k, v in model.module.state_dict().items():
        h.update(k.encode() + v.detach().numpy().tobytes())
    sd = opt.state_dict()
    for i, state in sorted(sd["state"].items()):
        for k, v in sorted(state.items()):
            h.update(f"{i}{k}".encode() + (v.numpy().tobytes() if torch.is_tensor(v) else b""))
    h.update(repr(sd["param_groups"]).encode())
    return h.hexdigest()

def linked():
    return [id(p) for p in opt.param_groups[0]["params"]] == [id(p) for p in model.parameters()]

def options():
    return (type(model).__name__, model.find_unused_parameters, model.bucket_bytes_cap,
            model.gradient_as_bucket_view)
"""
SETUP = """
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)),
            find_unused_parameters=True, bucket_cap_mb=1, gradient_as_bucket_view=True)
opt = torch.optim.Adam(model.parameters(), lr=0.01)
train_step()
"""
OPTIONS = ("DistributedDataParallel", True, 2**20, True)


@pytest.fixture(scope="module", params=sizes(*SIZES))
def heal_pool(request):
    with Pool(request.param, grace=1.0, heal=["model", "opt"]) as pool:
        yield pool


def _setup(pool) -> list[int]:
    healthy(pool)
    pool.execute(HELPERS + SETUP)
    return list(pool.pids)


@pytest.mark.timeout(300)
def test_copy_of_a_ddp_model_and_optimizer_matches_the_source_then_trains(heal_pool):
    pool = heal_pool
    n = pool.world_size
    _setup(pool)
    # every rank's weights differ, and the target's optimizer; the target is rank 0, the
    # rank DDP's constructor broadcasts from
    pool.execute(
        "with torch.no_grad():\n    for p in model.parameters():\n        p.add_(rank)\n"
        "if rank == 0:\n    opt.param_groups[0]['lr'] = 0.5"
    )
    src = n - 1
    before = pool.execute("digest()")
    assert len(set(before)) == n
    done = pool.copy(["model", "opt"], src, [0])
    assert done.rewrapped == ("model",)
    assert done.dst == (0,)
    state = pool.execute("(digest(), linked(), options())")
    assert state[0] == (before[src], True, OPTIONS), state  # the source's model and optimizer
    assert all(s[1:] == (True, OPTIONS) for s in state), state  # every rank wrapped again
    weights = "[p.detach().sum().item() for p in model.parameters()]"
    assert len({tuple(w) for w in pool.execute(weights)}) == 1  # every rank: the source's
    pool.execute("train_step()")  # DDP averages the gradients: every rank takes one step
    assert len({tuple(w) for w in pool.execute(weights)}) == 1
    assert pool.execute("digest()")[0] != before[src]  # it trained


HEALED = (
    r"rank {r}: model, opt healed from rank {s} in [\d.]+ s; "
    "model wrapped again in DDP on every rank"
)


def _when_ready(events, ranks: int, then):
    """Pass events on; call ``then`` once ``ranks`` ranks printed "ready" and 0.3 s passed."""
    ready, at = 0, None
    for event in events:
        if isinstance(event, P.Output):
            ready += event.text.count("ready")
            if ready >= ranks and at is None:
                at = time.monotonic() + 0.3
        if at is not None and time.monotonic() >= at:
            then()
            at = float("inf")
        yield event


@pytest.mark.timeout(300)
def test_heal_after_a_sigkill_in_a_collective_the_next_cell_trains(heal_pool):
    pool = heal_pool
    n = pool.world_size
    bad = n - 2 if n > 2 else 1
    pids = _setup(pool)
    survivor = pool.execute("digest()")[0]
    code = (
        "import time\nt = torch.ones(1)\nprint('ready', flush=True)\n"
        f"if rank == {bad}:\n    time.sleep(60)\ndist.all_reduce(t)"
    )
    _, seen, end = collect(
        _when_ready(pool.run(code, tick=0.05), n, lambda: os.kill(pids[bad], signal.SIGKILL))
    )
    assert P.RankState(bad, "replaced") in seen
    assert any(re.fullmatch(HEALED.format(r=bad, s=0), note) for note in end.notes), end.notes
    assert not any("could not" in note or "lost" in note for note in end.notes), end.notes
    assert pool.pids[bad] != pids[bad]
    # the healed rank holds the survivor's model and optimizer, linked, wrapped as before
    state = pool.execute(HELPERS + "(digest(), linked(), options())")
    assert state == [(survivor, True, OPTIONS)] * n, state
    pool.execute("train_step()")  # the loop goes on: a DDP step on every rank
    weights = pool.execute("[p.detach().sum().item() for p in model.parameters()]")
    assert len({tuple(w) for w in weights}) == 1, weights
    assert wait_gone([pids[bad]]) == []


@pytest.mark.timeout(180)
def test_the_death_note_names_modules_optimizers_and_big_tensors_first():
    with Pool(2, grace=1.0) as pool:
        pool.execute(
            "import os\n"
            + "".join(f"{c} = {i}\n" for i, c in enumerate("abcdefghijklmn"))
            + "zmodel = torch.nn.Linear(64, 64)\nzopt = torch.optim.SGD(zmodel.parameters())\n"
            "ybig = torch.zeros(10_000)\nxsmall = torch.zeros(10)\n",
            needs={"w": torch.ones(3), "cfg": {"lr": 0.1}},
            versions={"w": 1, "cfg": 2},  # as the notebook sends them (else: the rank's own)
        )
        pid = pool.pids[1]
        os.kill(pid, signal.SIGKILL)
        assert wait_gone([pid]) == []
        _, _, end = collect(pool.run("rank"))
    had = [m for note in end.notes if (m := re.fullmatch(
        r"rank 1: a new process took its place; it had (.*) \(gone\) and had imported os", note
    ))]  # fmt: skip
    assert had, end.notes
    said = had[0].group(1).split(", ")
    assert said[:4] == ["zmodel", "zopt", "ybig", "xsmall"], said  # not alphabetically
    assert said[-1] == "and 6 more" or said[-1].endswith("and 6 more"), said
    sent = (
        "rank 1 had w, cfg from the notebook, as it had changed them (gone): a cell that reads "
        "them gets the notebook's again, `%ddp copy` a survivor's"
    )
    assert sent in end.notes, end.notes


@pytest.mark.timeout(180)
def test_a_copy_interrupted_while_the_source_packs_says_so_in_one_line(pool, tmp_path):
    started = tmp_path / "packing"
    pool.execute(
        "import time\nclass Slow:\n    def __reduce__(self):\n"
        f"        open({str(started)!r}, 'w').close()\n        time.sleep(60)\n"
        "        return (int, ())\nslow = Slow()"
    )

    def interrupt_once_packing() -> None:
        deadline = time.monotonic() + 60
        while not started.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        pool.interrupt()

    thread = threading.Thread(target=interrupt_once_packing)
    thread.start()
    try:
        with pytest.raises(CaptureError) as err:
            pool.copy(["slow"], 0)
    finally:
        thread.join()
    assert str(err.value) == "the copy was interrupted while rank 0 packed slow: nothing was copied"
    assert pool.execute("rank") == [0, 1]  # the pool goes on
    assert os.listdir(pool.procs.shm) == []


def test_a_ddp_wrapper_over_a_subgroup_is_refused_in_one_line(pool):
    pool.execute(
        "from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "import torch.distributed as dist\nsolo = [dist.new_group([r]) for r in range(2)]\n"
        "sub = DDP(torch.nn.Linear(2, 2), process_group=solo[rank])"
    )
    with pytest.raises(CaptureError) as err:
        pool.copy(["sub"], 0)
    assert str(err.value) == (
        "rank 0: cannot copy 'sub': its DistributedDataParallel wrapper is over a subgroup (1 "
        "of 2 ranks); copy the model it wraps (sub.module) and wrap it again on each rank"
    )


def test_heal_names_are_checked_before_a_pool_starts():
    with pytest.raises(ValueError, match="heal: not a name: '1x'"):
        Pool(2, heal="model, 1x")
    with pytest.raises(ValueError, match="on_death='restart' replaces no rank"):
        Pool(2, heal=["model"], on_death="restart")
    assert Pool(2, heal="model, opt").heal == ("model", "opt")


FSDP2 = """
from torch.distributed.fsdp import fully_shard
from torch.distributed.device_mesh import init_device_mesh
import torch.distributed as dist
dp = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
fully_shard(net, mesh=dp)
opt = torch.optim.SGD(net.parameters(), lr=0.1)
"""
SHARDED = (
    "cannot copy 'net': it is a module sharded with fully_shard: each rank holds only its "
    "own shard of the one model (a copy between live ranks would change nothing, and a dead "
    "rank's shard died with it); save a checkpoint (torch.distributed.checkpoint) and load "
    "it on every rank"
)


@pytest.mark.timeout(180)
def test_an_fsdp2_model_is_refused_with_the_reason_and_heal_says_it_and_goes_on():
    with Pool(2, grace=1.0, heal=["net", "opt"]) as pool:
        pool.execute(FSDP2)
        with pytest.raises(CaptureError) as err:
            pool.copy(["net", "opt"], 0, [1])
        assert str(err.value) == f"rank 0: {SHARDED}"
        pid = pool.pids[1]
        os.kill(pid, signal.SIGKILL)
        assert wait_gone([pid]) == []
        _, _, end = collect(pool.run("rank"))
        assert f"rank 1: --heal could not copy net, opt from rank 0: rank 0: {SHARDED}" in (
            end.notes
        ), end.notes
        assert pool.execute("('net' in globals(), rank)") == [(True, 0), (False, 1)]
