"""What every pool offers on top of ``run``: a torchrun script, and a cell's values.

:class:`~nbddp.pool.facade.Pool` and :class:`~nbddp.detached.client.DetachedPool` (a pool
whose supervisor is a process of its own) both inherit it, so each is written once.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

from ..wire import protocol as P
from .drive import drive
from .outcome import raise_for_end

__all__ = ["PoolCalls"]


class PoolCalls:
    """Needs ``run``, ``hosts``, ``world_size`` and what :func:`nbddp.pool.drive.drive` asks."""

    def run_script(
        self, path: str, argv: list[str] | tuple[str, ...] = (), *, keep: bool = False, **kwargs
    ) -> Iterator[object]:
        """Run a torchrun script unchanged on the ranks, as :meth:`run` runs a cell.

        The file is read here and runs as ``__main__`` in a module of its own, with
        ``sys.argv`` set; with ``keep``, its globals stay in each rank's namespace.
        """
        with open(path, encoding="utf-8") as f:
            source = f.read()
        script = P.Script(os.path.abspath(path), source, tuple(argv), keep)
        return self.run("", script=script, **kwargs)

    def execute(self, code: str, **kwargs) -> list[object]:
        """Run ``code`` and return the last expression's value by rank; raise on failure.

        Output is discarded; use :meth:`run` to see it. A rank's pdb (``breakpoint()``)
        gets no commands here: its session is closed at once, not waited for.
        """
        end = drive(self, self.run(code, want_values=True, **kwargs))
        raise_for_end(end, self.hosts)
        return [end.values.get(r) for r in range(self.world_size)]
