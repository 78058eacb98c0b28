"""The phases of a cell's ranks, counted as they change (nbddp.pool.supervisor's table):
the supervisor asks how many are unfinished after every event, and must not walk a
thousand ranks each time."""

from __future__ import annotations

from collections import Counter

ENDED = ("ok", "failed", "interrupted", "dead", "stopped")


FINAL = {"ok": "ok", "error": "failed"}  # a Done's status -> the phase it ends in


class Phases(dict):
    """rank -> phase, counting ranks per phase as they change: ``finished`` and the
    deadline ask after every event, and must not walk a thousand ranks each time."""

    def __init__(self, ranks, phase: str) -> None:
        super().__init__((r, phase) for r in ranks)
        self.count = Counter({phase: len(self)} if self else {})

    def __setitem__(self, rank: int, phase: str) -> None:
        if rank in self:
            self.count[self[rank]] -= 1
        self.count[phase] += 1
        super().__setitem__(rank, phase)

    def move(self, ranks: list[int], phase: str) -> None:
        """Each of ``ranks`` (all now in one phase) to ``phase``, in one step."""
        if ranks:
            self.count[self[ranks[0]]] -= len(ranks)
            self.count[phase] += len(ranks)
            self.update(dict.fromkeys(ranks, phase))

    def unfinished(self) -> int:
        return sum(n for phase, n in self.count.items() if phase not in ENDED)
