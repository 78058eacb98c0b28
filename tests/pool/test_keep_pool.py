"""``Pool(keep=...)``: a snapshot at the end of every clean cell, and ``pool.rollback()``
(nbddp.pool.keeping), at 3 and 8 ranks: an FSDP2 model with Adam, a DDP model with SGD,
a plain value. A training cell that fails halfway on every rank (a loss check) leaves its
steps in the objects; the rollback puts every rank back at the end of the last clean
cell, exactly (the gathered state), and the next training cell's steps repeat the failed
cell's first steps loss for loss."""

from __future__ import annotations

import re

import pytest

from helpers import collect
from nbddp import Pool
from nbddp.pool.errors import CellFailed, NbddpError
from nbddp.pool.facade import raise_for_end
from tiers import sizes

KEEP = ["fmodel", "fopt", "model", "opt", "epoch"]
BUILD = """
from torch.distributed.fsdp import fully_shard
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP
dp = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
torch.manual_seed(0)
fmodel = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
_ = fully_shard(fmodel, mesh=dp)
fopt = torch.optim.Adam(fmodel.parameters(), lr=0.01)
model = DDP(torch.nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
epoch = 0
"""


def train(fail_at: int | None = None) -> str:
    """Four steps on each rank's own data, each loss printed in full; ``fail_at``: every
    rank raises at the start of that step (a loss check), after the steps before it."""
    fail = f"    if step == {fail_at}:\n        raise ValueError('loss check')\n"
    return (
        "for step in range(4):\n"
        + (fail if fail_at is not None else "")
        + "    g = torch.Generator().manual_seed(1000 * epoch + 10 * step + rank)\n"
        "    x = torch.randn(8, 16, generator=g)\n"
        "    fopt.zero_grad(); opt.zero_grad()\n"
        "    a = fmodel(x).pow(2).mean(); b = model(x).pow(2).mean()\n"
        "    (a + b).backward()\n"
        "    fopt.step(); opt.step()\n"
        "    print(f'LOSS {step} {a.item()!r} {b.item()!r}')\n"
        "epoch += 1\n"
    )


FULL = """
{"f": {k: v.full_tensor() for k, v in fmodel.state_dict().items()},
 "fo": [{k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in s.items()}
        for s in fopt.state.values()],
 "d": model.state_dict(), "o": [dict(s) for s in opt.state.values()], "e": epoch}
"""


def _losses(text: dict, rank: int) -> list[tuple[str, str, str]]:
    return re.findall(r"LOSS (\d+) (\S+) (\S+)", text.get((rank, "stdout"), ""))


def _same(a, b) -> bool:
    import torch

    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


@pytest.fixture(scope="module", params=sizes(3, 8), ids=lambda n: f"{n}ranks")
def kept(request):
    with Pool(request.param, keep=KEEP) as pool:
        pool.execute(BUILD)
        yield pool


@pytest.mark.timeout(240)
def test_a_failed_training_cell_is_rolled_back_exactly_and_trains_on_the_same(kept):
    pool = kept
    n = pool.world_size
    pool.execute(train())  # a clean training cell: its end is the snapshot
    snap = pool.snapshot
    assert snap is not None
    assert snap.missing == {}
    assert sorted(snap.nbytes) == list(range(n))
    assert all(b > 0 for b in snap.nbytes.values())
    before = pool.execute(FULL)  # (itself clean: the same state kept again)
    text, _, end = collect(pool.run(train(fail_at=2)))
    with pytest.raises(CellFailed, match="ValueError: loss check"):
        raise_for_end(end)
    assert not end.freed
    assert not end.exits
    failed = {r: _losses(text, r) for r in range(n)}
    assert all(len(steps) == 2 for steps in failed.values()), failed  # steps 0 and 1 ran
    said = pool.rollback()
    assert (
        said == f"{', '.join(KEEP)} rolled back to the end of {pool.snapshot.label} on every rank"
    )
    assert all(_same(a, b) for a, b in zip(pool.execute(FULL), before, strict=True))
    text, _, end = collect(pool.run(train()))
    raise_for_end(end)
    again = {r: _losses(text, r)[:2] for r in range(n)}
    assert again == failed  # the same steps from the same state: the same losses, in full


@pytest.mark.timeout(120)
def test_rollback_without_keep_or_a_snapshot_is_one_line():
    with (
        Pool(2) as pool,
        pytest.raises(NbddpError, match=r"^nothing is kept: start the pool with --keep"),
    ):
        pool.rollback()
    with Pool(2, keep="w") as pool:
        with pytest.raises(NbddpError, match=r"^no snapshot yet: one is taken at the end"):
            pool.rollback()
        _, _, end = collect(pool.run("x = 1"))  # w does not exist yet: said, with this cell
        assert pool.snapshot.missing == {"w": "not defined on this rank"}
        assert end.notes == ("keep: not kept (w: not defined on this rank)",)
        _, _, end = collect(pool.run("x = 2"))
        assert end.notes == ()  # (said once)
    with pytest.raises(ValueError, match="keep: not a name: 'a b'"):
        Pool(2, keep=["a b"])


@pytest.mark.timeout(180)
def test_through_the_magics_keep_status_and_rollback():
    """``%ddp start --keep``, ``%ddp status`` saying what is kept and how big, a training
    cell that fails on every rank, ``%ddp rollback``; a typo, one line; ``--keep`` changed
    on the running pool in place."""
    import io
    from contextlib import redirect_stdout

    from helpers import nbddp_shell

    with nbddp_shell() as shell:

        def cell(code: str, ok: bool = True) -> str:
            out = io.StringIO()
            with redirect_stdout(out):
                result = shell.run_cell(code)
            assert result.success == ok, (code, result.error_in_exec, out.getvalue())
            return out.getvalue()

        cell("%ddp start -n 3 --keep fmodel,fopt,epoch")
        cell("%%ddp --quiet\n" + BUILD)
        said = cell("%ddp status")
        assert "nbddp: keeps fmodel, fopt, epoch as at the end of " in said, said
        assert " a rank at most, in shared memory (" in said, said
        cell("%%ddp --quiet\n" + train())
        cell("%%ddp --quiet --out w\nfmodel[0].weight.full_tensor()")
        before = shell.user_ns["w"]
        cell("%%ddp --quiet\n" + train(fail_at=3), ok=False)
        said = cell("%ddp rollback")
        assert re.fullmatch(
            r"nbddp: fmodel, fopt, epoch rolled back to the end of In \[\d+\] on every rank",
            said.strip(),
        ), said
        cell("%%ddp --quiet --out w\nfmodel[0].weight.full_tensor()")
        assert all(a.equal(b) for a, b in zip(shell.user_ns["w"], before, strict=True))
        result = shell.run_cell("%ddp rollback now")
        assert "%ddp rollback takes no arguments, not 'now'" in str(result.error_in_exec)
        said = cell("%ddp start -n 3 --keep fopt")
        assert "--keep fopt" in said, said  # in place: every rank kept its state
        assert "nbddp: keeps fopt: no snapshot yet" in cell("%ddp status")
