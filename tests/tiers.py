"""What the default run checks and what the slow tier (``pytest -m slow``) adds.

The default run (CI, the README's test command) checks each behaviour at a small size and
at 8 ranks (3 where odd sizes matter), and keeps one smoke test of each slow area; the
slow tier runs the rest of every 2/3/4/8 matrix, the fresh-venv wheel install, every
notebook, topology and front end. docs/contributing.md says when to run it.
"""

from __future__ import annotations

import pytest

slow = pytest.mark.slow


def sizes(*ns: int, ids: str = "{}ranks") -> list:
    """Params of a world-size matrix: 3 (else the smallest) and 8 (where listed) in the
    default run, the other sizes marked ``slow``."""
    keep = {3 if 3 in ns else min(ns)} | ({8} & set(ns))
    return [pytest.param(n, id=ids.format(n), marks=() if n in keep else slow) for n in ns]
