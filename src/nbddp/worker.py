"""``python -m nbddp.worker --connect ADDRESS``: one rank (:mod:`nbddp.rank.worker`).

The command torchrun and SLURM run (docs/multinode.md); the worker itself is in the rank
package.
"""

from __future__ import annotations

import sys

from .rank.worker import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
