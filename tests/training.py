"""A small DDP training run that tests repeat after an event, and its losses computed here.

``MODEL`` makes a DDP model and an SGD optimizer with momentum on every rank; ``TRAIN``
trains it for ``STEPS`` steps, each rank on its own data, as a tutorial writes it (each
rank printing its own lines), and gives the losses. :func:`expected` computes the same
losses in one process from the weights and the optimizer's state (DDP averages the
gradients: one model, the mean of the ranks' losses), so a test can tell a training
cell that goes on as undisturbed from one that does not.
"""

from __future__ import annotations

import torch

LR, MOMENTUM, STEPS = 0.05, 0.9, 3

MODEL = f"""
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)))
opt = torch.optim.SGD(model.parameters(), lr={LR}, momentum={MOMENTUM})
"""

# the training cell, as a tutorial writes it: each rank's own shard of the data
TRAIN = f"""
g = torch.Generator().manual_seed(1000 + rank)
X, y = torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)
losses = []
for step in range({STEPS}):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(X), y)
    loss.backward()
    opt.step()
    losses.append(loss.item())
    print(f"rank {{rank}} step {{step}} loss {{loss.item():.4f}}")
losses
"""

STATE = "(model.module.state_dict(), opt.state_dict())"


def _data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)


def expected(state, n: int) -> list[list[float]]:
    """The losses of TRAIN on ``n`` ranks, computed in one process from ``state``."""
    weights, opt_state = state
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    net.load_state_dict(weights)
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM)
    opt.load_state_dict(opt_state)
    data = [_data(r) for r in range(n)]
    losses: list[list[float]] = [[] for _ in range(n)]
    for _ in range(STEPS):
        opt.zero_grad()
        each = [torch.nn.functional.mse_loss(net(x), y) for x, y in data]
        for r, loss in enumerate(each):
            losses[r].append(loss.item())
        (sum(each) / n).backward()
        opt.step()
    return losses


def same_losses(got: list[list[float]], want: list[list[float]]) -> bool:
    """Rank by rank, step by step, within float noise (the ranks sum in another order)."""

    def near(a: float, b: float) -> bool:
        return abs(a - b) <= 1e-4 * abs(b) + 1e-6

    return len(got) == len(want) and all(
        len(g) == len(w) and all(near(a, b) for a, b in zip(g, w, strict=True))
        for g, w in zip(got, want, strict=True)
    )
