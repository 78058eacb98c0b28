"""A progress bar in a long cell: ``python benchmarks/bench_progress.py [--updates 20000
100000] [--json FILE]``.

A tqdm bar on every one of 4 ranks, updated ``N`` times in one line (``\\r``, no
newline), each update arriving in an output batch of its own (the worst case: a
slow training step per update). The events go through the sinks a ``%%ddp`` cell
uses, the folding dashboard (rendered into its widget every 0.3 s of a simulated
clock that advances 10 ms per update, no front end) and the text sink, exactly
as the pool gives them. Figures: the notebook's CPU for the whole cell
(``time.process_time``) and the length of the unfinished line it keeps. It uses
only the sinks' API, so ``benchmarks/compare_versions.py`` runs it against an
earlier nbddp too (before issue 26 the unfinished line grew with every update).
"""

from __future__ import annotations

import argparse
import io
import json
import time
from pathlib import Path

from nbddp.dashboard.view import Dashboard, TextSink
from nbddp.wire import protocol as P

RANKS = 4


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def bar(i: int, n: int) -> str:
    pct = 100 * i // n
    fill = "█" * (pct // 10)
    return f"\rtrain: {pct:3d}%|{fill:<10}| {i}/{n} [00:{i % 60:02d}<00:00, 9.81it/s]"


def run(n: int) -> dict:
    clock = Clock()
    sinks = [
        Dashboard(list(range(RANKS)), world_size=RANKS, backend="gloo", clock=clock),
        TextSink(stdout=io.StringIO(), clock=clock),
    ]
    c0 = time.process_time()
    for i in range(1, n + 1):
        clock.now += 0.01
        for rank in range(RANKS):
            event = P.Output(rank, "stdout", bar(i, n))
            for sink in sinks:
                sink.handle(event)
    cpu = time.process_time() - c0
    kept = max(len(lines.partial) for lines in sinks[1]._fold._partial.values())
    for rank in range(RANKS):
        for sink in sinks:
            sink.handle(P.Output(rank, "stdout", "\n"))
    return {"cpu_s": cpu, "unfinished_line_chars": kept}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, nargs="+", default=[5000, 20000, 100000])
    parser.add_argument("--json")
    args = parser.parse_args()
    results = {"ranks": RANKS, "updates": {}}
    for n in args.updates:
        row = run(n)
        results["updates"][str(n)] = row
        print(
            f"{n:>7} updates on {RANKS} ranks: notebook CPU {row['cpu_s']:.2f} s, "
            f"unfinished line kept {row['unfinished_line_chars']:,} characters",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
