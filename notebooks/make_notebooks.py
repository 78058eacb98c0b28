"""Write the example notebooks from their cells: ``python notebooks/make_notebooks.py``.

Then run them with outputs saved:
``jupyter nbconvert --to notebook --execute --inplace notebooks/*.ipynb``
(the tests execute them too, with nbclient).
"""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).parent

QUICKSTART = [
    new_markdown_cell(
        "# nbddp quickstart\n\n"
        "`%%ddp` runs a cell on every rank of a persistent `torch.distributed` pool: "
        "one process per GPU with NCCL, or CPU ranks with gloo. The ranks keep their "
        "namespaces across cells, so a model built in one cell is trained in the next."
    ),
    new_code_cell("%load_ext nbddp"),
    new_markdown_cell(
        "Start 2 ranks and all-reduce a tensor. `rank`, `local_rank`, `world_size` and "
        "`device` are already defined on every rank, and the process group is initialised."
    ),
    new_code_cell(
        '%%ddp -n 2 --imports "import torch.distributed as dist"\n'
        "t = torch.ones(3) * rank\n"
        "dist.all_reduce(t)\n"
        "print(t)"
    ),
    new_markdown_cell("State persists: `t` is still there."),
    new_code_cell("%%ddp\nprint(t.sum())"),
    new_markdown_cell(
        "Notebook objects reach the ranks by name with `--need`; `--out` brings each "
        "rank's last expression back as a list indexed by rank."
    ),
    new_code_cell(
        "import torch\n\ndef loss(y):\n    return (y ** 2).mean()\n\ndata = torch.randn(8)"
    ),
    new_code_cell("%%ddp --need loss,data --out vals\nloss(data) + rank"),
    new_code_cell("vals"),
    new_markdown_cell(
        "## Training with DistributedDataParallel\n\n"
        "Build the model in one cell, train it in the next, pull the weights back."
    ),
    new_code_cell(
        "%%ddp\n"
        "from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "torch.manual_seed(0)                      # same initial weights on every rank\n"
        "model = DDP(torch.nn.Linear(16, 1).to(device))\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "g = torch.Generator().manual_seed(rank)  # each rank its own shard of data\n"
        "x = torch.randn(256, 16, generator=g)\n"
        "y = x.sum(dim=1, keepdim=True)"
    ),
    new_markdown_cell(
        "`nbddp.log_metrics` draws each rank's loss curve in the cell's dashboard while "
        "it trains (frozen into the saved notebook when the cell ends)."
    ),
    new_code_cell(
        "%%ddp --out weights\n"
        "import nbddp\n"
        "for step in range(50):\n"
        "    loss = torch.nn.functional.mse_loss(model(x.to(device)), y.to(device))\n"
        "    opt.zero_grad()\n"
        "    loss.backward()\n"
        "    opt.step()\n"
        '    nbddp.log_metrics({"loss": loss.item()}, step=step)\n'
        "    if rank == 0 and step % 10 == 0:\n"
        '        print(f"step {step:2d}  loss {loss.item():.4f}")\n'
        "model.module.weight.detach().cpu()"
    ),
    new_code_cell("all(torch.equal(weights[0], w) for w in weights)  # the replicas agree"),
    new_markdown_cell(
        "Every point comes back with `%ddp metrics`: a pandas DataFrame (rank, step, name, "
        "value, run), or a list of dicts without pandas."
    ),
    new_code_cell("m = %ddp metrics loss\nlen(m)  # 50 steps x 2 ranks"),
    new_markdown_cell(
        "## When a rank fails\n\n"
        "The cell fails with one error that names every failed rank and shows its "
        "traceback with the cell's own line numbers. The pool and every rank's state "
        "survive."
    ),
    nbformat.v4.new_code_cell(
        "%%ddp\nscale = 2\nresult = scale / (rank - 1)   # rank 1 divides by zero",
        metadata={"tags": ["raises-exception"]},
    ),
    new_code_cell("%%ddp\nprint('still here, scale =', scale)"),
    new_markdown_cell("## Managing the pool"),
    new_code_cell("%ddp status"),
    new_code_cell("%ddp restart"),
    new_code_cell("%ddp stop"),
]


ACCELERATE = [
    new_markdown_cell(
        "# Hugging Face accelerate inside `%%ddp`\n\n"
        "`Accelerator()` reads the environment torchrun would set, which every rank has, "
        "and finds the process group already formed. No `notebook_launcher`: the ranks "
        "are already running, and they keep their state between cells."
    ),
    new_code_cell("%load_ext nbddp"),
    new_code_cell(
        "%%ddp -n 2\n"
        "import torch\n"
        "from accelerate import Accelerator\n"
        "acc = Accelerator()\n"
        "model = torch.nn.Linear(4, 1)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))\n"
        "loader = torch.utils.data.DataLoader(data, batch_size=8)\n"
        "model, opt, loader = acc.prepare(model, opt, loader)\n"
        "print(acc.distributed_type, acc.num_processes, acc.process_index)"
    ),
    new_code_cell(
        "%%ddp\n"
        "for epoch in range(3):\n"
        "    for x, y in loader:\n"
        "        loss = torch.nn.functional.mse_loss(model(x), y)\n"
        "        acc.backward(loss)\n"
        "        opt.step()\n"
        "        opt.zero_grad()\n"
        "    acc.print(f'epoch {epoch}: loss {loss.item():.4f}')   # rank 0 only"
    ),
    new_markdown_cell(
        "An existing `notebook_launcher(train, args)` function runs with `nbddp.ranch`:"
    ),
    new_code_cell(
        "import nbddp\n\n"
        "def train(lr):\n"
        "    import torch\n"
        "    from accelerate import Accelerator\n"
        "    acc = Accelerator()\n"
        "    model = torch.nn.Linear(4, 1)\n"
        "    opt = torch.optim.SGD(model.parameters(), lr=lr)\n"
        "    model, opt = acc.prepare(model, opt)\n"
        "    loss = model(torch.randn(8, 4)).pow(2).mean()\n"
        "    acc.backward(loss)\n"
        "    opt.step()\n"
        "    return acc.process_index, round(loss.item(), 4)\n\n"
        "nbddp.ranch(2, train, 0.1)      # was: notebook_launcher(train, (0.1,), num_processes=2)"
    ),
    new_code_cell("%ddp stop"),
]

LIGHTNING = [
    new_markdown_cell(
        "# Lightning inside `%%ddp`\n\n"
        'Use `strategy="ddp"`: Lightning sees torchrun\'s environment and attaches to the '
        "running ranks. The spawning strategies (`ddp_spawn`, `ddp_notebook`) start "
        "processes of their own; inside `%%ddp` they fail, and nbddp says why."
    ),
    new_code_cell("%load_ext nbddp"),
    new_code_cell(
        "%%ddp -n 2\n"
        "import torch, lightning as L\n"
        "fabric = L.Fabric(accelerator='cpu', strategy='ddp', devices=world_size)\n"
        "fabric.launch()\n"
        "model = torch.nn.Linear(4, 1)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "model, opt = fabric.setup(model, opt)\n"
        "for step in range(5):\n"
        "    loss = model(torch.randn(8, 4)).pow(2).mean()\n"
        "    fabric.backward(loss)\n"
        "    opt.step()\n"
        "    opt.zero_grad()\n"
        "fabric.print(f'fabric: world {fabric.world_size}, loss {loss.item():.4f}')"
    ),
    new_code_cell(
        "%%ddp\n"
        "class Lit(L.LightningModule):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.layer = torch.nn.Linear(4, 1)\n"
        "    def training_step(self, batch, i):\n"
        "        x, y = batch\n"
        "        return torch.nn.functional.mse_loss(self.layer(x), y)\n"
        "    def configure_optimizers(self):\n"
        "        return torch.optim.SGD(self.parameters(), lr=0.1)\n"
        "pairs = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))\n"
        "data = torch.utils.data.DataLoader(pairs, batch_size=8)\n"
        "trainer = L.Trainer(accelerator='cpu', strategy='ddp', devices=world_size, max_epochs=2,\n"
        "                    logger=False, enable_checkpointing=False, enable_progress_bar=False)\n"
        "trainer.fit(Lit(), data)\n"
        "print('trainer:', trainer.world_size, trainer.global_rank, trainer.global_step)"
    ),
    new_code_cell("%ddp stop"),
]

TRANSFORMERS = [
    new_markdown_cell(
        "# transformers' `Trainer` inside `%%ddp`\n\n"
        "A tiny GPT-2 built from a config (nothing is downloaded), trained with DDP on "
        "every rank."
    ),
    new_code_cell("%load_ext nbddp"),
    new_code_cell(
        "%%ddp -n 2\n"
        "import torch, tempfile\n"
        "from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments\n"
        "torch.manual_seed(0)\n"
        "model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=100,\n"
        "                                   n_positions=16))\n"
        "class Tokens(torch.utils.data.Dataset):\n"
        "    def __len__(self):\n"
        "        return 64\n"
        "    def __getitem__(self, i):\n"
        "        ids = torch.randint(0, 100, (16,), generator=torch.Generator().manual_seed(i))\n"
        "        return {'input_ids': ids, 'labels': ids}\n"
        "args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=4,\n"
        "                         max_steps=5, report_to=[], use_cpu=True, save_strategy='no',\n"
        "                         disable_tqdm=True, logging_steps=5)\n"
        "result = Trainer(model=model, args=args, train_dataset=Tokens()).train()\n"
        "print(args.parallel_mode, 'world', args.world_size, 'steps', result.global_step)"
    ),
    new_code_cell("%ddp stop"),
]

FSDP_TP = [
    new_markdown_cell(
        "# FSDP2 and tensor parallel inside `%%ddp`\n\n"
        "`fully_shard` and `parallelize_module` over a `DeviceMesh`, on CPU with gloo "
        "(on GPUs with NCCL when there are GPUs). `%ddp start --mesh dp=2` would bind the "
        "mesh as `mesh` on every rank."
    ),
    new_code_cell("%load_ext nbddp"),
    new_code_cell(
        "%%ddp -n 2\n"
        "import torch\n"
        "from torch.distributed.fsdp import fully_shard\n"
        "from torch.distributed.device_mesh import init_device_mesh\n"
        "dp = init_device_mesh(device.type, (world_size,), mesh_dim_names=('dp',))\n"
        "torch.manual_seed(0)\n"
        "net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(),\n"
        "                          torch.nn.Linear(64, 1)).to(device)\n"
        "for layer in (net[0], net[2]):\n"
        "    fully_shard(layer, mesh=dp)\n"
        "fully_shard(net, mesh=dp)\n"
        "opt = torch.optim.SGD(net.parameters(), lr=0.1)\n"
        "for step in range(5):\n"
        "    loss = net(torch.randn(8, 16, device=device)).pow(2).mean()\n"
        "    loss.backward()\n"
        "    opt.step()\n"
        "    opt.zero_grad()\n"
        "print('shard of the first weight:', tuple(net[0].weight.to_local().shape),\n"
        "      'of', tuple(net[0].weight.shape), 'loss', round(loss.item(), 4))"
    ),
    new_code_cell(
        "%%ddp\n"
        "from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,\n"
        "                                               parallelize_module)\n"
        "tp = init_device_mesh(device.type, (world_size,), mesh_dim_names=('tp',))\n"
        "mlp = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(),\n"
        "                          torch.nn.Linear(32, 8)).to(device)\n"
        "parallelize_module(mlp, tp, {'0': ColwiseParallel(), '2': RowwiseParallel()})\n"
        "y = mlp(torch.ones(2, 8, device=device))\n"
        "print('column shard', tuple(mlp[0].weight.to_local().shape), 'output', tuple(y.shape))"
    ),
    new_code_cell("%ddp stop"),
]


def raises(source: str):
    """A cell that is meant to fail (nbclient goes on; the saved error is part of the lesson)."""
    return new_code_cell(source, metadata={"tags": ["raises-exception"]})


CNN = [
    new_markdown_cell(
        "# Training a small CNN with DistributedDataParallel\n\n"
        "Synthetic images (no downloads), a data loader sharded with "
        "`DistributedSampler`, a progress bar per rank, a loss plot from rank 0, and the "
        "trained model pulled back into the notebook."
    ),
    new_code_cell("%load_ext nbddp"),
    new_markdown_cell(
        "The data and the model are defined in the notebook; automatic capture ships them "
        "to the ranks when a cell uses them."
    ),
    new_code_cell(
        "import torch\n"
        "from torch import nn\n\n"
        "def make_images(n, seed):\n"
        '    """Class k: a bright quadrant k, plus noise."""\n'
        "    g = torch.Generator().manual_seed(seed)\n"
        "    y = torch.randint(0, 4, (n,), generator=g)\n"
        "    x = torch.randn(n, 1, 16, 16, generator=g) * 0.5\n"
        "    for k in range(4):\n"
        "        r, c = (k // 2) * 8, (k % 2) * 8\n"
        "        x[y == k, :, r:r + 8, c:c + 8] += 1.0\n"
        "    return x, y\n\n"
        "class SmallCNN(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.features = nn.Sequential(\n"
        "            nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),\n"
        "            nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1))\n"
        "        self.head = nn.Linear(16, 4)\n\n"
        "    def forward(self, x):\n"
        "        return self.head(self.features(x).flatten(1))"
    ),
    new_code_cell(
        "%%ddp -n 2\n"
        "from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "from torch.utils.data import DataLoader, TensorDataset\n"
        "from torch.utils.data.distributed import DistributedSampler\n"
        "data = TensorDataset(*make_images(2048, seed=0))\n"
        "sampler = DistributedSampler(data, num_replicas=world_size, rank=rank, seed=0)\n"
        "loader = DataLoader(data, batch_size=64, sampler=sampler)\n"
        "torch.manual_seed(0)\n"
        "model = DDP(SmallCNN().to(device))\n"
        "opt = torch.optim.Adam(model.parameters(), lr=1e-2)\n"
        "losses = []\n"
        "print(f'rank {rank}: {len(sampler)} of {len(data)} images')"
    ),
    new_code_cell(
        "%%ddp\n"
        "from nbddp import progress\n"
        "for epoch in range(3):\n"
        "    sampler.set_epoch(epoch)\n"
        "    for x, y in progress(loader, desc=f'epoch {epoch}'):\n"
        "        loss = nn.functional.cross_entropy(model(x.to(device)), y.to(device))\n"
        "        opt.zero_grad()\n"
        "        loss.backward()\n"
        "        opt.step()\n"
        "        losses.append(loss.item())\n"
        "    print(f'epoch {epoch}: loss {loss.item():.3f}')"
    ),
    new_markdown_cell("The plot comes from rank 0 (`--display` chooses other ranks):"),
    new_code_cell(
        "%%ddp\n"
        "import matplotlib.pyplot as plt\n"
        "plt.figure(figsize=(5, 3))\n"
        "plt.plot(losses)\n"
        "plt.xlabel('step')\n"
        "plt.ylabel('loss')\n"
        "plt.title(f'rank {rank}')\n"
        "plt.show()"
    ),
    new_markdown_cell(
        "Pull the trained model back. A DDP model comes back as the module it wraps:"
    ),
    new_code_cell(
        "model = %ddp pull model\n"
        "x_test, y_test = make_images(512, seed=1)\n"
        "with torch.no_grad():\n"
        "    accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()\n"
        "print(type(model).__name__, f'accuracy on fresh images: {accuracy:.2%}')"
    ),
    new_code_cell("%ddp stop"),
]

FSDP_TRANSFORMER = [
    new_markdown_cell(
        "# FSDP2 on a small transformer, with a DeviceMesh\n\n"
        "`%ddp start --mesh dp=2` binds a `DeviceMesh` as `mesh` on every rank; "
        "`fully_shard` shards each layer over it. CPU with gloo here; the same cells use "
        "NCCL on GPUs."
    ),
    new_code_cell("%load_ext nbddp"),
    new_code_cell("%ddp start -n 2 --mesh dp=2 --seed 0"),
    new_code_cell(
        "%%ddp\n"
        "from torch import nn\n"
        "from torch.distributed.fsdp import fully_shard\n"
        "print(mesh)\n"
        "vocab, width = 64, 32\n"
        "model = nn.Sequential(\n"
        "    nn.Embedding(vocab, width),\n"
        "    nn.TransformerEncoderLayer(width, 4, 64, dropout=0.0, batch_first=True),\n"
        "    nn.TransformerEncoderLayer(width, 4, 64, dropout=0.0, batch_first=True),\n"
        "    nn.Linear(width, vocab),\n"
        ").to(device)\n"
        "for layer in model[1:3]:\n"
        "    fully_shard(layer, mesh=mesh)\n"
        "fully_shard(model, mesh=mesh)\n"
        "opt = torch.optim.AdamW(model.parameters(), lr=3e-3)\n"
        "w = model[1].linear1.weight\n"
        "print(f'rank {rank} holds {tuple(w.to_local().shape)} of {tuple(w.shape)}')"
    ),
    new_markdown_cell("Train it to copy its input (each rank its own batches):"),
    new_code_cell(
        "%%ddp\n"
        "g = torch.Generator().manual_seed(rank)\n"
        "for step in range(30):\n"
        "    tokens = torch.randint(0, vocab, (16, 12), generator=g).to(device)\n"
        "    logits = model(tokens)\n"
        "    loss = nn.functional.cross_entropy(logits.reshape(-1, vocab), tokens.reshape(-1))\n"
        "    loss.backward()\n"
        "    opt.step()\n"
        "    opt.zero_grad()\n"
        "    if rank == 0 and step % 10 == 9:\n"
        "        print(f'step {step + 1}: loss {loss.item():.3f}')"
    ),
    new_code_cell("%ddp stop"),
]

TENSOR_PARALLEL = [
    new_markdown_cell(
        "# Tensor parallel with `--mesh`\n\n"
        "`%ddp start --mesh tp=2` binds the mesh; `parallelize_module` splits an MLP "
        "column-wise then row-wise over it, and its output matches the unsplit model."
    ),
    new_code_cell("%load_ext nbddp"),
    new_code_cell("%ddp start -n 2 --mesh tp=2 --seed 0"),
    new_code_cell(
        "%%ddp\n"
        "from torch import nn\n"
        "from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,\n"
        "                                               parallelize_module)\n"
        "mlp = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)).to(device)\n"
        "x = torch.randn(4, 16, device=device)\n"
        "expected = mlp(x).detach()\n"
        "parallelize_module(mlp, mesh['tp'], {'0': ColwiseParallel(), '2': RowwiseParallel()})\n"
        "print(f'rank {rank}: first layer {tuple(mlp[0].weight.to_local().shape)} of '\n"
        "      f'{tuple(mlp[0].weight.shape)}, same output: '\n"
        "      f'{torch.allclose(mlp(x), expected, atol=1e-5)}')"
    ),
    new_code_cell(
        "%%ddp\n"
        "opt = torch.optim.SGD(mlp.parameters(), lr=0.05)\n"
        "for step in range(20):\n"
        "    loss = (mlp(x) - x).pow(2).mean()\n"
        "    loss.backward()\n"
        "    opt.step()\n"
        "    opt.zero_grad()\n"
        "print(f'rank {rank}: loss {loss.item():.4f}')"
    ),
    new_code_cell("%ddp stop"),
]

FAILURES = [
    new_markdown_cell(
        "# Failures and recovery\n\n"
        "What you see, on 4 ranks, when a rank raises, when a rank fails while the others "
        "wait for it in a collective, when a cell calls `sys.exit`, when a cell is stuck "
        "and interrupted (here by `--timeout`, as the stop button would), when a rank's "
        "process dies (a new process takes its place, the others keep their state, and "
        "`%ddp copy` heals it), and when collectives do not match. Cells that fail on "
        "purpose are tagged `raises-exception`."
    ),
    new_code_cell("%load_ext nbddp"),
    new_code_cell(
        "%%ddp -n 4\nimport time\nimport torch.distributed as dist\nkept = f'state of rank {rank}'"
    ),
    new_markdown_cell("## A rank raises\n\nOne error names every failed rank, with its traceback:"),
    raises(
        "%%ddp\nprint('before the error')\nif rank == 1:\n    raise ValueError('rank 1 is unhappy')"
    ),
    new_markdown_cell(
        "## A rank fails while the others wait for it in a collective\n\n"
        "Ranks 0, 1 and 3 would wait in `all_reduce` forever. As soon as they are all seen "
        "waiting, the group is aborted on every rank, they are freed, and the group is "
        "re-formed; every rank keeps its namespace. The error names the root cause first "
        "and folds the ranks it left waiting into one line:"
    ),
    raises(
        "%%ddp\nt = torch.ones(1)\nif rank == 2:\n    raise RuntimeError('failed before the "
        "all_reduce')\ndist.all_reduce(t)"
    ),
    new_code_cell("%%ddp\nprint(kept)"),
    new_markdown_cell(
        "## `sys.exit` in a cell\n\nAs in IPython: an error for that rank, and the rank, "
        "with its namespace, stays:"
    ),
    raises("%%ddp\nimport sys\nif rank == 3:\n    sys.exit(2)"),
    new_markdown_cell(
        "## A stuck cell\n\nRank 2 sleeps while the others wait for it in `all_reduce`. "
        "When the cell is interrupted, the error says where each rank was, identical stacks "
        "grouped, in the cell's line numbers; the ranks come back and keep their state:"
    ),
    raises(
        "%%ddp --timeout 2\nt = torch.ones(1)\nif rank == 2:\n    time.sleep(60)\n"
        "dist.all_reduce(t)"
    ),
    new_code_cell("%%ddp\nprint(kept)"),
    new_markdown_cell(
        "`%ddp stacks` shows where every rank is now (here: idle) and where they were "
        "when the last cell was stopped:"
    ),
    new_code_cell("%ddp stacks"),
    new_markdown_cell(
        "## A rank dies\n\n"
        "Every rank trains a small model, averaging its gradients with `all_reduce` as DDP "
        "would:"
    ),
    new_code_cell(
        "%%ddp\n"
        "torch.manual_seed(0)                      # the same initial weights on every rank\n"
        "model = torch.nn.Linear(8, 1)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.05)\n"
        "g = torch.Generator().manual_seed(rank)   # each rank its own data\n"
        "for step in range(1, 21):\n"
        "    x = torch.randn(32, 8, generator=g)\n"
        "    loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()\n"
        "    opt.zero_grad()\n"
        "    loss.backward()\n"
        "    for p in model.parameters():\n"
        "        dist.all_reduce(p.grad)\n"
        "        p.grad /= world_size\n"
        "    opt.step()\n"
        "print(f'step {step}: loss {loss.item():.3f}')"
    ),
    new_markdown_cell(
        "Now rank 2's process is killed (SIGKILL, as the out-of-memory killer would do) "
        "while the others wait for it in `all_reduce`. What it printed first still arrives. "
        "The others are freed at once and keep their state; a new process takes rank 2's "
        "place (same rank, same device), and the group is re-formed with all 4 ranks. The "
        "error says so, the root cause first, and lists what the old rank 2 held:"
    ),
    raises(
        "%%ddp\n"
        "import os, signal\n"
        "t = torch.ones(1)\n"
        "if rank == 2:\n"
        "    print('rank 2: about to be killed', flush=True)\n"
        "    time.sleep(0.5)                       # the others wait in all_reduce by now\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "dist.all_reduce(t)"
    ),
    new_markdown_cell(
        "The survivors kept everything. Rank 2 is a new process with a fresh namespace: "
        "`rank`, `world_size`, `device` and the process group; the next cell replays the "
        "imports to it (the notebook's, and those of `%%ddp` cells that ran on every rank) "
        "and ships it the notebook objects the cell uses, as for any rank that lacks them. "
        "What the old rank 2 made in its cells went with it:"
    ),
    new_code_cell(
        "%%ddp\n"
        "import os\n"
        "if 'model' in globals():\n"
        "    print(f'rank {rank} (pid {os.getpid()}): step {step}, {kept}')\n"
        "else:\n"
        "    print(f'rank {rank} (pid {os.getpid()}): a new process, nothing of its own')"
    ),
    new_markdown_cell(
        "## Healing the new rank: `%ddp copy`\n\n"
        "`%ddp copy NAMES --from R --to RANKS` copies objects from a live rank's namespace "
        "to others (big tensors through shared memory, written once for every "
        "destination), tensors landing on each rank's own device. A model and its "
        "optimizer copied together stay linked. "
        "Rank 0's model, optimizer and step counter to rank 2:"
    ),
    new_code_cell("%ddp copy model opt step --from 0 --to 2"),
    new_markdown_cell("Every rank holds the same parameters again (one folded line):"),
    new_code_cell(
        "%%ddp\n"
        "total = sum(p.sum().item() for p in model.parameters())\n"
        "print(f'step {step}: parameter sum {total:.6f}')"
    ),
    new_markdown_cell(
        "And the group has its 4 ranks. Training goes on from here. Objects bound to the old group "
        "(a DDP wrapper, a device mesh, subgroups) would have to be rebuilt on every rank; "
        "`%ddp copy` refuses them and says what to copy instead. `%ddp start --on-death "
        "restart` gives the old behaviour: the whole pool restarts and every rank's state "
        "is lost."
    ),
    new_code_cell("%%ddp\nt = torch.ones(1) * rank\ndist.all_reduce(t)\nprint(t)"),
    new_markdown_cell(
        "## Collectives that do not match\n\n"
        "With `%ddp start --debug` (torch's `TORCH_DISTRIBUTED_DEBUG=DETAIL`), a rank in "
        "`barrier` while the others are in `all_reduce` fails at once with torch's own "
        "message, instead of hanging until you interrupt it:"
    ),
    new_code_cell("%ddp start -n 4 --debug"),
    raises(
        "%%ddp\nimport torch.distributed as dist\nt = torch.ones(1)\n"
        "dist.barrier() if rank == 0 else dist.all_reduce(t)"
    ),
    new_code_cell("%ddp stop"),
]


FOLDED = [
    new_markdown_cell(
        "# Many ranks at a glance: folded output\n\n"
        "A line that several ranks print shows once, with its rank set: `[ranks 0-3] epoch 0 "
        "finished`. Lines that differ only in their numbers fold into one with their values: "
        "`rank {0-3} epoch 0 loss {0.6121..0.7310}` (in the dashboard, point at the line for "
        "each rank's values, the ranks with the extremes named first). Each rank's own lines "
        "keep their order, and the lines of one step read in rank order. `--no-fold` shows "
        "every rank's line."
    ),
    new_code_cell("%load_ext nbddp"),
    new_markdown_cell(
        "A small CNN trained with DDP on 4 CPU ranks. Each rank prints its own loss line and a "
        "line of its own, then a line every rank prints; a tqdm bar runs on each rank, at "
        "different speeds (rank 3 is the slowest): the bars fold into one, the slowest rank's, "
        "with how far the others got."
    ),
    new_code_cell(
        "%%ddp -n 4 --text\n"
        "import time\n"
        "import torch, torch.nn as nn\n"
        "from tqdm import tqdm\n"
        "torch.manual_seed(rank)\n"
        "net = nn.parallel.DistributedDataParallel(\n"
        "    nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(144, 2))\n"
        ")\n"
        "opt = torch.optim.SGD(net.parameters(), lr=0.1)\n"
        "for epoch in range(2):\n"
        "    x, y = torch.randn(16, 1, 8, 8), torch.randint(0, 2, (16,))\n"
        "    loss = nn.functional.cross_entropy(net(x), y)\n"
        "    opt.zero_grad(); loss.backward(); opt.step()\n"
        "    print(f'rank {rank} epoch {epoch} loss {loss.item():.4f}')\n"
        "    print(('ant', 'bee', 'cat', 'dog')[rank], 'checked its batch')\n"
        "    print(f'epoch {epoch} finished')\n"
        "for i in tqdm(range(20), desc='eval', ncols=70):\n"
        "    time.sleep(0.01 * (1 + rank))  # rank 3 is the slowest\n"
        "torch.distributed.barrier()  # the ranks meet again\n"
        "print('training done')"
    ),
    new_markdown_cell(
        "The same cell as the dashboard shows it (the default in a notebook): the log of every "
        "rank folded, each rank's own log with its own lines, and `nbddp.progress` across "
        "ranks as one bar; while a tqdm bar runs, the log shows one bar, the slowest rank's, "
        "with how far the others got (each rank's row: its own position), and the finished "
        "bars fold into one line. Click a folded line for each rank's values."
    ),
    new_code_cell(
        "%%ddp\n"
        "import nbddp, time\n"
        "from tqdm import tqdm\n"
        "for i in tqdm(range(30), desc='eval', ncols=70):\n"
        "    time.sleep(0.01 * (1 + rank))\n"
        "for step in nbddp.progress(range(40 + 4 * rank), desc='steps'):\n"
        "    time.sleep(0.005)\n"
        "torch.distributed.barrier()\n"
        "print(f'rank {rank} took {40 + 4 * rank} steps')\n"
        "print('steps done')"
    ),
    new_markdown_cell(
        "One error on every rank is one traceback, headed by its rank set; the line numbers "
        "are the cell's, the `%%ddp` line counted."
    ),
    raises("%%ddp\nx = 1\nprint(undefined_name)"),
    new_code_cell("%ddp stop"),
]


def write(name: str, cells: list) -> None:
    nb = new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    nbformat.write(nb, HERE / name)


NOTEBOOKS = {
    "01-quickstart.ipynb": QUICKSTART,
    "02-ddp-cnn.ipynb": CNN,
    "03-fsdp2-transformer.ipynb": FSDP_TRANSFORMER,
    "04-tensor-parallel.ipynb": TENSOR_PARALLEL,
    "05-failures.ipynb": FAILURES,
    "06-folded-output.ipynb": FOLDED,
    "10-accelerate.ipynb": ACCELERATE,
    "11-lightning.ipynb": LIGHTNING,
    "12-transformers.ipynb": TRANSFORMERS,
    "13-fsdp2-tensor-parallel.ipynb": FSDP_TP,
}


if __name__ == "__main__":
    import sys

    for name in sys.argv[1:] or NOTEBOOKS:  # (names given: only those, e.g. 05-failures.ipynb)
        write(name, NOTEBOOKS[name])
