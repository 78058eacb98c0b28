"""The package as a user installs it: a wheel built from a copy of the repository, in a
fresh virtual environment (not --system-site-packages; the registry's jupyterlab,
notebook and ipykernel beside it), run in a kernel of that environment, and the
quickstart notebook run in JupyterLab and Notebook 7 served by that environment.

The default run builds the wheel, checks what it holds, and runs a 2-rank cell from the
wheel alone (installed with --target, ahead of the checkout on the path). The fresh venv
(about a minute to build, shared by the module's tests), its kernel and its front ends
are the slow tier's (-m slow); the browser tests are marked e2e and skipped without
/usr/bin/chromium and playwright.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import nbformat
import psutil
import pytest

from helpers import (
    CHROMIUM,
    frozen_charts,
    jupyter_server,
    open_notebook,
    run_all_cells,
    wait_gone,
)
from tiers import slow

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "src" / "nbddp"
QUICKSTART = REPO / "notebooks" / "01-quickstart.ipynb"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def clean_env(venv: Path | None = None) -> dict:
    """The environment without this checkout's Python settings; ``venv``'s bin first."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    if venv is not None:
        env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        env["VIRTUAL_ENV"] = str(venv)
    return env


def timed(what: str, cmd: list, **kw) -> subprocess.CompletedProcess:
    start = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, **kw)
    print(f"{what}: {time.monotonic() - start:.1f} s")
    assert done.returncode == 0, f"{what} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """nbddp's wheel, built (python -m build) from a copy of the checkout's sources."""
    tmp = tmp_path_factory.mktemp("wheel")
    copy = tmp / "repo"
    copy.mkdir()
    for name in ("pyproject.toml", "README.md", *(p.name for p in REPO.glob("LICENSE*"))):
        shutil.copy(REPO / name, copy / name)
    shutil.copytree(REPO / "src", copy / "src", ignore=shutil.ignore_patterns("__pycache__"))
    timed(
        "build the wheel",
        [sys.executable, "-m", "build", "--wheel", "--outdir", str(tmp / "dist"), str(copy)],
        env=clean_env(),
        timeout=300,
    )
    (built,) = (tmp / "dist").glob("nbddp-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory):
    """A fresh venv holding torch 2.13.0 (CPU), the wheel, jupyterlab, notebook and
    ipykernel. Nothing it ran may be left running at the end."""
    root = tmp_path_factory.mktemp("venv") / "env"
    python = root / "bin" / "python"
    env = clean_env()
    timed("create the venv", [sys.executable, "-m", "venv", str(root)], env=env, timeout=120)
    # no byte-compiling: the kernel compiles what it imports (measured: half the install's CPU)
    pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-compile"]
    timed("install torch==2.13.0", [*pip, "torch==2.13.0"], env=env, timeout=600)
    timed(
        "install the wheel, jupyterlab, notebook, ipykernel",
        [*pip, str(wheel), "jupyterlab", "notebook", "ipykernel"],
        env=env,
        timeout=600,
    )
    yield root
    ours = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        if any(str(root) in arg for arg in proc.info["cmdline"] or ()):
            ours.append(proc.info["pid"])
    left = wait_gone(ours, timeout=20)
    for pid in left:  # end them, then say so
        psutil.Process(pid).kill()
    assert not left, f"still running from the venv: {left}"


def test_the_wheel_holds_every_module_and_the_dashboards_script(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "nbddp/dashboard/dashboard.js" in names  # the widget's JavaScript, read at run time
    modules = {f"nbddp/{p.relative_to(SRC).as_posix()}" for p in SRC.rglob("*.py")}
    assert modules <= names, sorted(modules - names)  # every part's package too
    assets = {f"nbddp/{p.name}" for p in SRC.iterdir() if p.is_file() and p.suffix != ".pyc"}
    assert assets <= names, sorted(assets - names)


def test_the_wheel_alone_imports_and_runs_a_cell_of_two_ranks(wheel, tmp_path):
    """The default run's smoke of the wheel (the slow tier installs it in a fresh venv):
    the wheel alone (pip --target, no dependencies) ahead of the checkout on the path;
    the notebook side and both ranks import nbddp from it, and a cell runs."""
    target = tmp_path / "installed"
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile"]
    timed("install the wheel alone", [*pip, "--target", str(target), str(wheel)], timeout=300)
    code = (
        "import nbddp\nprint(nbddp.__file__)\n"
        "with nbddp.Pool(2) as pool:\n"
        "    print(pool.execute('import nbddp\\n(rank, nbddp.__file__)'))\n"
    )
    env = {**clean_env(), "PYTHONPATH": str(target)}
    done = timed("a 2-rank cell", [sys.executable, "-c", code], env=env, cwd=tmp_path, timeout=300)
    here, ranks = done.stdout.splitlines()[-2:]
    init = str(target / "nbddp" / "__init__.py")
    assert here == init, done.stdout
    assert ranks == repr([(0, init), (1, init)]), done.stdout


def kernel_in(venv: Path, tmp: Path):
    """A kernel of ``venv``'s python through jupyter_client (a kernelspec of its own)."""
    from jupyter_client import KernelManager
    from jupyter_client.kernelspec import KernelSpecManager

    spec = tmp / "kernels" / "nbddp-wheel"
    spec.mkdir(parents=True)
    argv = [str(venv / "bin" / "python"), "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    spec.joinpath("kernel.json").write_text(
        json.dumps({"argv": argv, "display_name": "nbddp wheel", "language": "python"})
    )
    specs = KernelSpecManager(kernel_dirs=[str(tmp / "kernels")])
    return KernelManager(kernel_name="nbddp-wheel", kernel_spec_manager=specs)


def execute(client, code: str, timeout: float = 180) -> tuple[dict, list[tuple[str, dict]]]:
    """Run ``code``: (the reply's content, [(message type, content)] of its outputs)."""
    outputs = []
    kinds = ("stream", "display_data", "update_display_data", "execute_result", "error")

    def hook(msg):
        if msg["msg_type"] in kinds:
            outputs.append((msg["msg_type"], msg["content"]))

    reply = client.execute_interactive(code, output_hook=hook, timeout=timeout)
    return reply["content"], outputs


@slow
@pytest.mark.kernel
@pytest.mark.timeout(900)
def test_the_installed_wheel_runs_a_cell_in_a_kernel_of_the_fresh_venv(venv, tmp_path):
    python = venv / "bin" / "python"
    env = dict(clean_env(venv), IPYTHONDIR=str(tmp_path / "ipython"))
    env["JUPYTER_RUNTIME_DIR"] = str(tmp_path / "runtime")
    where = timed(
        "import nbddp",
        [str(python), "-c", "import nbddp, sys; print(nbddp.__file__); print(sys.prefix)"],
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    module, prefix = where.stdout.split()
    site = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    assert Path(module).is_relative_to(site / "site-packages"), module
    assert not Path(module).is_relative_to(REPO), module
    assert Path(prefix) == venv
    assert (Path(module).parent / "dashboard" / "dashboard.js").is_file()

    start = time.monotonic()
    km = kernel_in(venv, tmp_path)
    km.start_kernel(env=env, cwd=str(tmp_path))
    client = km.client()
    client.start_channels()
    try:
        client.wait_for_ready(timeout=120)
        reply, out = execute(client, "import sys, nbddp; print(sys.executable, nbddp.__file__)")
        assert reply["status"] == "ok", reply
        executable, kernel_module = out[0][1]["text"].split()
        assert Path(executable).parent == venv / "bin"
        assert kernel_module == module
        assert execute(client, "%load_ext nbddp")[0]["status"] == "ok"
        reply, out = execute(
            client,
            "%%ddp -n 2\n"
            "import nbddp\n"
            "for step in range(20):\n"
            "    nbddp.log_metrics({'loss': 1 / (step + 1) + rank}, step=step)\n"
            "print(f'hello from rank {rank}')\n"
            "print(nbddp.__file__)",
        )
        assert reply["status"] == "ok", reply
        kinds = [kind for kind, _ in out]
        assert "error" not in kinds, out
        started = "".join(c["text"] for kind, c in out if kind == "stream")
        assert "nbddp: started 2 ranks" in started
        (live,) = [c for kind, c in out if kind == "display_data"]
        assert WIDGET_VIEW in live["data"]  # the live widget (anywidget + the wheel's script)
        frozen = [c for kind, c in out if kind == "update_display_data"][-1]["data"]
        assert set(frozen) == {"text/plain", "text/html"}
        html, text = frozen["text/html"], frozen["text/plain"]
        assert "<svg" not in html  # the chart an image of its SVG, not inline SVG
        charts = frozen_charts(html)
        assert list(charts) == ["loss"]
        alt, svg = charts["loss"]
        assert svg.startswith("<svg class='nbddp-chart' data-metric='loss'")
        assert len(re.findall(r"<polyline class='nbddp-line' data-label='rank \d'", svg)) == 2
        assert alt.startswith("[ranks 0-1] loss @ step 19: median ")
        assert alt in text.splitlines()
        assert "hello from rank 0" in html
        assert "hello from rank 1" in html
        assert html.count(f"{module}\n") >= 2  # the ranks import the venv's nbddp too
        assert text.startswith("nbddp: 2 ranks, done")
        assert "[ranks 0-1] loss @ step 19: median" in text
        reply, out = execute(client, "%ddp stop")
        assert reply["status"] == "ok"
        assert "stopped the pool" in "".join(c.get("text", "") for _, c in out)
        print(f"kernel of the venv, a 2-rank cell: {time.monotonic() - start:.1f} s")
    finally:
        client.stop_channels()
        km.shutdown_kernel(now=False)


# every live dashboard root ever drawn in the page: the widget rendered, if only briefly
COUNT_LIVE_JS = """
window.__nbddpLive = 0;
const seen = new WeakSet();
new MutationObserver((records) => {
  for (const record of records) {
    for (const node of record.addedNodes) {
      if (node.nodeType !== 1) continue;
      const roots = [...node.querySelectorAll('.nbddp-live')];
      if (node.matches('.nbddp-live')) roots.push(node);
      for (const root of roots) {
        if (!seen.has(root)) { seen.add(root); window.__nbddpLive += 1; }
      }
    }
  }
}).observe(document, { childList: true, subtree: true });
"""


@slow
@pytest.mark.e2e
@pytest.mark.timeout(900)
@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="needs Debian's chromium")
@pytest.mark.parametrize(
    ("app", "route"), [("jupyterlab", "lab/tree"), ("notebook", "notebooks")], ids=["lab", "nb7"]
)
def test_the_quickstart_runs_in_a_front_end_served_by_the_fresh_venv(
    venv, tmp_path, app, route, browser
):
    browser_test = pytest.importorskip("playwright.sync_api", reason="needs playwright")
    expect = browser_test.expect
    root = tmp_path / "root"
    root.mkdir()
    nb = nbformat.read(QUICKSTART, as_version=4)
    for cell in nb.cells:  # what shows is this run's
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    nbformat.write(nb, root / "quickstart.ipynb")
    code = [c for c in nb.cells if c.cell_type == "code"]
    ddp = [i for i, c in enumerate(code) if c.source.startswith("%%ddp")]
    failing = [i for i, c in enumerate(code) if "raises-exception" in c.metadata.get("tags", [])]
    python = str(venv / "bin" / "python")
    start = time.monotonic()
    server = jupyter_server(tmp_path, root, app=app, python=python, env=clean_env(venv))
    with server as (base, token):
        page = browser.new_page(viewport={"width": 1280, "height": 1000})
        page.add_init_script(COUNT_LIVE_JS)
        try:
            open_notebook(page, f"{base}/{route}/quickstart.ipynb?token={token}")
            opened = time.monotonic()
            run_all_cells(page)
            cells = page.locator(".jp-Notebook .jp-Cell.jp-CodeCell")
            expect(cells).to_have_count(len(code))
            last = cells.nth(len(code) - 1)
            expect(last).to_contain_text("nbddp: stopped the pool", timeout=300_000)
            ran = time.monotonic()
            for i in ddp:  # every %%ddp cell ended frozen
                expect(cells.nth(i).locator(".nbddp-summary")).to_have_count(1)
                expect(cells.nth(i).locator(".jupyter-widgets")).to_have_count(0)
            shown = page.locator(".jp-Notebook").inner_text()
            assert "Loading widget" not in shown
            assert "Error displaying widget" not in shown
            stderr = "[data-mime-type='application/vnd.jupyter.stderr']"
            errors = [
                i
                for i in range(len(code))
                if "Traceback" in " ".join(cells.nth(i).locator(stderr).all_inner_texts())
            ]
            assert errors == failing  # the one cell meant to fail, no other
            expect(cells.nth(failing[0])).to_contain_text("ZeroDivisionError")
            drawn = page.evaluate("() => window.__nbddpLive")
            assert drawn >= 1, "no live dashboard was ever drawn"
            print(
                f"{app} from the venv: opened in {opened - start:.1f} s, ran all in "
                f"{ran - opened:.1f} s; live dashboards drawn: {drawn} of {len(ddp)} cells"
            )
        finally:
            page.screenshot(path=str(tmp_path / f"quickstart-{app}.png"), full_page=True)
