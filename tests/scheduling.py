"""How ``pytest -n 2`` (pytest-xdist) splits the suite between its two workers.

A module's tests run in one worker, so its module fixtures (pools among them) start once.
The modules that hold ``cuda`` tests run in one worker, last: CUDA initialised in a
worker would refuse the fork pools of a CPU test it ran after (tests/cpu_machine.py).
The slowest modules start first, so that no worker runs one of them alone at the end.

pytest-xdist's own ``--dist loadgroup`` would do the grouping by ``xdist_group`` marks,
but pytest-xdist 3.8 renames the nodeid through an attribute pytest 9.2 no longer reads,
so every test would be scheduled alone; :func:`module_scheduling` reads the module from
the nodeid instead.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cpu_machine import is_cuda

# every module with a test marked cuda (a collection that finds one elsewhere stops, saying so)
CUDA_MODULES = ("test_api", "test_gpus", "test_cuda", "test_cuda_kernel", "test_cuda_shared")
# the slowest modules, slowest first (a whole run's --durations, 2 busy cores)
SLOWEST = (
    "test_wheel",
    "test_notebooks",
    "test_browser",
    "test_static",
    "test_netns",
    "test_browser_charts",
    "test_browser_theme",
    "test_deadlock",
    "test_kernel",
    "test_attach_detached",
    "test_relay",
)


def module(nodeid: str) -> str:
    """The module's name (``test_pool``) of a nodeid."""
    return Path(nodeid.split("::", 1)[0]).stem


def in_worker_order(items: list) -> list:
    """``items`` with the SLOWEST modules first and the CUDA_MODULES last, each module's
    tests together and in their order (every worker sorts alike: they must agree)."""
    stray = sorted({module(i.nodeid) for i in items if is_cuda(i)} - set(CUDA_MODULES))
    if stray:
        raise pytest.UsageError(f"tests/scheduling.py: add {stray} to CUDA_MODULES")
    rank = {name: i for i, name in enumerate(SLOWEST)}

    def key(item) -> tuple[bool, int]:
        name = module(item.nodeid)
        return name in CUDA_MODULES, rank.get(name, len(SLOWEST))

    return sorted(items, key=key)


def module_scheduling(config, log):
    """pytest-xdist's scope scheduling, a scope being a module, or all CUDA_MODULES
    (imported here: a machine without pytest-xdist runs the suite in one process)."""
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "cuda" if module(nodeid) in CUDA_MODULES else nodeid.split("::", 1)[0]

    config.option.loadscopereorder = False  # the workers' order (in_worker_order) holds
    return ModuleScheduling(config, log)
