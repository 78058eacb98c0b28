"""What a re-form's model fingerprint costs a rank: ``python benchmarks/bench_fingerprint.py``.

After each re-form every rank fingerprints each DDP model it binds again
(:func:`nbddp.rank.rebind.fingerprint`: shapes and the first 4,096 elements of each
parameter), so the pool can tell ranks a training step apart. Side by side, in one run,
for models of a few sizes: the fingerprint, and a digest of every byte of every
parameter (what comparing whole models would cost); the ratio is printed. CPU tensors,
the median of 10 calls.
"""

from __future__ import annotations

import hashlib
import statistics
import time

import torch

from nbddp.rank.rebind import fingerprint

SIZES = [(3, 64), (48, 2048), (200, 1024)]  # (layers, width) of a stack of Linear layers


def _whole(module: torch.nn.Module) -> str:
    digest = hashlib.blake2b(digest_size=8)
    for p in module.parameters():
        digest.update(p.detach().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _median_ms(fn, module, repeat: int = 10) -> float:
    fn(module)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn(module)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> None:
    print("model | parameters | tensors | fingerprint ms | whole digest ms | ratio")
    for layers, width in SIZES:
        module = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
        count = sum(p.numel() for p in module.parameters())
        ours, whole = _median_ms(fingerprint, module), _median_ms(_whole, module)
        print(
            f"{layers} x Linear({width}) | {count / 1e6:.1f} M | {2 * layers} | {ours:.2f} | "
            f"{whole:.1f} | {whole / ours:.0f}x"
        )


if __name__ == "__main__":
    main()
