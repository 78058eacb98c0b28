"""Helpers shared by the tests."""

from __future__ import annotations

import base64
import contextlib
import html as html_lib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import psutil

from nbddp.wire import protocol as P


def iopub_until_idle(kc, code: str, timeout: float = 60):
    """Run ``code`` in a kernel; yield the iopub messages it caused (``(type, content)``)
    until the kernel is idle again. One loop for every test that reads a kernel's output."""
    import queue

    msg_id = kc.execute(code)
    deadline = time.monotonic() + timeout
    while True:
        try:
            msg = kc.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            raise TimeoutError(f"no idle after {timeout} s") from None
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "status" and content["execution_state"] == "idle":
            return
        yield kind, content


def healthy(pool):
    """``pool`` ready for a test: restarted if a death or a stop left it so, no old notes."""
    if pool.needs_restart or not pool.started:
        pool.restart()
    pool.notes.clear()
    pool.roster.deaths.clear()  # a test's deaths are its own (3 in a minute stop the pool)
    return pool


_DIGEST_SRC = """
import hashlib, io, types, torch, cloudpickle

def _digest(obj):
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous().reshape(-1)
        raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return f"tensor {t.dtype} {tuple(obj.shape)} " + hashlib.sha256(raw).hexdigest()
    if isinstance(obj, torch.nn.Module):
        return "module " + _digest(obj.state_dict())
    if isinstance(obj, torch.optim.Optimizer):
        return "optimizer " + _digest(obj.state_dict())
    if isinstance(obj, dict):
        return "{" + ", ".join(f"{k!r}: {_digest(v)}" for k, v in obj.items()) + "}"
    if isinstance(obj, list | tuple):
        return type(obj).__name__ + "[" + ", ".join(_digest(v) for v in obj) + "]"
    if isinstance(obj, types.ModuleType):
        return "module " + obj.__name__
    try:
        return hashlib.sha256(cloudpickle.dumps(obj)).hexdigest()
    except Exception:
        return f"{type(obj).__qualname__} at {id(obj):#x}"

def digest(ns):
    return {k: _digest(v) for k, v in ns.items() if not k.startswith("_")}
"""

# An expression a rank evaluates to {name: digest of its value} for every global name
# (values by content: tensors, modules and optimizers by their bytes), defining nothing.
NAMESPACE_DIGEST = f"(lambda d: (exec({_DIGEST_SRC!r}, d), d['digest'](globals()))[1])({{}})"


def namespace_digests(pool, ranks=None) -> list[dict]:
    """Every rank's namespace, names and values, as digests: compare before and after an
    event to prove nothing was lost (or exactly what was)."""
    return pool.execute(NAMESPACE_DIGEST, ranks=ranks)


def collect(events):
    """Run a cell's events to the end: (text by (rank, stream), all events, CellEnd)."""
    text: dict[tuple[int, str], str] = {}
    seen = []
    end = None
    for ev in events:
        seen.append(ev)
        if isinstance(ev, P.Output):
            text[ev.rank, ev.stream] = text.get((ev.rank, ev.stream), "") + ev.text
        if isinstance(ev, P.CellEnd):
            end = ev
    return text, seen, end


def wait_rejoined(pool, timeout: float, why: str) -> None:
    """Until a lost host's ranks are back in ``pool`` (``pool.ready()`` stops raising
    HostsMissing), ``timeout`` s at most."""
    from nbddp.pool.hosts_lost import HostsMissing

    deadline = time.monotonic() + timeout
    while True:
        try:
            pool.ready()
            return
        except HostsMissing:
            assert time.monotonic() < deadline, why
            time.sleep(0.05)


def wait_gone(pids, timeout=10.0, zombies=True):
    """Pids still alive after waiting up to ``timeout`` (zombies count as gone if ``zombies``)."""
    deadline = time.monotonic() + timeout
    while True:
        alive = []
        for pid in pids:
            try:
                status = psutil.Process(pid).status()
                if not zombies or status != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def start(cmd: list[str], log, env=None) -> subprocess.Popen:
    """A process in a session of its own (``end_all`` ends its whole group)."""
    return subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )


def worker_cmd(connect: str, token_file, timeout: float = 60) -> list[str]:
    """A rank started by hand, as the printed torchrun command runs it."""
    return [
        sys.executable,
        "-m",
        "nbddp.worker",
        "--connect",
        connect,
        "--token-file",
        str(token_file),
        "--connect-timeout",
        f"{timeout:g}",
    ]


def torchrun_node_cmd(
    node: int, master: int, connect: str, token_file, nodes: int = 2, per_node: int = 2
) -> list[str]:
    """Node ``node`` of a torchrun job of ``nodes`` x ``per_node`` ranks that attach."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(nodes),
        "--node-rank",
        str(node),
        "--nproc-per-node",
        str(per_node),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(master),
        "-m",
        "nbddp.worker",
        "--connect",
        connect,
        "--token-file",
        str(token_file),
    ]


def lone_worker_env(world_size: int = 1, rank: int = 0) -> dict:
    """torchrun's variables for a rank started by hand (rank 0 opens the group's store)."""
    env = dict(
        os.environ,
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
    )
    env.pop("MASTER_PORT", None)
    return env


def end_all(procs) -> None:
    """SIGKILL the process groups of ``procs`` still running."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def free_port() -> int:
    """A TCP port free on loopback right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DetachedFamily:
    """What a detached pool runs and holds: its supervisor and every process under it (the
    fork server, the store, the ranks), and its folders (the pool's folder in
    ``$NBDDP_HOME/pools``, its shared-memory folder, its private temp folder).

    :meth:`record` adds what runs now (call it again after a rank was replaced);
    :meth:`left` says what is still there; :meth:`clean` ends and removes it (the
    processes only if they are the very ones recorded: pids are not reused by mistake).
    """

    def __init__(self, name: str) -> None:
        from nbddp.detached import messages

        self.name = name
        self.folder = messages.folder_of(name)
        with open(os.path.join(self.folder, "info.json")) as f:
            self.supervisor = psutil.Process(json.load(f)["pid"])
        self.procs: dict[int, psutil.Process] = {}
        self.folders: set[str] = {self.folder}
        self.record()

    def record(self) -> None:
        try:
            procs = [self.supervisor, *self.supervisor.children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        for proc in procs:
            self.procs.setdefault(proc.pid, proc)
            try:
                shm = proc.environ().get("NBDDP_SHM_DIR")
                opened = [f.path for f in proc.open_files()]
            except psutil.Error:
                continue
            if shm:
                self.folders.add(shm)
            for path in opened:  # the pool's private temp folder holds the store's log
                folder = os.path.dirname(path)
                if os.path.basename(folder).startswith("nbddp-"):
                    self.folders.add(folder)

    @property
    def pids(self) -> list[int]:
        return list(self.procs)

    def alive(self, timeout: float = 10.0) -> list[int]:
        """The recorded processes still running after waiting up to ``timeout``."""
        left = wait_gone(self.pids, timeout)
        return [pid for pid in left if self.procs[pid].is_running()]

    def folders_left(self) -> list[str]:
        return sorted(f for f in self.folders if os.path.exists(f))

    def stopped_by(self, stop: Callable[[], object]) -> None:
        """``stop()`` (a kernel's ``%ddp stop NAME``; a Reply with an error fails) ends every
        process recorded and removes every folder."""
        self.record()
        said = stop()
        assert getattr(said, "error", None) is None, said.text  # type: ignore[attr-defined]
        assert self.alive() == []
        assert self.folders_left() == []

    def clean(self) -> None:
        for proc in self.procs.values():
            with contextlib.suppress(psutil.Error):
                if proc.is_running():
                    proc.kill()
        for folder in self.folders:
            shutil.rmtree(folder, ignore_errors=True)


# -- a Jupyter server and a browser for the end-to-end tests (test_browser, test_static,
# test_wheel); notes in docs/contributing.md

CHROMIUM = "/usr/bin/chromium"

# every notebook front end keeps its app at window.jupyterapp (expose_app_in_browser)
KERNEL_IDLE_JS = """() => {
  const widget = window.jupyterapp && window.jupyterapp.shell.currentWidget;
  const session = widget && widget.sessionContext;
  return !!(session && session.isReady && session.session && session.session.kernel
            && session.session.kernel.status === 'idle');
}"""


ANNOUNCEMENTS = "@jupyterlab/apputils-extension:announcements"
WIDGET_MANAGER = "@jupyter-widgets/jupyterlab-manager"  # ipywidgets' (jupyterlab_widgets)


@contextlib.contextmanager
def detached_family(name: str) -> Iterator[DetachedFamily]:
    """The detached pool ``name``'s family, for a test; whatever the test left of it (a
    failed test's) is stopped by name, or killed, and removed after."""
    from nbddp.detached import client
    from nbddp.pool.errors import NbddpError

    family = DetachedFamily(name)
    try:
        yield family
    finally:
        if family.supervisor.pid in family.alive(timeout=0):
            # (OSError: it was ending as asked, its socket reset; clean() ends what is left)
            with contextlib.suppress(NbddpError, OSError):
                client.stop(name)
        family.clean()


def ipc_kernel_manager(folder):
    """A KernelManager of a python3 kernel that talks over Unix sockets in a new folder
    under ``folder``. Over TCP, jupyter_client picks free ports that another process (the
    other pytest-xdist worker's pool, kernel or server) may take before the kernel binds
    them: "Address already in use", seen in a clean-clone run; a folder of its own cannot
    be taken."""
    import tempfile

    from jupyter_client import KernelManager

    ipc = tempfile.mkdtemp(prefix="k", dir=folder)
    return KernelManager(kernel_name="python3", transport="ipc", ip=os.path.join(ipc, "ipc"))


def new_kernel(folder, **start) -> tuple:
    """(manager, client) of a real python3 kernel (:func:`ipc_kernel_manager`), ready;
    ``start``: KernelManager.start_kernel's arguments (env, cwd)."""
    km = ipc_kernel_manager(folder)
    km.start_kernel(**start)
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=60)
    except RuntimeError:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
        raise
    return km, kc


@contextlib.contextmanager
def running_kernel(folder) -> Iterator[tuple]:
    """:func:`new_kernel` with its runtime and IPython folders under ``folder`` (set in
    this process while it runs): (manager, client), shut down at the end."""
    import pytest

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JUPYTER_RUNTIME_DIR", str(folder / "runtime"))
        mp.setenv("IPYTHONDIR", str(folder / "ipython"))
        km, kc = new_kernel(folder)
        try:
            yield km, kc
        finally:
            kc.stop_channels()
            if km.is_alive():
                km.shutdown_kernel(now=True)


def python3_notebook(cells: list[str]):
    """A notebook of these code cells that names the python3 kernelspec (without it a
    front end asks which kernel, and nbclient has none to start)."""
    import nbformat

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    return nb


def jupyter_env(tmp_path, base: dict | None = None, disabled: tuple[str, ...] = ()) -> dict:
    """``base`` (the environment) with Jupyter's and IPython's folders under ``tmp_path``,
    no JupyterLab news toast, and the front-end extensions ``disabled`` off too (as a user
    turns them off: page_config.json's disabledExtensions)."""
    env = dict(os.environ if base is None else base)
    for var, sub in (
        ("JUPYTER_CONFIG_DIR", "config"),
        ("JUPYTER_DATA_DIR", "data"),
        ("JUPYTER_RUNTIME_DIR", "runtime"),
        ("IPYTHONDIR", "ipython"),
    ):
        env[var] = str(tmp_path / sub)
    labconfig = tmp_path / "config" / "labconfig"
    labconfig.mkdir(parents=True, exist_ok=True)
    (labconfig / "page_config.json").write_text(
        json.dumps({"disabledExtensions": dict.fromkeys((ANNOUNCEMENTS, *disabled), True)})
    )
    return env


@contextlib.contextmanager
def jupyter_server(
    tmp_path,
    root,
    app: str = "jupyterlab",
    python: str = sys.executable,
    env=None,
    disabled: tuple[str, ...] = (),
):
    """JupyterLab (``app="jupyterlab"``) or Notebook 7 (``app="notebook"``) serving
    ``root`` on loopback, run by ``python``, the front-end extensions ``disabled`` off;
    yields (base URL, token). Its kernels (and so their pools) are shut down by the
    server itself on SIGTERM."""
    import secrets
    import urllib.request

    env = jupyter_env(tmp_path, env, disabled)
    port, token = free_port(), secrets.token_hex(16)
    if app == "jupyterlab":
        own = [
            "--LabApp.expose_app_in_browser=True",
            "--LabApp.news_url=None",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        ]
    else:
        own = ["--JupyterNotebookApp.expose_app_in_browser=True"]
    cmd = [
        python,
        "-m",
        app,
        "--no-browser",
        "--allow-root",
        "--ip=127.0.0.1",
        f"--port={port}",
        "--ServerApp.port_retries=0",
        f"--IdentityProvider.token={token}",
        f"--ServerApp.root_dir={root}",
        "--KernelManager.transport=ipc",  # (its kernels: Unix sockets, no port to race for)
        f"--KernelManager.ip={tmp_path / 'kernel-ipc'}",
        "--LanguageServerManager.autodetect=False",
        *own,
    ]
    logfile = tmp_path / f"{app}.log"
    log = open(logfile, "wb")  # noqa: SIM115  (closed in the finally below)
    proc = start(cmd, log, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, logfile.read_text()
            try:
                with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2):
                    break
            except OSError:
                assert time.monotonic() < deadline, f"{app} did not answer in 60 s"
                time.sleep(0.2)
        yield base, token
    finally:
        proc.terminate()  # the server shuts its kernels (and so the pools) down
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


@contextlib.contextmanager
def chromium(tmp_path):
    """Headless Debian Chromium driven by playwright; yields the browser."""
    from playwright.sync_api import sync_playwright

    env = dict(
        os.environ,
        XDG_CONFIG_HOME=str(tmp_path / "xdg-config"),
        XDG_CACHE_HOME=str(tmp_path / "xdg-cache"),
    )
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM, args=["--disable-gpu", "--disable-quic"], env=env
        )
        try:
            yield browser
        finally:
            browser.close()


def open_notebook(page, url: str, timeout: float = 90_000) -> None:
    """Open a notebook (JupyterLab or Notebook 7) and wait until its kernel is idle."""
    page.goto(url)
    page.wait_for_function(KERNEL_IDLE_JS, timeout=timeout)


def run_all_cells(page) -> None:
    """Run every cell of the open notebook (fire and forget: the promise may wait on a
    dialog, and evaluate has no timeout)."""
    page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")


# -- the frozen charts: each an <img class='nbddp-chart'> of its SVG (a data URI)

_CHART_IMG = re.compile(r"<img\b(?=[^>]*\bclass=(['\"])nbddp-chart\1)[^>]*>", re.S)
_ATTR = re.compile(r"""\b([\w-]+)=(?:'([^']*)'|"([^"]*)")""")
SVG_DATA = "data:image/svg+xml;base64,"


def svg_of(src: str) -> str:
    """The SVG text of an ``<img>``'s ``src`` (``data:image/svg+xml;base64,...``)."""
    assert src.startswith(SVG_DATA), src[:80]
    return base64.b64decode(src[len(SVG_DATA) :], validate=True).decode()


def frozen_charts(html: str) -> dict[str, tuple[str, str]]:
    """metric name -> (alt text, decoded SVG) of every chart image in frozen HTML (the
    attributes single-quoted as charts.py writes them, or double-quoted as nbconvert
    re-serialises them); a metric shown twice is an error."""
    out: dict[str, tuple[str, str]] = {}
    for tag in _CHART_IMG.finditer(html):
        attrs = {
            m[1]: html_lib.unescape(m[2] if m[3] is None else m[3]) for m in _ATTR.finditer(tag[0])
        }
        metric = attrs["data-metric"]
        assert metric not in out, f"two charts of {metric!r}"
        out[metric] = (attrs.get("alt", ""), svg_of(attrs["src"]))
    return out


def frozen_svgs(html: str) -> dict[str, str]:
    """metric name -> the decoded SVG text of each chart image in frozen HTML."""
    return {metric: svg for metric, (_alt, svg) in frozen_charts(html).items()}


@contextlib.contextmanager
def nbddp_shell(*cells: str) -> Iterator:
    """IPython's shell with nbddp loaded (and ``cells`` run); its pool stopped and nbddp
    unloaded after."""
    from IPython.core.interactiveshell import InteractiveShell

    sh = InteractiveShell.instance()
    sh.run_cell("%load_ext nbddp")
    for cell in cells:
        sh.run_cell(cell)
    try:
        yield sh
    finally:
        sh.run_cell("%ddp stop")
        sh.run_cell("%unload_ext nbddp")
