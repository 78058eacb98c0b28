"""How ``pytest -n 2`` splits the suite (tests/scheduling.py): a module's tests in one
worker, the slowest modules first, the modules with cuda tests last in one worker."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from scheduling import CUDA_MODULES, SLOWEST, in_worker_order, module_scheduling


class Item:
    """What the scheduling reads of a collected test: its nodeid and its cuda mark."""

    def __init__(self, nodeid: str, cuda: bool = False) -> None:
        self.nodeid = nodeid
        self.cuda = cuda

    def get_closest_marker(self, name: str):
        return object() if name == "cuda" and self.cuda else None


def test_the_slowest_modules_come_first_and_the_cuda_modules_last_each_in_its_order():
    cuda = f"tests/pool/{CUDA_MODULES[-1]}.py"
    slow, slower = (f"tests/x/{name}.py" for name in (SLOWEST[1], SLOWEST[0]))
    items = [
        Item(f"{cuda}::test_cpu"),
        Item(f"{cuda}::test_gpu", cuda=True),
        Item("tests/wire/test_a.py::test_1"),
        Item(f"{slow}::test_1"),
        Item(f"{slower}::test_1"),
        Item("tests/wire/test_a.py::test_2"),
        Item(f"{slow}::test_2"),
    ]
    assert [i.nodeid for i in in_worker_order(items)] == [
        f"{slower}::test_1",
        f"{slow}::test_1",
        f"{slow}::test_2",
        "tests/wire/test_a.py::test_1",
        "tests/wire/test_a.py::test_2",
        f"{cuda}::test_cpu",
        f"{cuda}::test_gpu",
    ]


def test_a_cuda_test_outside_the_cuda_modules_stops_the_collection():
    with pytest.raises(pytest.UsageError, match="add \\['test_new'\\] to CUDA_MODULES"):
        in_worker_order([Item("tests/pool/test_new.py::test_gpu", cuda=True)])


def test_a_scope_is_a_module_and_all_cuda_modules_are_one():
    pytest.importorskip("xdist")
    option = SimpleNamespace(loadscopereorder=True)
    config = SimpleNamespace(option=option, getvalue=lambda name: ["2*popen"])
    scheduling = module_scheduling(config, None)
    assert option.loadscopereorder is False  # the workers' order holds
    split = scheduling._split_scope
    assert split("tests/pool/test_pool.py::test_a[2ranks]") == "tests/pool/test_pool.py"
    assert split("tests/pool/test_pool.py::T::test_b") == "tests/pool/test_pool.py"
    assert {split(f"tests/x/{name}.py::test_c") for name in CUDA_MODULES} == {"cuda"}
