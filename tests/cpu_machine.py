"""Every test not marked ``cuda`` runs as on a machine without a GPU; those marked run last.

The suite's tests mean CPU ranks. On a machine with a GPU, a pool started with neither
``--device`` nor ``--backend`` puts its ranks on the GPU (sharing one over gloo,
:mod:`nbddp.rank.gpus`), and a kernel's ``%%ddp -n 4`` says so in a line the tests do not
expect. So, for each test not marked ``cuda`` (conftest's ``pytest_runtest_setup``), this
process's CUDA probes (``torch.cuda.is_available``, ``device_count``: what
:func:`nbddp.rank.gpus.visible_gpus` and the layout checks read) say no GPU, and
``CUDA_VISIBLE_DEVICES=""`` hides the GPUs from every process it starts: ranks (a rank's
environment is the notebook's, :func:`nbddp.pool.processes.rank_env`), kernels, Jupyter
servers, torchrun. A test marked ``cuda`` sees the machine as it is.

The ``cuda`` tests run after all the others (:func:`cuda_last`): they make CUDA tensors in
this process, and CUDA initialised here would refuse the CPU tests' ``fork`` pools.
``PYTORCH_NVML_BASED_CUDA_CHECK=1`` (set by conftest before torch is used) keeps
``torch.cuda.is_available()`` at collection from initialising the CUDA driver here, which
would make a forked rank's own CUDA probe fail.
"""

from __future__ import annotations

import pytest
import torch

__all__ = ["CpuMachine", "cuda_last", "is_cuda"]


class CpuMachine:
    """Switches this process between "no GPU here" and the machine as it is."""

    def __init__(self) -> None:
        self._patch: pytest.MonkeyPatch | None = None

    @property
    def hidden(self) -> bool:
        return self._patch is not None

    def use(self, cpu: bool) -> None:
        """``cpu``: hide the GPUs (from here and from every process started from here);
        else undo that. Idempotent: a run of CPU tests patches once."""
        if cpu == self.hidden:
            return
        if not cpu:
            self._patch.undo()
            self._patch = None
            return
        patch = pytest.MonkeyPatch()
        patch.setattr(torch.cuda, "is_available", lambda: False)
        patch.setattr(torch.cuda, "device_count", lambda: 0)
        patch.setenv("CUDA_VISIBLE_DEVICES", "")
        self._patch = patch


def is_cuda(item) -> bool:
    """The test is marked ``cuda`` (itself, its class or its module)."""
    return item.get_closest_marker("cuda") is not None


def cuda_last(items: list) -> list:
    """``items`` with the ``cuda`` tests moved to the end, each side in its own order."""
    return [i for i in items if not is_cuda(i)] + [i for i in items if is_cuda(i)]
