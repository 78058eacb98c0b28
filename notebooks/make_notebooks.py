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
    new_code_cell(
        "%%ddp --out weights\n"
        "for step in range(50):\n"
        "    loss = torch.nn.functional.mse_loss(model(x.to(device)), y.to(device))\n"
        "    opt.zero_grad()\n"
        "    loss.backward()\n"
        "    opt.step()\n"
        "    if rank == 0 and step % 10 == 0:\n"
        '        print(f"step {step:2d}  loss {loss.item():.4f}")\n'
        "model.module.weight.detach().cpu()"
    ),
    new_code_cell("all(torch.equal(weights[0], w) for w in weights)  # the replicas agree"),
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


def write(name: str, cells: list) -> None:
    nb = new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    nbformat.write(nb, HERE / name)


if __name__ == "__main__":
    write("01-quickstart.ipynb", QUICKSTART)
