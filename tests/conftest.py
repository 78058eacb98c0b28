"""Shared fixtures: real pools (started once per session where a test allows it).

Every test not marked ``cuda`` runs as on a machine without a GPU, and the ``cuda`` tests
run last (tests/cpu_machine.py says why and how), so ``pytest`` passes as it is on a CPU
machine and on a GPU machine alike.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import threading
import warnings
from pathlib import Path

# before any CUDA probe: torch.cuda.is_available() asks NVML instead of initialising the
# CUDA driver in this process, which would break the CUDA probe of a rank forked from it
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
# a test folder per part (tests/pool, tests/rank, ...); tests import each other's
# helpers by module name (from test_kernel import execute), whichever runs first
sys.path.extend(
    str(p) for p in sorted(Path(__file__).parent.iterdir()) if p.is_dir() and p.name[0] not in "_."
)

import pytest

from budget import BUDGET, SLOW_BUDGET, FileBudget
from cpu_machine import CpuMachine, cuda_last, is_cuda
from helpers import healthy
from nbddp import Pool
from scheduling import in_worker_order, module_scheduling
from tiers import sizes

MACHINE = CpuMachine()

# the detached pools' registry (``%ddp list``) of this test process only: pytest-xdist's
# workers, and test runs side by side, never see (nor clear) each other's pools
_HOME = tempfile.mkdtemp(prefix="nbddp-tests-home-")
os.environ["NBDDP_HOME"] = _HOME


def pytest_configure(config) -> None:
    """The time budget per test file (tests/budget.py), kept where reports arrive."""
    if not hasattr(config, "workerinput"):
        slow = "slow" in (config.option.markexpr or "")
        config.pluginmanager.register(FileBudget(SLOW_BUDGET if slow else BUDGET), "nbddp-budget")


def pytest_unconfigure(config) -> None:
    shutil.rmtree(_HOME, ignore_errors=True)


def pytest_collection_modifyitems(config, items) -> None:
    """cuda tests last; in pytest-xdist's workers, the modules in their order
    (tests/scheduling.py). A run without workers keeps the files' order. Deselected: the
    ``slow`` tier unless ``-m`` selects (``pytest -m slow`` runs it), and a test marked
    ``at_sizes`` at the pool sizes it does not name."""
    if hasattr(config, "workerinput"):
        items[:] = in_worker_order(items)
    items[:] = cuda_last(items)
    tier = not config.option.markexpr  # (-m chooses for itself)
    named = [a.split("::", 1)[1] for a in config.args if "::" in a]  # tests named run anyway

    def slow(item) -> bool:
        name = item.nodeid.split("::", 1)[-1]
        return bool(item.get_closest_marker("slow")) and not any(map(name.startswith, named))

    drop = [i for i in items if (tier and slow(i)) or not at_its_size(i)]
    if drop:
        config.hook.pytest_deselected(items=drop)
        dropped = set(map(id, drop))
        items[:] = [i for i in items if id(i) not in dropped]


def at_its_size(item) -> bool:
    """False for a test marked ``at_sizes(3, ..., fixture="pool_of_size")`` parametrized by
    that fixture at a size it does not name (it runs once, or at the sizes it can)."""
    mark = item.get_closest_marker("at_sizes")
    if mark is None:
        return True
    fixture = mark.kwargs.get("fixture", "pool_of_size")
    size = getattr(item, "callspec", None) and item.callspec.params.get(fixture)
    return size is None or size in mark.args


@pytest.hookimpl(optionalhook=True)  # (a hook of pytest-xdist's: not called without it)
def pytest_xdist_make_scheduler(config, log):
    """``-n 2``: a module's tests in one worker, modules in the order given (scheduling.py)."""
    return module_scheduling(config, log)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item) -> None:
    """Before the test's fixtures: no GPU for a test not marked ``cuda``."""
    MACHINE.use(cpu=not is_cuda(item))


@pytest.fixture(autouse=True)
def _sigint_as_found(request):
    """Every test leaves this process's SIGINT handler as it found it: the Ctrl-C tests
    (test_interrupts) need Python's own, and a worker runs many modules before them (a
    clean-clone run hung there, SIGINT swallowed). One that does not is named in a warning
    (the run's summary) and the handler is put back."""
    before = signal.getsignal(signal.SIGINT)
    yield
    after = signal.getsignal(signal.SIGINT)
    main = threading.current_thread() is threading.main_thread()
    if after is not before and before is not None and main:
        signal.signal(signal.SIGINT, before)
        warnings.warn(
            f"{request.node.nodeid} left SIGINT's handler {after!r} (put back)", stacklevel=1
        )


@pytest.fixture(scope="session")
def shared_pool():
    with Pool(2) as pool:
        yield pool


SIZES = (2, 3, 4, 8)  # the world sizes failure, output and data tests run at


@pytest.fixture(scope="module", params=sizes(*SIZES))
def pool_of_size(request):
    """A pool of each size in SIZES, shared by the module's tests (healthy: check it).
    The default run has 3 and 8 ranks; ``-m slow`` the others."""
    with Pool(request.param) as pool:
        yield pool


@pytest.fixture
def kernel(tmp_path):
    """A real Jupyter kernel (jupyter_client): (manager, client), shut down after."""
    from helpers import running_kernel

    with running_kernel(tmp_path) as started:
        yield started


@pytest.fixture(scope="module")
def module_kernel(tmp_path_factory):
    """One real kernel for the module's tests that leave it usable: (manager, client)."""
    from helpers import running_kernel

    with running_kernel(tmp_path_factory.mktemp("kernel")) as started:
        yield started


@pytest.fixture
def shared_kernel(module_kernel):
    """The module's kernel; after the test, checked clean for the next one: alive, idle,
    answering, its pool's ranks all there (``%ddp status`` says no rank is dead)."""
    km, kc = module_kernel
    yield km, kc
    assert km.is_alive(), "the test ended the module's kernel: give it a kernel of its own"
    printed: list[str] = []

    def read(msg) -> None:
        if msg["msg_type"] == "stream":
            printed.append(msg["content"]["text"])

    reply = kc.execute_interactive("%ddp status", timeout=60, output_hook=read)
    assert reply["content"]["status"] == "ok", reply["content"]
    assert printed, "%ddp status printed nothing"
    assert " dead" not in "".join(printed), "".join(printed)


@pytest.fixture
def pool(shared_pool):
    """The session's 2-rank pool, healthy at the start of each test."""
    return healthy(shared_pool)


@pytest.fixture
def run(shell, capsys):
    """Run a cell in the module's ``shell``; return (result, everything it printed)."""

    def _run(cell: str):
        capsys.readouterr()
        result = shell.run_cell(cell)
        captured = capsys.readouterr()
        return result, captured.out + captured.err

    return _run


# ---------------------------------------------------------------- browser tests


@pytest.fixture(scope="module")
def lab_server(tmp_path_factory):
    """One JupyterLab for the module's tests: (base URL, token, its root folder)."""
    from helpers import jupyter_server

    tmp = tmp_path_factory.mktemp("lab")
    root = tmp / "root"
    root.mkdir()
    with jupyter_server(tmp, root) as (base, token):
        yield base, token, root


@pytest.fixture
def lab(lab_server, request):
    """A notebook of its own for the test on the module's JupyterLab (the cells: the
    test's parameter, else the module's CELLS): (its URL, the root). After the test every
    kernel of the server is shut down (and with it its pool)."""
    import re

    import nbformat

    from browser_kit import end_sessions
    from helpers import python3_notebook

    base, token, root = lab_server
    stem = re.sub(r"[^\w-]+", "-", request.node.name)[:80]
    cells = getattr(request, "param", None) or request.module.CELLS
    nbformat.write(python3_notebook(cells), root / f"{stem}.ipynb")
    try:  # (a workspace of its own: JupyterLab would reopen the tabs of the one before)
        yield f"{base}/lab/workspaces/{stem}/tree/{stem}.ipynb?token={token}", root
    finally:
        end_sessions(base, token)


@pytest.fixture
def notebook7(tmp_path, request):
    """Notebook 7 (the ``notebook`` package) serving dash.ipynb."""
    from browser_kit import notebook_root
    from helpers import jupyter_server

    root = notebook_root(tmp_path, request.param)
    with jupyter_server(tmp_path, root, app="notebook") as (base, token):
        yield f"{base}/notebooks/dash.ipynb?token={token}", tmp_path


@pytest.fixture(scope="session")
def browser(tmp_path_factory):
    """One headless Chromium for the run (each pytest-xdist worker's): a test opens pages
    of its own (playwright's sync API drives one browser at a time in a process)."""
    from helpers import CHROMIUM, chromium

    if not os.path.exists(CHROMIUM):
        pytest.skip("needs Debian's chromium")
    pytest.importorskip("playwright.sync_api", reason="needs playwright")
    with chromium(tmp_path_factory.mktemp("chromium")) as browser:
        yield browser


@pytest.fixture
def page(browser):
    """A page of its own for the test, closed after it."""
    page = browser.new_page(viewport={"width": 1280, "height": 1000})
    yield page
    page.close()
