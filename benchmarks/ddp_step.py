"""A DDP training step, written as a torchrun script (unmodified: no thread settings).

512-1024-512 MLP, batch 64, gloo on CPU (``--device cuda``: on ``cuda:LOCAL_RANK % G``,
the backend ``--backend``, gloo by default, nccl for a GPU per rank). Rank 0 prints
``STEP_MS <ms per step>``.
Run: torchrun --nproc-per-node 2 benchmarks/ddp_step.py [--steps 100] [--device cuda]
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    args = parser.parse_args()
    device = torch.device("cpu")
    if args.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", 0))
        device = torch.device("cuda", local % torch.cuda.device_count())
        torch.cuda.set_device(device)
    dist.init_process_group(args.backend)
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 512)
    )
    model = DDP(net.to(device), device_ids=[device] if device.type == "cuda" else None)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 512, device=device), torch.randn(64, 512, device=device)

    def step():
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier()

    for _ in range(args.warmup):
        step()
    sync()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    sync()
    ms = (time.perf_counter() - t0) / args.steps * 1e3
    if dist.get_rank() == 0:
        print(f"STEP_MS {ms:.3f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
