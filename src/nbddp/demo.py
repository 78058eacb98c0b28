"""``python -m nbddp.demo``: the quickstart, run as a notebook would run it.

Starts an IPython shell, loads the extension, starts a pool (one rank per GPU,
or 2 CPU ranks with gloo), trains a small model with DistributedDataParallel
over two cells, pulls the weights back and checks that every replica agrees.
"""

from __future__ import annotations

import sys

CELLS = [
    "%load_ext nbddp",
    """\
%%ddp --imports "import torch.distributed as dist"
t = torch.ones(3) * rank
dist.all_reduce(t)
print(f"rank {rank}/{world_size} on {device}: {t}")""",
    """\
%%ddp
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)                      # same initial weights on every rank
model = DDP(torch.nn.Linear(16, 1).to(device))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
g = torch.Generator().manual_seed(rank)  # each rank its own data shard
x = torch.randn(256, 16, generator=g)
y = x.sum(dim=1, keepdim=True)""",
    """\
%%ddp --out weights
import nbddp
for step in range(50):
    loss = torch.nn.functional.mse_loss(model(x.to(device)), y.to(device))
    opt.zero_grad()
    loss.backward()
    opt.step()
    nbddp.log_metrics({"loss": loss.item()}, step=step)  # a chart in a notebook
    if rank == 0 and step % 10 == 0:
        print(f"step {step:2d}  loss {loss.item():.4f}")
model.module.weight.detach().cpu()""",
    """\
same = all(torch.equal(weights[0], w) for w in weights)
print("replicas agree:", same)
assert same""",
    """\
m = %ddp metrics loss
print(f"{len(m)} loss points: {len(weights)} ranks x 50 steps")""",
    "%ddp status",
    "%ddp stop",
]


def main() -> int:
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_cell("import torch", store_history=False)
    for cell in CELLS:
        print("\n" + "\n".join(f">>> {line}" for line in cell.splitlines()))
        result = shell.run_cell(cell, store_history=True)
        if not result.success:
            shell.run_cell("%ddp stop", store_history=False)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
