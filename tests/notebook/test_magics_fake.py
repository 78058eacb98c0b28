"""The magics against a fake pool that records what it was asked: option parsing, capture
and the choice of display, in milliseconds, no process started."""

from __future__ import annotations

import itertools
import os

import pytest
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell

from nbddp import PoolClosedError, PoolStartError
from nbddp.notebook.magics import _MAGICS, TICK
from nbddp.wire import payload
from nbddp.wire import protocol as P

_SPACES = itertools.count(1)  # Pool.namespaces' numbers


class FakePool:
    """What the magics use of a Pool; ``run`` records its call and plays ``printed``."""

    def __init__(self, world_size: int = 2, on_ranks=(), printed: str = "") -> None:
        self.world_size = world_size
        self.started, self.needs_restart, self.attached = True, False, False
        self.generation = 1
        self.hosts: dict[int, str] = {}
        self.devices = ["cpu"] * world_size
        self.backend_in_use = "gloo"
        self.shm_folder = None  # shipments inline
        self.namespaces = {r: next(_SPACES) for r in range(world_size)}  # (a new pool's)
        self.on_ranks = frozenset(on_ranks)
        self.printed = printed
        self.calls: list[tuple[str, dict]] = []

    def names_on(self, ranks=None) -> frozenset[str]:
        return self.on_ranks

    def shipped_on(self, ranks=None) -> frozenset[str]:
        return frozenset()

    def ready(self) -> None:
        self.calls.append(("ready", {}))

    def run(self, code: str, **kwargs):
        self.calls.append((code, kwargs))
        ranks = kwargs.get("ranks") or list(range(self.world_size))
        yield from (P.RankState(r, "running") for r in ranks)
        yield from (P.Output(r, "stdout", self.printed) for r in ranks)
        yield from (P.RankState(r, "done") for r in ranks)
        yield P.CellEnd(1, tuple(ranks))

    def stop(self) -> None:
        self.calls.append(("stop", {}))


@pytest.fixture(scope="module")
def shell():
    sh = InteractiveShell.instance()
    sh.run_cell("%load_ext nbddp")
    yield sh
    _MAGICS[id(sh)].pool = None
    sh.run_cell("%unload_ext nbddp")


@pytest.fixture
def fake(shell):
    pool = FakePool()
    magics = _MAGICS[id(shell)]
    magics.pool, magics.session.options = pool, {}
    magics.capture.import_log.clear()
    magics.capture.shipped = type(magics.capture.shipped)()
    yield pool
    magics.pool = None


def cell(shell, capsys, line: str, body: str = "print(rank)"):
    capsys.readouterr()
    result = shell.run_cell(f"%%ddp {line}\n{body}")
    out = capsys.readouterr()
    return result, out.out + out.err


def test_the_cells_options_reach_the_pool(shell, fake, capsys):
    result, _ = cell(shell, capsys, "--ranks 1 --timeout 2.5 --display 0,1 --out vals")
    assert result.success
    code, asked = fake.calls[-1]
    assert code.strip() == "print(rank)"
    assert asked["ranks"] == [1]
    assert asked["timeout"] == 2.5
    assert asked["display_ranks"] == [0, 1]
    assert asked["want_values"] is True
    assert asked["tick"] == TICK
    assert shell.user_ns["vals"] == [None, None]


def test_needed_names_go_and_automatic_capture_takes_what_only_the_notebook_has(
    shell, fake, capsys
):
    shell.run_cell("a = 1\nb = [1, 2]\nlr = 0.1\nimport math")
    fake.on_ranks = frozenset({"lr"})
    result, out = cell(shell, capsys, "--need a", "print(a, b, lr, math.pi)")
    assert result.success
    asked = fake.calls[-1][1]
    assert payload.loads(asked["needs"].data) == {"a": 1}
    assert payload.loads(asked["auto"].data) == {"b": [1, 2]}  # the ranks have lr
    assert asked["imports"].strip() == "import math"
    assert "shipped a" not in out  # --need is not announced as automatic
    assert "shipped b" in out
    assert "replayed 1 import" in out


def test_imports_go_only_to_a_rank_whose_namespace_is_new(shell, fake, capsys):
    """Rank 1 replaced (its namespace new): it gets every import, rank 0 only the one
    it has not run; a survivor's names bound by an import are never touched again."""
    shell.run_cell("import math\nimport json")
    _, out = cell(shell, capsys, "")
    assert fake.calls[-1][1]["imports"] == "import math\nimport json"
    assert "nbddp: replayed 2 imports\n" in out
    fake.namespaces = {**fake.namespaces, 1: next(_SPACES)}
    shell.run_cell("import os")
    _, out = cell(shell, capsys, "")
    every = "import math\nimport json\nimport os"
    assert fake.calls[-1][1]["imports"] == {0: "import os", 1: every}
    assert "nbddp: replayed 3 imports on rank 1 (new), 1 import on rank 0\n" in out
    fake.namespaces = {**fake.namespaces, 1: next(_SPACES)}
    _, out = cell(shell, capsys, "--imports 'import sys'")
    assert fake.calls[-1][1]["imports"] == {0: "import sys", 1: every + "\nimport sys"}
    assert "nbddp: replayed 3 imports on rank 1 (new)\n" in out
    _, out = cell(shell, capsys, "")
    assert fake.calls[-1][1]["imports"] == ""
    assert "replayed" not in out


def test_no_auto_ships_only_what_is_named(shell, fake, capsys):
    shell.run_cell("b = [1, 2]")
    result, _ = cell(shell, capsys, "--no-auto", "print(b)")
    assert result.success
    assert fake.calls[-1][1]["auto"] is None


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("--timeout soon", "--timeout"),
        ("--ranks 0-", "--ranks"),
        ("--ranks 5", "no rank 5"),
        ("--out 1x", "--out takes a variable name"),
        ("--need nothing_here", "'nothing_here' is not defined"),
        ("--imports 'x = 1'", "--imports takes import statements only"),
        ("--display 9", "no rank 9"),
    ],
)
def test_bad_options_are_one_line_and_ask_nothing_of_the_pool(shell, fake, capsys, line, message):
    result, out = cell(shell, capsys, line)
    assert not result.success
    assert message in out
    assert "Traceback" not in out
    assert fake.calls == []


def test_a_shell_without_a_kernel_gets_folded_text_and_no_fold_shows_each(shell, fake, capsys):
    fake.printed = "same line\n"
    _, out = cell(shell, capsys, "")
    assert "[ranks 0-1] same line" in out
    _, out = cell(shell, capsys, "--no-fold")
    assert "[rank 0] same line" in out
    assert "[rank 1] same line" in out


def test_quiet_shows_nothing_when_every_rank_succeeds(shell, fake, capsys):
    fake.printed = "chatty\n"
    result, out = cell(shell, capsys, "--quiet")
    assert result.success, out
    assert "chatty" not in out


def test_a_different_size_asks_for_a_new_pool(shell, fake, capsys, monkeypatch):
    made = []

    class Made(FakePool):
        def __init__(self, n, **options) -> None:
            super().__init__(n)
            made.append((n, options))

    monkeypatch.setattr("nbddp.notebook.session.Pool", Made)
    result, out = cell(shell, capsys, "-n 3")
    assert result.success
    assert fake.calls == [("stop", {})]  # the old pool was stopped
    assert made == [(3, {})]
    assert "restarting the pool with 3 ranks: every rank's state is lost" in out


# ---------------------------------------------------------------- defects, each one line


class Broken(FakePool):
    """A pool whose cell breaks down half way: ``run`` prints, then raises ``error``."""

    def __init__(self, error: BaseException, **kwargs) -> None:
        super().__init__(**kwargs)
        self.error = error

    def run(self, code: str, **kwargs):
        self.calls.append((code, kwargs))
        yield from (P.Output(r, "stdout", "partial\n") for r in range(self.world_size))
        raise self.error


def test_a_cell_that_breaks_down_still_shows_what_the_ranks_printed(shell, capsys):
    magics = _MAGICS[id(shell)]
    magics.pool = Broken(RuntimeError("the connection broke"))
    try:
        result, out = cell(shell, capsys, "--text")
    finally:
        magics.pool = None
    assert isinstance(result.error_in_exec, RuntimeError)
    # the sink was closed: the line it held back (to fold it with the others') came out
    assert "[rank 1] partial" in out or "[ranks 0-1] partial" in out


class Unstartable(FakePool):
    """A pool that cannot run: every call that needs ranks raises ``error``."""

    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.error = error

    def run(self, code: str, **kwargs):
        raise self.error

    def run_script(self, path, argv=(), **kwargs):
        raise self.error

    def restart(self):
        raise self.error


@pytest.mark.parametrize(
    "error",
    [
        PoolStartError("rank 0 failed to start: no memory"),
        PoolClosedError("the attached pool lost a rank: start torchrun again and attach again"),
    ],
    ids=["start", "closed"],
)
@pytest.mark.parametrize(
    "line",
    [
        "%%ddp\nprint(rank)",
        "%ddp restart",
        "%ddp push pushed",
        "%ddp pull x",
        "%ddp run {script}",
        "%ddp debug --rank 0",
    ],
)
def test_a_pool_that_cannot_run_is_said_in_one_line(shell, capsys, tmp_path, error, line):
    script = tmp_path / "train.py"
    script.write_text("print(1)\n")
    shell.user_ns["pushed"] = 1
    magics = _MAGICS[id(shell)]
    magics.pool = Unstartable(error)
    try:
        capsys.readouterr()
        result = shell.run_cell(line.format(script=script))
        out = "".join(capsys.readouterr())
    finally:
        magics.pool = None
    assert isinstance(result.error_in_exec, UsageError), out
    assert str(error) in out
    assert "Traceback" not in out


def test_push_to_a_rank_that_does_not_exist_writes_nothing(shell, fake, capsys, tmp_path):
    fake.shm_folder = str(tmp_path)
    shell.run_cell("import torch\nbig = torch.zeros(2**20)")  # 4 MB: through shared memory
    capsys.readouterr()
    result = shell.run_cell("%ddp push big --ranks 9")
    out = "".join(capsys.readouterr())
    assert not result.success
    assert "no rank 9" in out
    assert os.listdir(tmp_path) == []


def test_a_new_size_on_an_attached_pool_is_refused_and_stops_nothing(shell, fake, capsys):
    fake.attached = True
    result, out = cell(shell, capsys, "-n 3")
    assert isinstance(result.error_in_exec, UsageError)
    assert "attached" in out
    assert fake.calls == []  # not stopped, nothing ran


def test_tee_without_a_log_directory_is_refused(shell, fake, capsys):
    capsys.readouterr()
    result = shell.run_cell("%ddp start -n 2 --tee 0")
    out = "".join(capsys.readouterr())
    assert isinstance(result.error_in_exec, UsageError)
    assert "--tee needs --log-dir" in out
    assert fake.calls == []  # the running pool was left as it was


def test_a_detached_pool_not_started_is_not_said_started(shell, fake, capsys):
    """A detached pool whose supervisor has no started pool (it lost its state, or its
    attached ranks are not all in): the cell goes to the supervisor, which mends or starts
    its pool and says so; the kernel claims no start of its own (it said `started 2 ranks
    in 0.0 s`: DetachedPool.start() has nothing to start)."""
    fake.started, fake.detached, fake.backend = False, True, "gloo"
    fake.start = lambda: fake.calls.append(("start", {}))
    result, out = cell(shell, capsys, "")
    assert ("start", {}) not in fake.calls, "a detached pool is started by its supervisor"
    assert result.success
    assert "started" not in out, out
    assert fake.calls[-1][0].strip() == "print(rank)"
