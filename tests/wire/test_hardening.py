"""What a rank, a planted file or a killed process cannot make the notebook do.

- a rank's Done that names files outside the pool's shared-memory folder: those files
  are never removed (the ones in the folder are);
- ``--log-dir``: folders 0700, files 0600, nothing written through a planted symlink;
- the folders of a SIGKILLed notebook and of a SIGKILLed host relay are removed by the
  next nbddp process that makes its own;
- a progress bar updated 100,000 times in one line, or a line of 1 MB that never ends,
  costs bounded memory and settles as a terminal shows it.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time

import psutil
import pytest

from helpers import collect, free_port, wait_gone
from nbddp import Pool
from nbddp.dashboard.fold import PARTIAL_MAX, Folder, Lines
from nbddp.hosts import relay
from nbddp.pool.outcome import Outcome, owned_files
from nbddp.wire import payload
from nbddp.wire import protocol as P


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


# ---------------------------------------------------------------- Done.files


def test_owned_files_are_the_files_directly_inside_the_pool_folder(tmp_path):
    folder = str(tmp_path / "shm")
    inside = os.path.join(folder, "t0")
    dotted = os.path.join(folder, ".", "t1")  # the same folder, spelled otherwise
    files = [
        inside,
        dotted,
        os.path.join(folder, "sub", "t2"),  # deeper: not a value's file
        folder + "x/t3",  # a sibling whose name starts the same
        os.path.join(folder, "..", "t4"),  # out by ..
        folder,  # the folder itself
        "/etc/passwd",
        "t5",  # relative: the notebook's working directory
        b"/etc/passwd",  # not a str
        None,
        42,
    ]
    assert owned_files(files, folder) == (inside, dotted)
    assert owned_files(files, None) == ()  # ranks on other hosts: nothing is the notebook's
    assert owned_files(files, "") == ()


def test_a_forged_done_removes_only_the_pool_folders_files(tmp_path):
    """Outcome._load, as a cell's end runs it: the value loads, the victim stays."""
    folder = tmp_path / "shm"
    folder.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    ours = folder / "value-file"
    ours.write_text("remove me")
    out = Outcome(1, [0], {}, folder=str(folder))
    done = P.Done(1, "ok", payload.dumps(7).data, "7", files=(str(victim), str(ours)))
    assert out._load(0, done)
    assert out.values == {0: 7}
    assert victim.read_text() == "keep me"
    assert not ours.exists()
    raw = Outcome(1, [0], {}, raw=True, folder=str(folder))
    assert raw._load(0, done)
    assert raw.values[0].files == (str(ours),)  # a detached pool hands on only its own
    assert victim.exists()


FORGE = """
import nbddp.wire.payload as _p
_real_dumps = _p.dumps
def _forged_dumps(obj, folder=None, **kw):
    shipment = _real_dumps(obj, folder, **kw)
    shipment.files = list(shipment.files) + {extra!r}
    return shipment
_p.dumps = _forged_dumps
"""


def test_a_rank_naming_files_outside_the_pool_folder_in_its_done_removes_none(tmp_path):
    """End to end: rank 0's Done lists, beside its value's own shared-memory file, a file
    of the user's, one beside the pool's folder and one inside it."""
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    with Pool(2) as pool:
        shm = pool.shm_folder
        assert shm is not None
        sibling = shm + "-sibling"  # a name that starts as the pool's folder's does
        os.mkdir(sibling, 0o700)
        try:
            near = os.path.join(sibling, "near")
            with open(near, "w") as f:
                f.write("keep me too")
            planted = os.path.join(shm, "planted")
            with open(planted, "w") as f:
                f.write("the pool's own: removed")
            up = os.path.join(shm, "..", os.path.basename(sibling), "near")
            extra = [str(victim), near, up, planted]
            pool.execute(FORGE.format(extra=extra), ranks=[0])
            values = pool.execute("torch.arange(1 << 19) if rank == 0 else rank")
            assert values[0].equal(__import__("torch").arange(1 << 19))  # 4 MB: a file
            assert values[1] == 1
            assert victim.read_text() == "keep me"
            with open(near) as f:
                assert f.read() == "keep me too"
            assert not os.path.exists(planted)
            assert os.listdir(shm) == []  # the value's own file is gone too
            # without shared memory, the same Done (files and all) comes back as well
            assert pool.execute("rank * 10") == [0, 10]
            assert victim.exists()
            assert os.path.exists(near)
        finally:
            shutil.rmtree(sibling, ignore_errors=True)


# ---------------------------------------------------------------- --log-dir


@pytest.fixture
def open_umask():
    """umask 0: the modes seen are the ones nbddp asked for, not the umask's."""
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def test_log_dir_folders_are_0700_and_files_0600(tmp_path, open_umask):
    logs = tmp_path / "logs"
    with Pool(2, log_dir=str(logs)) as pool:
        text, _, end = collect(
            pool.run(
                "import sys\nprint('out', rank)\nprint('err', rank, file=sys.stderr)\n"
                "if rank == 1:\n    raise ValueError('logged')"
            )
        )
        assert list(end.errors) == [1]
        assert text[0, "stdout"] == "out 0\n"
    assert mode(logs) == 0o700
    for rank in (0, 1):
        assert mode(logs / str(rank)) == 0o700
        for name in ("stdout.log", "stderr.log"):
            assert mode(logs / str(rank) / name) == 0o600
        assert (logs / str(rank) / "stdout.log").read_text() == f"out {rank}\n"
        assert (logs / str(rank) / "stderr.log").read_text().startswith(f"err {rank}\n")
    assert mode(logs / "1" / "error.json") == 0o600
    assert json.loads((logs / "1" / "error.json").read_text())["message"] == "logged"
    assert not (logs / "0" / "error.json").exists()
    assert sorted(os.listdir(logs / "1")) == ["error.json", "stderr.log", "stdout.log"]


def plant(logs, rank: int, name: str, target) -> None:
    folder = logs / str(rank)
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(logs, 0o700)
    os.symlink(target, folder / name)


def test_a_symlink_planted_in_the_log_dir_is_not_written_through(tmp_path):
    logs = tmp_path / "logs"
    elsewhere = tmp_path / "elsewhere.txt"
    elsewhere.write_text("unchanged\n")
    other = tmp_path / "other.json"
    other.write_text("unchanged too\n")
    plant(logs, 0, "stdout.log", elsewhere)
    plant(logs, 1, "error.json", other)
    with Pool(2, log_dir=str(logs)) as pool:
        _, _, end = collect(pool.run("if rank == 1:\n    raise ValueError('x')"))
        assert list(end.errors) == [1]
        # error.json is replaced (a rename), never written through the link
        assert stat.S_ISREG(os.lstat(logs / "1" / "error.json").st_mode)
        assert mode(logs / "1" / "error.json") == 0o600
        _, _, end = collect(pool.run("print('through the link?', rank)"))
        assert not end.errors
        assert any("rank 0's stdout.log is not written" in n for n in end.notes), end.notes
    assert elsewhere.read_text() == "unchanged\n"
    assert other.read_text() == "unchanged too\n"
    assert os.path.islink(logs / "0" / "stdout.log")


def test_a_refused_log_file_does_not_end_the_cell_nor_the_pools_state(tmp_path):
    logs = tmp_path / "logs"
    elsewhere = tmp_path / "elsewhere.txt"
    elsewhere.write_text("unchanged\n")
    plant(logs, 0, "stdout.log", elsewhere)
    with Pool(2, log_dir=str(logs)) as pool:
        text, _, end = collect(pool.run("x = 5\nprint('hi', rank)"))
        assert not end.errors
        assert text[1, "stdout"] == "hi 1\n"
        assert pool.execute("x") == [5, 5]  # the ranks kept their state
    assert elsewhere.read_text() == "unchanged\n"


# ---------------------------------------------------------------- folders of dead processes

NOTEBOOK = """
import time
from nbddp import Pool
pool = Pool(2).start()
print(pool.procs.dir, pool.shm_folder, flush=True)
time.sleep(600)
"""


def kill_tree(root: psutil.Process) -> list[int]:
    """SIGKILL ``root`` and every process under it (their pids, found first)."""
    try:
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []
    for proc in procs:
        try:
            if proc.is_running():
                os.kill(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, psutil.NoSuchProcess):
            pass
    return [p.pid for p in procs]


@pytest.mark.timeout(120)
def test_a_sigkilled_notebooks_pool_folders_are_removed_by_the_next_one(tmp_path):
    child = subprocess.Popen(
        [sys.executable, "-c", NOTEBOOK],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    made: list[str] = []
    pids: list[int] = []
    try:
        line = child.stdout.readline().split()
        assert len(line) == 2, line
        folder, shm = line
        assert os.path.basename(folder).startswith(f"nbddp-{child.pid}-L")
        assert os.path.dirname(folder) == tempfile.gettempdir()
        assert os.path.basename(shm).startswith(f"nbddp-{child.pid}-L")
        assert mode(folder) == 0o700
        assert mode(shm) == 0o700
        # a live notebook's folders are never taken
        made.append(payload.locked_dir(tempfile.gettempdir()))
        made.append(payload.shm_dir())
        assert os.path.isdir(folder)
        assert os.path.isdir(shm)
        pids = kill_tree(psutil.Process(child.pid))
        assert len(pids) >= 3  # the notebook, its fork server and its ranks
        child.wait(10)
        assert wait_gone(pids) == []
        assert os.path.isdir(folder)  # nobody cleaned up after it
        assert os.path.isdir(shm)
        made.append(payload.locked_dir(tempfile.gettempdir()))
        assert not os.path.exists(folder)
        made.append(payload.shm_dir())
        assert not os.path.exists(shm)
    finally:
        if child.poll() is None:
            pids += kill_tree(psutil.Process(child.pid))
        child.wait()
        child.stdout.close()
        for pid in wait_gone(pids, timeout=0):
            os.kill(pid, signal.SIGKILL)
        for path in made:
            shutil.rmtree(path, ignore_errors=True)


def relay_folder(path: str) -> str:
    return os.path.dirname(path)


def test_a_sigkilled_relays_folder_is_removed_by_the_next_relay(tmp_path):
    """Relays to a notebook that is not there: each waits for it, holding its folder."""
    port = free_port()  # nothing listens: a relay retries until its timeout
    notebook = (("127.0.0.1", port), "AF_INET")
    token = secrets.token_bytes(16)
    tag = secrets.token_hex(4)

    def path(node: str) -> str:
        env = {"MASTER_PORT": f"hardening-{tag}", "GROUP_RANK": node}
        return relay.socket_path(f"127.0.0.1:{port}", token, env)

    dead, live, young_probe, old_probe = (path(n) for n in ("dead", "live", "p1", "p2"))
    pids: list[int] = []
    try:
        pids.append(relay.start(dead, notebook, token, timeout=120))
        pids.append(relay.start(live, notebook, token, timeout=120))
        for p in (dead, live):
            assert os.path.exists(p)  # bound before start returns
            assert mode(relay_folder(p)) == 0o700
        os.kill(pids[0], signal.SIGKILL)
        assert wait_gone(pids[:1]) == []
        assert os.path.isdir(relay_folder(dead))  # a SIGKILLed relay leaves its folder
        # a folder younger than a minute may be one being made: kept
        pids.append(relay.start(young_probe, notebook, token, timeout=0.2))
        assert os.path.isdir(relay_folder(dead))
        old = time.time() - 120
        for p in (dead, live):
            os.utime(relay_folder(p), (old, old))
        pids.append(relay.start(old_probe, notebook, token, timeout=0.2))
        assert not os.path.exists(relay_folder(dead))  # no live relay held it: swept
        assert os.path.exists(live)  # a live relay's is never swept, however old
        assert psutil.Process(pids[1]).is_running()
        assert wait_gone(pids[2:]) == []  # the probes gave up on the notebook
        for p in (young_probe, old_probe):  # and removed their own folders
            assert not os.path.exists(relay_folder(p))
    finally:
        for pid in wait_gone(pids, timeout=0):
            os.kill(pid, signal.SIGKILL)
        wait_gone(pids)
        for p in (dead, live, young_probe, old_probe):
            shutil.rmtree(relay_folder(p), ignore_errors=True)


# ---------------------------------------------------------------- progress bars


def bar(i: int, n: int) -> str:
    done = 30 * i // n
    return f"\rtraining: {100 * i // n:3d}%|{'#' * done}{' ' * (30 - done)}| {i}/{n}"


def test_a_bar_updated_100000_times_in_one_line_keeps_only_its_last_state():
    n = 100_000
    chunks = [bar(i, n) for i in range(1, n + 1)]
    whole = "".join(chunks)
    lines = Lines()
    longest = 0
    for chunk in chunks:
        assert lines.feed(chunk) == []
        longest = max(longest, len(lines.partial))
    assert longest < PARTIAL_MAX + 2
    assert longest <= len(chunks[-1])  # only the line's last state is kept
    assert lines.current == whole.rsplit("\r", 1)[-1]
    assert lines.feed(" done\n") == [(whole + " done").rsplit("\r", 1)[-1]]
    assert lines.partial == ""
    # all of it in one chunk, and then in chunks cut anywhere (a \r split from its text)
    for size in (len(whole), 4096, 7):
        lines = Lines()
        settled = []
        for i in range(0, len(whole), size):
            settled += lines.feed(whole[i : i + size])
            assert len(lines.partial) < PARTIAL_MAX + 2
        assert settled == []
        assert lines.feed("\n") == [whole.rsplit("\r", 1)[-1]]


def test_a_bar_folds_through_the_folder_with_its_last_state():
    n = 100_000
    folder = Folder([0, 1], window=0)
    for i in range(1, n + 1):
        for rank in (0, 1):
            assert folder.output(P.Output(rank, "stderr", bar(i, n))) == []
    for rank in (0, 1):
        assert len(folder._partial[rank, "stderr"].partial) < PARTIAL_MAX + 2
        assert folder.current(rank, "stderr") == bar(n, n)[1:]
    groups = folder.output(P.Output(0, "stderr", "\n"))
    assert [(g.text, g.ranks) for g in groups] == [(bar(n, n)[1:], [0])]


def test_an_unfinished_line_of_a_megabyte_is_capped_at_its_end():
    text = "".join(f"{i:07d}" for i in range((1 << 20) // 7 + 1))[: 1 << 20]
    for size in (len(text), 65536, 1000):
        lines = Lines()
        for i in range(0, len(text), size):
            assert lines.feed(text[i : i + size]) == []
            assert len(lines.partial) < PARTIAL_MAX + 2
        assert lines.current == "…" + text[-PARTIAL_MAX:]
        assert lines.flush() == ["…" + text[-PARTIAL_MAX:]]
    folder = Folder([0], window=0)
    assert folder.output(P.Output(0, "stdout", text)) == []
    assert len(folder.current(0, "stdout")) == PARTIAL_MAX + 1
    assert [g.text for g in folder.output(P.Output(0, "stdout", "\n"))] == [
        "…" + text[-PARTIAL_MAX:]
    ]
