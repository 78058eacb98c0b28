"""A rank's snapshot of named objects and its rollback (nbddp.rank.keep, issue 48's rank
side), in real ranks at 3 and 8 (gloo, CPU): an FSDP2 model with Adam, a tensor-parallel
module (DTensor), a DDP model with SGD, a tensor and a plain value. After a rollback the
full (gathered) state equals the snapshot's exactly, and the next training step's losses
equal those the same step had right after the snapshot was taken."""

from __future__ import annotations

import pytest

from helpers import healthy

SETUP = """
import os, torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel as DDP
from nbddp.rank import keep
dp = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
torch.manual_seed(0)
fmodel = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
_ = fully_shard(fmodel, mesh=dp)
fopt = torch.optim.Adam(fmodel.parameters(), lr=0.01)
tp = parallelize_module(torch.nn.Linear(8, 4 * world_size), dp, ColwiseParallel())
topt = torch.optim.Adam(tp.parameters(), lr=0.01)
model = DDP(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
counts = torch.zeros(3)
epoch = 0
where = keep.path_of(os.environ["NBDDP_SHM_DIR"], rank)
NAMES = ["fmodel", "fopt", "tp", "topt", "model", "opt", "counts", "epoch"]
"""
NAMES = ["fmodel", "fopt", "tp", "topt", "model", "opt", "counts", "epoch"]

# one training step of all three models, each rank on its own data: every rank's losses
STEP = """
g = torch.Generator().manual_seed(100 * epoch + rank)
x = torch.randn(4, 16, generator=g)
fopt.zero_grad(); topt.zero_grad(); opt.zero_grad()
h = fmodel(x)
a = h.pow(2).mean()
b = tp(h).pow(2).mean()  # (its local output: Shard(-1))
c = model(h.detach()).pow(2).mean()
(a + b).backward(); c.backward()
fopt.step(); topt.step(); opt.step()
counts += 1
epoch += 1
[a.item(), b.item(), c.item()]
"""

# every rank's view of the whole state: DTensors gathered, the optimizers' state too
FULL = """
def _full(v):
    if hasattr(v, "full_tensor"):
        return v.full_tensor().clone()
    if isinstance(v, torch.Tensor):
        return v.detach().clone()
    if isinstance(v, dict):
        return {k: _full(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return type(v)(_full(x) for x in v)
    return v
{n: _full(globals()[n].state_dict() if hasattr(globals()[n], "state_dict") else globals()[n])
 for n in NAMES}
"""


def _same(a, b) -> bool:
    import torch

    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


@pytest.fixture(scope="module")
def built(pool_of_size):
    pool = healthy(pool_of_size)
    pool.execute(SETUP)
    pool.execute(STEP)  # (the optimizers have state: Adam's moments, SGD's momentum)
    return pool


@pytest.mark.timeout(180)
def test_a_rollback_puts_every_kind_back_exactly_and_training_repeats_itself(built):
    pool = built
    n = pool.world_size
    kept = pool.execute("k = keep.take(globals(), NAMES, where)\n(k.names, k.missing, k.nbytes)")
    assert all(names == [*NAMES] and missing == {} for names, missing, _ in kept), kept
    assert all(nbytes > 0 for *_, nbytes in kept), kept
    at_snapshot = pool.execute(FULL)
    first = pool.execute(STEP)  # the step right after the snapshot
    pool.execute(STEP)
    assert not _same(pool.execute(FULL), at_snapshot)  # (training moved everything)
    put = pool.execute("keep.restore(globals(), None, where)")
    assert put == [NAMES] * n
    assert all(_same(got, want) for got, want in zip(pool.execute(FULL), at_snapshot, strict=True))
    assert pool.execute(STEP) == first  # the same step, the same losses, bit for bit


@pytest.mark.timeout(180)
def test_a_new_optimizer_and_a_reset_model_take_the_snapshot_back(built):
    """What a new process has after a death: the objects made again by their cells (a
    fresh Adam with no state, the model's first weights); the snapshot's state goes into
    them, DTensors where the parameters are sharded."""
    pool = built
    pool.execute("keep.take(globals(), NAMES, where)")
    at_snapshot = pool.execute(FULL)
    first = pool.execute(STEP)
    pool.execute(
        "fopt = torch.optim.Adam(fmodel.parameters(), lr=0.5)\n"  # (its lr: the snapshot's)
        "topt = torch.optim.Adam(tp.parameters(), lr=0.01)\n"
        "with torch.no_grad():\n"
        "    for p in fmodel.parameters():\n"
        "        p.to_local().zero_()\n"
        "del counts, epoch"
    )
    pool.execute("keep.restore(globals(), None, where)")
    assert all(_same(got, want) for got, want in zip(pool.execute(FULL), at_snapshot, strict=True))
    kinds = pool.execute(
        "sorted({type(v).__name__ for s in fopt.state.values() for v in s.values()})"
    )
    assert kinds == [["DTensor", "Tensor"]] * pool.world_size  # moments sharded, step a tensor
    assert pool.execute("fopt.param_groups[0]['lr']") == [0.01] * pool.world_size
    assert pool.execute(STEP) == first


@pytest.mark.timeout(120)
def test_what_cannot_be_kept_or_put_back_is_said_by_name(built):
    pool = built
    n = pool.world_size
    got = pool.execute(
        "k = keep.take(globals(), ['opt', 'nothing', 'dp'], where)\n(k.names, k.missing)"
    )
    assert (
        got
        == [
            (
                ["opt"],
                {
                    "nothing": "not defined on this rank",
                    "dp": "a DeviceMesh: only modules, optimizers, tensors and plain values "
                    "are kept",
                },
            )
        ]
        * n
    )
    said = pool.execute(
        "said = None\ntry:\n    keep.restore(globals(), ['model'], where)\n"
        "except keep.KeepError as e:\n    said = str(e)\nsaid"
    )
    assert said == ["model is not in the snapshot (it holds opt)"] * n
    pool.execute("keep.take(globals(), ['model'], where)\nmodel = DDP(torch.nn.Linear(8, 2))")
    said = pool.execute(
        "said = None\ntry:\n    keep.restore(globals(), ['model'], where)\n"
        "except keep.KeepError as e:\n    said = str(e)\nsaid"
    )
    assert (
        said
        == [
            "model cannot take its snapshot back: module.weight changed shape since the snapshot "
            "((1, 8) then, (2, 8) now)"
        ]
        * n
    )
    assert pool.execute("import glob\nglob.glob(where + '.*')") == [[]] * n  # no half file


@pytest.mark.timeout(120)
def test_a_snapshot_of_what_did_not_change_writes_nothing(built):
    """A cell that only read the kept objects costs no copy; a step (in-place changes), a
    tensor made anew (even where a freed one was) and a changed plain value each do."""
    pool = built
    n = pool.world_size
    again = "keep.take(globals(), NAMES, where).unchanged"
    pool.execute("keep.take(globals(), NAMES, where)")
    assert pool.execute(again) == [True] * n
    pool.execute(STEP)
    assert pool.execute(again) == [False] * n
    assert pool.execute(again) == [True] * n
    pool.execute("counts = torch.zeros(3)")  # (a new tensor, its version 0 as a fresh one's)
    assert pool.execute(again) == [False] * n
    pool.execute("epoch = epoch + 0.5")
    assert pool.execute(again) == [False] * n
    pool.execute("x = float(counts.sum()) + epoch + model(torch.ones(1, 8)).sum().item()")
    assert pool.execute(again) == [True] * n
    pool.execute("x = fmodel(torch.ones(1, 16)).sum().item()")  # FSDP2's forward re-shards:
    assert pool.execute(again) == [False] * n  # (counted as a change, to be safe)
