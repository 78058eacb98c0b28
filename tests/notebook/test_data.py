"""Data in and out through a real IPython shell and real ranks: automatic capture,
shared-memory tensors, push/pull, models back, and cloudpickle's edge cases."""

from __future__ import annotations

import os
import threading
import time

import psutil
import pytest
import torch
from IPython.core.interactiveshell import InteractiveShell


@pytest.fixture(scope="module")
def shell():
    sh = InteractiveShell.instance()
    sh.run_cell("%load_ext nbddp")
    sh.run_cell("%ddp start -n 2")
    yield sh
    sh.run_cell("%ddp stop")
    sh.run_cell("%unload_ext nbddp")


def out(shell, run, expr: str):
    """Each rank's value of ``expr``."""
    result, text = run(f"%%ddp --quiet --out _v\n{expr}")
    assert result.success, text
    return shell.user_ns["_v"]


def test_auto_capture_ships_what_the_cell_reads_and_says_so(shell, run):
    run("auto_data = [1, 2, 3]\nauto_scale = 10")
    result, text = run("%%ddp\nauto_total = sum(auto_data) * auto_scale")
    assert result.success, text
    line = next(x for x in text.splitlines() if x.startswith("nbddp: shipped"))
    assert "auto_data (" in line
    assert "auto_scale (" in line
    assert out(shell, run, "auto_total") == [60, 60]


def test_auto_capture_never_overwrites_a_ranks_own_variable(shell, run):
    run("%%ddp\nrank_own = rank")
    run("rank_own = 'notebook'")
    assert out(shell, run, "rank_own") == [0, 1]
    run("%%ddp --need rank_own\npass")  # an explicit --need always ships
    assert out(shell, run, "rank_own") == ["notebook", "notebook"]


def test_imports_the_notebook_ran_are_replayed(shell, run):
    run("import json as replayed_json\nfrom math import tau as replayed_tau")
    result, text = run("%%ddp --quiet --out _v\n(replayed_json.dumps([rank]), replayed_tau > 6)")
    assert result.success, text
    assert shell.user_ns["_v"] == [("[0]", True), ("[1]", True)]
    assert "replayed" in text


def test_no_auto_ships_nothing(shell, run):
    run("only_here = 1")
    result, text = run("%%ddp --no-auto\nonly_here")
    assert not result.success
    assert "NameError: name 'only_here' is not defined" in text
    assert "shipped" not in text


def test_big_objects_need_to_be_named(shell, run):
    run("%ddp start -n 2 --auto-limit 1MB")
    run("import torch\nhuge = torch.zeros(2**20)")
    result, text = run("%%ddp\nhuge.shape")
    assert "huge not shipped automatically: 4.0 MB is over the 1.0 MB limit" in text
    assert "(name it with --need huge)" in text
    assert not result.success
    result, text = run("%%ddp --need huge --quiet --out _v\nhuge.numel()")
    assert result.success
    assert shell.user_ns["_v"] == [2**20, 2**20]
    run("%ddp start -n 2")


def test_pool_wide_no_auto(shell, run):
    run("%ddp start -n 2 --no-auto")
    run("pool_wide = 1")
    _, text = run("%%ddp\npool_wide")
    assert "NameError" in text
    assert "shipped" not in text
    run("%ddp start -n 2")


def test_tensors_arrive_as_real_tensors_and_the_files_are_gone(shell, run):
    run("import torch\nshared_t = torch.arange(2**20, dtype=torch.float32)")
    values = out(shell, run, "shared_t.add_(rank)\n(float(shared_t[0]), float(shared_t.sum()))")
    base = float(torch.arange(2**20, dtype=torch.float32).sum())
    assert values == [(0.0, base), (1.0, base + 2**20)]  # each rank changed its own copy
    assert float(shell.user_ns["shared_t"][0]) == 0.0  # and the notebook's is untouched
    from nbddp.notebook.session import default_pool

    folder = default_pool().shm_folder  # where the shipment went: the pool's own folder
    assert os.path.basename(folder).startswith("nbddp-")
    assert os.listdir(folder) == []


def test_push_pull_and_pull_all_with_big_tensors(shell, run):
    run("import torch\npushed = torch.ones(2**20)")
    assert run("%ddp push pushed --ranks 1")[0].success
    run("%%ddp\nbig_back = torch.full((2**20,), float(rank))\nhas = 'pushed' in globals()")
    assert out(shell, run, "has") == [False, True]
    one = shell.run_line_magic("ddp", "pull big_back --rank 1")
    both = shell.run_line_magic("ddp", "pull big_back --all")
    assert torch.equal(one, torch.full((2**20,), 1.0))
    assert [float(t[0]) for t in both] == [0.0, 1.0]


def test_a_model_defined_in_the_notebook_trains_under_ddp_and_comes_back_whole(shell, run):
    run(
        "import torch\n"
        "class TinyNet(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.fc = torch.nn.Linear(8, 1)\n"
        "    def forward(self, x):\n"
        "        return self.fc(x)\n"
        "torch.manual_seed(0)\n"
        "net = TinyNet()"
    )
    result, text = run(
        "%%ddp\n"
        "from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "ddp_net = DDP(net)\n"
        "opt = torch.optim.SGD(ddp_net.parameters(), lr=0.1)\n"
        "g = torch.Generator().manual_seed(rank)\n"
        "for _ in range(20):\n"
        "    x = torch.randn(32, 8, generator=g)\n"
        "    loss = (ddp_net(x) - x.sum(1, keepdim=True)).pow(2).mean()\n"
        "    opt.zero_grad(); loss.backward(); opt.step()\n"
    )
    assert result.success, text
    weights = out(shell, run, "ddp_net.module.fc.weight.detach().clone()")
    assert torch.equal(weights[0], weights[1])  # the replicas agree
    pulled = shell.run_line_magic("ddp", "pull ddp_net")  # the DDP wrapper comes back unwrapped
    assert type(pulled).__name__ == "TinyNet"
    assert torch.equal(pulled.fc.weight, weights[0])
    assert not torch.equal(pulled.fc.weight, shell.user_ns["net"].fc.weight)  # it trained


EDGE_CASES = [
    ("lambdas", "edge_fn = lambda x: x + 1", "edge_fn(rank)", [1, 2]),
    (
        "closures",
        "def make(k):\n    def add(x):\n        return x + k\n    return add\nedge_fn = make(10)",
        "edge_fn(rank)",
        [10, 11],
    ),
    (
        "classes and instances",
        "class Point:\n    def __init__(self, x):\n        self.x = x\n"
        "    def norm(self):\n        return abs(self.x)\nedge_obj = Point(-3)",
        "(edge_obj.norm(), type(edge_obj).__name__, Point(rank).x)",
        [(3, "Point", 0), (3, "Point", 1)],
    ),
    (
        "nested functions using notebook globals",
        "edge_offset = 5\ndef outer(x):\n    def inner(y):\n        return y + edge_offset\n"
        "    return inner(x)",
        "outer(rank)",
        [5, 6],
    ),
    ("modules by reference", "import math as edge_math", "edge_math.floor(2.5 + rank)", [2, 3]),
]


@pytest.mark.parametrize(
    ("setup", "expr", "expected"), [c[1:] for c in EDGE_CASES], ids=[c[0] for c in EDGE_CASES]
)
def test_cloudpickle_edge_cases_work(shell, run, setup, expr, expected):
    run(setup)
    assert out(shell, run, expr) == expected


@pytest.mark.parametrize(
    "make",
    [
        "edge_bad = open(__import__('os').devnull)",
        "edge_bad = __import__('threading').Lock()",
        "edge_bad = __import__('socket').socket()",
    ],
    ids=["open file", "lock", "socket"],
)
def test_unshippable_objects_are_named_with_the_reason(shell, run, make):
    run(make)
    result, text = run("%%ddp --need edge_bad\npass")
    assert not result.success
    assert text.startswith("UsageError: cannot ship 'edge_bad'")
    assert "cannot pickle" in text
    run("edge_bad.close() if hasattr(edge_bad, 'close') else None")


def test_shipping_512mb_to_4_ranks_holds_no_extra_copies_in_the_notebook(run, shell):
    run("%ddp start -n 4")
    me = psutil.Process()
    run("import torch\nbig512 = torch.ones(128 * 2**20)")  # 512 MB
    base = me.memory_info().rss
    peak = [base]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], me.memory_info().rss)
            time.sleep(0.005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        result, text = run("%%ddp --need big512 --quiet --out _v\nfloat(big512[-1])")
    finally:
        stop.set()
        sampler.join()
    assert result.success, text
    assert shell.user_ns["_v"] == [1.0] * 4
    # one plain pickle would hold 512 MB more; four, 2 GB
    assert peak[0] - base < 128 * 2**20, (peak[0] - base) / 2**20
    run("del big512")
    run("%ddp start -n 2")


def test_a_name_the_notebook_rebinds_is_shipped_again_unless_the_rank_owns_it(shell, run):
    run("def version():\n    return 1")
    assert out(shell, run, "version()") == [1, 1]
    _, text = run("%%ddp\nversion()")
    assert "version (" not in text  # unchanged: not shipped again
    run("def version():\n    return 2")
    assert out(shell, run, "version()") == [2, 2]
    run("%%ddp\ndef version():\n    return -rank")  # now the ranks' own
    run("def version():\n    return 3")
    assert out(shell, run, "version()") == [0, -1]
