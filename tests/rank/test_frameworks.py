"""The frameworks people use run unchanged inside %%ddp (CPU, gloo, 2 ranks).

Each needs its package (the ``frameworks`` extra; CI installs it) and is
skipped with the reason where it is missing. Each cell runs twice in the same
pool: frameworks with global state must work again when a cell is re-run.
"""

from __future__ import annotations

import importlib.util
import io
import pickle
import subprocess
import sys

import pytest
from IPython.core.interactiveshell import InteractiveShell

import nbddp
from helpers import collect
from nbddp import Pool
from nbddp.dashboard.metric_store import CellMetrics, MetricStore
from nbddp.dashboard.sinks import TextSink
from nbddp.pool.drive import drive
from tiers import sizes


def needs(module: str):
    return pytest.mark.skipif(
        importlib.util.find_spec(module) is None,
        reason=f"needs {module} (pip install -e '.[frameworks]')",
    )


@pytest.fixture(scope="module")
def pool():
    with Pool(2) as p:
        yield p


def twice(pool, code: str) -> list:
    """Run a cell twice; both runs must succeed with the same shape of result."""
    results = []
    for _ in range(2):
        _, _, end = collect(pool.run(code, want_values=True))
        assert not end.errors, {r: e.traceback[-1500:] for r, e in end.errors.items()}
        results.append([end.values[r] for r in range(pool.world_size)])
    return results


ACCELERATE = """
import torch
from accelerate import Accelerator
acc = Accelerator()
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
loader = torch.utils.data.DataLoader(data, batch_size=4)
model, opt, loader = acc.prepare(model, opt, loader)
steps = 0
for x, y in loader:
    loss = torch.nn.functional.mse_loss(model(x), y)
    acc.backward(loss)
    opt.step()
    opt.zero_grad()
    steps += 1
acc.print("printed once, by", acc.process_index)
(acc.num_processes, acc.process_index, str(acc.distributed_type),
 acc.gather(torch.tensor([acc.process_index])).tolist(), steps)
"""


@needs("accelerate")
def test_accelerate_sees_every_rank_and_trains(pool):
    for run in twice(pool, ACCELERATE):
        assert run == [(2, r, "DistributedType.MULTI_CPU", [0, 1], 4) for r in (0, 1)]
    text, _, _ = collect(pool.run(ACCELERATE))
    assert "printed once" in text[0, "stdout"]
    assert (1, "stdout") not in text


FABRIC = """
import torch, lightning as L
fabric = L.Fabric(accelerator="cpu", strategy="ddp", devices=world_size)
fabric.launch()
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model, opt = fabric.setup(model, opt)
for _ in range(3):
    loss = model(torch.randn(8, 4)).pow(2).mean()
    fabric.backward(loss)
    opt.step()
    opt.zero_grad()
w = fabric.all_gather(model.module.weight.detach().sum())
(fabric.world_size, fabric.global_rank, bool(w[0] == w[1]))
"""

LIGHTNING_TRAINER = """
import torch, lightning as L
class Lit(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
    def training_step(self, batch, i):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
data = torch.utils.data.DataLoader(
    torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), batch_size=8)
trainer = L.Trainer(accelerator="cpu", strategy="ddp", devices=world_size, max_epochs=1,
                    logger=False, enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False)
trainer.fit(Lit(), data)
(trainer.world_size, trainer.global_rank, trainer.state.finished, trainer.global_step)
"""


@needs("lightning")
def test_lightning_fabric_attaches_to_the_ranks(pool):
    for run in twice(pool, FABRIC):
        assert run == [(2, 0, True), (2, 1, True)]


@needs("lightning")
def test_lightning_trainer_with_ddp_attaches_to_the_ranks(pool):
    for run in twice(pool, LIGHTNING_TRAINER):
        assert run == [(2, 0, True, 4), (2, 1, True, 4)]  # 64 samples / 8 / 2 ranks


TRANSFORMERS = """
import torch, tempfile
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=100,
                                   n_positions=16))
class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 32
    def __getitem__(self, i):
        ids = torch.randint(0, 100, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}
args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=4,
                         max_steps=3, report_to=[], use_cpu=True, save_strategy="no",
                         disable_tqdm=True)
out = Trainer(model=model, args=args, train_dataset=Tokens()).train()
(args.world_size, args.process_index, out.global_step, str(args.parallel_mode))
"""


@needs("transformers")
def test_transformers_trainer_trains_a_tiny_model_with_ddp(pool):
    for run in twice(pool, TRANSFORMERS):
        assert run == [(2, r, 3, "ParallelMode.DISTRIBUTED") for r in (0, 1)]


# on the rank's device: tests/pool/test_cuda_shared.py runs these two on ranks sharing a GPU
FSDP2 = """
import torch
from torch.distributed.fsdp import fully_shard
from torch.distributed.device_mesh import init_device_mesh
dp = init_device_mesh(device.type, (world_size,), mesh_dim_names=("dp",))
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
net.to(device)
for layer in (net[0], net[2]):
    fully_shard(layer, mesh=dp)
fully_shard(net, mesh=dp)
opt = torch.optim.SGD(net.parameters(), lr=0.1)
for _ in range(3):
    loss = net(torch.randn(8, 16, device=device)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
(type(net[0].weight).__name__, tuple(net[0].weight.to_local().shape),
 tuple(net[0].weight.full_tensor().shape))
"""

TENSOR_PARALLEL = """
import torch
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                               parallelize_module)
from torch.distributed.device_mesh import init_device_mesh
tp = init_device_mesh(device.type, (world_size,), mesh_dim_names=("tp",))
torch.manual_seed(0)
mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
mlp.to(device)
reference = mlp(torch.ones(2, 8, device=device)).detach()
parallelize_module(mlp, tp, {"0": ColwiseParallel(), "2": RowwiseParallel()})
y = mlp(torch.ones(2, 8, device=device))
(tuple(mlp[0].weight.to_local().shape), bool(torch.allclose(y, reference, atol=1e-5)))
"""


def test_fsdp2_fully_shard_on_cpu(pool):
    for run in twice(pool, FSDP2):
        assert run == [("DTensor", (16, 16), (32, 16))] * 2


def test_tensor_parallel_over_a_device_mesh_on_cpu(pool):
    for run in twice(pool, TENSOR_PARALLEL):
        assert run == [((8, 8), True)] * 2


@needs("accelerate")
def test_a_notebook_launcher_function_runs_through_ranch_with_state_kept():
    # the shape of accelerate's notebook_launcher(train, args, num_processes=2)
    def train(lr, steps):
        import torch
        from accelerate import Accelerator

        acc = Accelerator()
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        model, opt = acc.prepare(model, opt)
        for _ in range(steps):
            loss = model(torch.randn(8, 4)).pow(2).mean()
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
        global trained  # kept on the ranks: notebook_launcher would have lost it
        trained = acc.unwrap_model(model)
        return acc.process_index, round(float(trained.weight.sum()), 5)

    first = nbddp.ranch(2, train, 0.1, 3)
    assert [r for r, _ in first] == [0, 1]
    assert first[0][1] == first[1][1]
    assert nbddp.ranch(2, lambda: type(trained).__name__) == ["Linear", "Linear"]


@needs("accelerate")
def test_a_framework_launcher_inside_a_rank_gets_a_clear_hint(capsys):
    shell = InteractiveShell.instance()
    shell.run_cell("%load_ext nbddp")
    try:
        capsys.readouterr()
        result = shell.run_cell(
            "%%ddp -n 2 --text\nfrom accelerate import notebook_launcher\n"
            "notebook_launcher(print, (), num_processes=2)"
        )
        out = capsys.readouterr().out
        assert not result.success
        assert "accelerate's notebook_launcher starts processes of its own" in out
        assert "nbddp.ranch(N, fn, *args)" in out
    finally:
        shell.run_cell("%ddp stop")
        shell.run_cell("%unload_ext nbddp")


# ---------------------------------------------------------------- charts (nbddp.loggers)


@pytest.fixture(scope="module", params=sizes(2, 3, 4))
def sized_pool(request, pool):
    """The module's pool at 2 ranks; a pool of its own at 3 and 4."""
    if request.param == pool.world_size:
        yield pool
        return
    with Pool(request.param) as p:
        yield p


def charted(pool, code: str, store: MetricStore | None = None, label: str = "In [1]"):
    """Run a cell as the notebook does: (its metric lines by (run, name), each rank's value)."""
    metrics = CellMetrics(store, label=label)
    sink = TextSink(metrics=metrics, stdout=io.StringIO(), stderr=io.StringIO())
    end = drive(pool, pool.run(code, want_values=True), sink)
    assert not end.errors, {r: e.traceback[-1500:] for r, e in end.errors.items()}
    return metrics.store.lines, [end.values.get(r) for r in range(pool.world_size)]


LIGHTNING_LOGGED = """
import torch, lightning as L
from nbddp.loggers import LightningLogger
computed = []
class Lit(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
    def training_step(self, batch, i):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("loss", loss)
        self.log("who", float(1000 * self.global_rank + i))
        computed.append(loss.item())
        return loss
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(
    torch.randn(32 * world_size, 4), torch.randn(32 * world_size, 1)), batch_size=1)
trainer = L.Trainer(accelerator="cpu", strategy="ddp", devices=world_size, max_steps=20,
                    logger=LightningLogger(), log_every_n_steps=1, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False)
trainer.fit(Lit(), data)
computed
"""


@needs("lightning")
def test_lightning_self_log_draws_a_line_for_every_rank(sized_pool):
    n = sized_pool.world_size
    for _ in range(2):  # a second Trainer in the same ranks logs as the first
        lines, computed = charted(sized_pool, LIGHTNING_LOGGED)
        assert set(lines) == {("In [1]", "loss"), ("In [1]", "who")}  # no "epoch" line
        loss, who = lines["In [1]", "loss"], lines["In [1]", "who"]
        assert sorted(loss) == sorted(who) == list(range(n))  # every rank, not rank 0 only
        for r in range(n):
            assert list(loss[r].steps) == list(who[r].steps) == list(range(20))
            assert list(loss[r].values) == computed[r]  # each rank's own losses, exactly
            assert list(who[r].values) == [1000 * r + i for i in range(20)]
        assert len({tuple(loss[r].values) for r in range(n)}) == n  # data differs by rank


ACCELERATE_LOGGED = """
import torch
from accelerate import Accelerator
from nbddp.loggers import AccelerateTracker
acc = Accelerator(log_with=AccelerateTracker())
acc.init_trackers("x")
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
data = torch.utils.data.TensorDataset(torch.randn(80 * world_size, 4),
                                      torch.randn(80 * world_size, 1))
model, opt, loader = acc.prepare(model, opt, torch.utils.data.DataLoader(data, batch_size=4))
computed = []
for i, (x, y) in enumerate(loader):
    loss = torch.nn.functional.mse_loss(model(x), y)
    acc.backward(loss)
    opt.step()
    opt.zero_grad()
    computed.append(loss.item())
    acc.log({"loss": loss.item(), "who": 1000 * acc.process_index + i}, step=i)
computed
"""


@needs("accelerate")
def test_accelerator_log_draws_a_line_for_every_process(sized_pool):
    n = sized_pool.world_size
    for _ in range(2):
        lines, computed = charted(sized_pool, ACCELERATE_LOGGED)
        assert set(lines) == {("In [1]", "loss"), ("In [1]", "who")}
        loss, who = lines["In [1]", "loss"], lines["In [1]", "who"]
        assert sorted(loss) == sorted(who) == list(range(n))  # not the main process only
        for r in range(n):
            assert list(loss[r].steps) == list(who[r].steps) == list(range(20))
            assert list(loss[r].values) == computed[r]
            assert list(who[r].values) == [1000 * r + i for i in range(20)]


ACCELERATE_MIXED = """
import torch
from accelerate import Accelerator
from nbddp.loggers import AccelerateTracker
acc = Accelerator(log_with=AccelerateTracker(run="acc"))
acc.init_trackers("x", config={"lr": 0.1})
for i in range(5):  # no step: the run "acc" numbers them, on from the last cell
    acc.log({"loss": torch.tensor(rank + i / 10), "note": "3", "none": None,
             "many": torch.ones(3), "eval": {"acc": i, "tag": "best"}})
acc.get_tracker("nbddp").config
"""


@needs("accelerate")
def test_the_tracker_skips_what_is_not_a_number_flattens_dicts_and_names_its_run(pool):
    store = MetricStore()
    for cell in range(2):
        lines, configs = charted(pool, ACCELERATE_MIXED, store, label=f"In [{cell + 1}]")
        assert configs == [{"lr": 0.1}] * 2
    assert set(lines) == {("acc", "loss"), ("acc", "eval/acc")}
    for r in (0, 1):  # the second cell went on with the run's charts
        assert list(lines["acc", "loss"][r].steps) == list(range(10))
        assert list(lines["acc", "loss"][r].values) == pytest.approx(
            [r + i / 10 for i in range(5)] * 2
        )
        assert list(lines["acc", "eval/acc"][r].values) == [0, 1, 2, 3, 4] * 2


FABRIC_LOGGED = """
import torch, lightning as L
from nbddp.loggers import LightningLogger
fabric = L.Fabric(accelerator="cpu", strategy="ddp", devices=world_size,
                  loggers=LightningLogger(run="fabric", epoch=True))
fabric.launch()
for i in range(6):
    fabric.log_dict({"loss": torch.tensor(10.0 * fabric.global_rank + i), "epoch": i // 3},
                    step=i)
"""


@needs("lightning")
def test_fabric_log_dict_draws_every_rank_and_keeps_epoch_when_asked(pool):
    lines, _ = charted(pool, FABRIC_LOGGED)
    assert set(lines) == {("fabric", "loss"), ("fabric", "epoch")}
    for r in (0, 1):
        assert list(lines["fabric", "loss"][r].values) == [10.0 * r + i for i in range(6)]
        assert list(lines["fabric", "epoch"][r].values) == [0, 0, 0, 1, 1, 1]


@needs("lightning")
@needs("accelerate")
def test_the_loggers_pickle_by_reference_and_nbddp_imports_without_the_frameworks():
    from nbddp.loggers import AccelerateTracker, LightningLogger

    assert pickle.loads(pickle.dumps(LightningLogger(run="a"))).run == "a"
    assert pickle.loads(pickle.dumps(AccelerateTracker(run="b"))).run == "b"
    with pytest.raises(AttributeError, match="Nothing"):
        nbddp.loggers.Nothing  # noqa: B018
    blocked = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('lightning', 'pytorch_lightning', 'accelerate'):\n"
        "            raise ImportError(name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import nbddp, nbddp.loggers\n"
        "try:\n"
        "    nbddp.loggers.LightningLogger\n"
        "except ImportError:\n"
        "    print('no lightning')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", blocked], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout == "no lightning\n"
