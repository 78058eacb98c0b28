"""A DDP training step, written as a torchrun script (unmodified: no thread settings).

512-1024-512 MLP, batch 64, gloo on CPU. Rank 0 prints ``STEP_MS <ms per step>``.
Run: torchrun --nproc-per-node 2 benchmarks/ddp_step.py [--steps 100]
"""

import argparse
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=20)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(
        torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 512))
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 512), torch.randn(64, 512)

    def step():
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()

    for _ in range(args.warmup):
        step()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    dist.barrier()
    ms = (time.perf_counter() - t0) / args.steps * 1e3
    if dist.get_rank() == 0:
        print(f"STEP_MS {ms:.3f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
