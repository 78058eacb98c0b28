"""A time budget per test file: the run fails, naming the file, when one file's tests
(setup, call and teardown, summed) take longer than BUDGET seconds.

The suite's time is part of every change (CI's limit is 90 minutes, the default run's
target 20 on CI's 2 cores: docs/contributing.md). A file over budget is split, or moves
cases to the slow tier (tests/tiers.py). Registered by conftest.py in the process that
reports (pytest-xdist's controller, or the only one). A run of selected tests is held
to it too (a file is one file); the slow tier (``-m slow``: its soaks and many-runs
counts are long by design) to SLOW_BUDGET.
"""

from __future__ import annotations

import os
from collections import Counter

import pytest

BUDGET = float(os.environ.get("NBDDP_FILE_BUDGET", 180))  # s per file, on CI's 2 busy cores
SLOW_BUDGET = 4 * BUDGET  # s per file of the slow tier


class FileBudget:
    def __init__(self, budget: float = BUDGET) -> None:
        self.budget = budget
        self.seconds: Counter[str] = Counter()

    def pytest_runtest_logreport(self, report) -> None:
        self.seconds[report.nodeid.split("::", 1)[0]] += report.duration

    def over(self) -> list[tuple[str, float]]:
        return [(f, s) for f, s in self.seconds.most_common() if s > self.budget]

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session) -> None:
        if self.over() and session.exitstatus == 0:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter) -> None:
        tr = terminalreporter
        if not self.seconds:  # (nothing ran: --collect-only)
            return
        tr.section(f"time per test file (the slowest; budget {self.budget:.0f} s)", sep="-")
        for path, seconds in self.seconds.most_common(8):
            tr.write_line(f"{seconds:7.1f} s  {path}")
        for path, seconds in self.over():
            tr.write_line(
                f"OVER BUDGET: {path} took {seconds:.0f} s (budget {self.budget:.0f} s): split "
                "it or move cases to the slow tier (tests/tiers.py)",
                red=True,
            )
