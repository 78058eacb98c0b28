"""``nbddp.Workspace`` on its own (no pool): modelopt's NFSWorkspace with writes by
rename, private modes, and refusals in one line; and ``--workspace`` on the magics.
Two hosts sharing one: test_netns.py. Through a pool at 2/3/4/8 ranks: test_gather.py.
"""

from __future__ import annotations

import multiprocessing
import os
import stat
import time

import pytest
import torch
from IPython.core.error import UsageError

from nbddp import Workspace
from nbddp.wire.private import UnsafeFile

OTHER_UID = 65534  # nobody


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_written_by_one_rank_read_by_another_equal_and_private(tmp_path):
    path = tmp_path / "deep" / "ws"  # made, with its parents
    a, b = Workspace(path, rank=0), Workspace(str(path), rank=1)
    weights = {"w": torch.randn(64, 32), "b": torch.arange(5), "h": torch.ones(3).half()}
    config = {"name": "layer0", "dims": [64, 32], "act": None, "scale": 0.5}
    a.write(config, weights)
    got_config, got_weights = b.read(0)
    assert got_config == config
    assert got_weights.keys() == weights.keys()
    assert all(torch.equal(got_weights[k], weights[k]) for k in weights)
    assert all(got_weights[k].dtype == weights[k].dtype for k in weights)
    assert b.read(1) == (None, None)  # rank 1 wrote nothing
    assert mode(path) == 0o700
    assert mode(a.state_file(0)) == 0o600
    assert os.listdir(path) == ["rank_0_state.pth"]  # nothing half-written left beside it
    # a write replaces the last one
    a.write({"v": 2}, {"w": torch.zeros(1)})
    assert b.read(0)[0] == {"v": 2}


def test_made_like_the_seed_this_ranks_state_of_an_earlier_run_removed(tmp_path):
    old = Workspace(tmp_path, rank=3)
    old.write({"run": 1}, {})
    Workspace(tmp_path, rank=2).write({"run": 1}, {})
    (tmp_path / ".rank_3_state.pth.0a1b2c3d4e5f").write_bytes(b"half")  # a writer killed
    (tmp_path / "notes.txt").write_text("the user's")
    new = Workspace(tmp_path, rank=3)
    assert new.read(3) == (None, None)
    assert new.read(2) == ({"run": 1}, {})  # another rank's: the caller synchronizes
    assert sorted(os.listdir(tmp_path)) == ["notes.txt", "rank_2_state.pth"]


def test_the_rank_is_the_process_groups_else_RANK(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "5")
    assert Workspace(tmp_path).rank == 5
    monkeypatch.delenv("RANK")
    assert Workspace(tmp_path).rank == 0


@pytest.mark.parametrize(
    ("setup", "says"),
    [
        (lambda p: p.chmod(0o777), "other users can write in it (mode drwxrwxrwx); chmod 700"),
        (lambda p: p.chmod(0o770), "other users can write in it (mode drwxrwx---)"),
        (lambda p: os.chown(p, OTHER_UID, -1), f"it belongs to uid {OTHER_UID}"),
    ],
    ids=["world-writable", "group-writable", "another-users"],
)
def test_a_folder_another_user_could_write_in_is_refused_in_one_line(tmp_path, setup, says):
    folder = tmp_path / "ws"
    folder.mkdir()
    setup(folder)
    with pytest.raises(UnsafeFile) as err:
        Workspace(folder, rank=0)
    message = str(err.value)
    assert message.startswith(f"refusing the workspace {folder}: ")
    assert says in message
    assert "\n" not in message
    assert os.listdir(folder) == []  # nothing written there
    # nor through a symlink to such a folder
    link = tmp_path / "link"
    link.symlink_to(folder)
    with pytest.raises(UnsafeFile, match=says.split(" (")[0]):
        Workspace(link, rank=0)


def test_a_readable_folder_of_ones_own_is_used_as_it_is(tmp_path):
    folder = tmp_path / "ws"
    folder.mkdir(mode=0o755)
    Workspace(folder, rank=0).write({}, {})
    assert mode(folder) == 0o755  # never loosened nor tightened behind the user's back
    assert mode(folder / "rank_0_state.pth") == 0o600


def test_a_state_file_that_is_a_symlink_or_others_can_read_is_refused(tmp_path):
    ws = Workspace(tmp_path, rank=0)
    elsewhere = tmp_path.parent / f"{tmp_path.name}-elsewhere.pth"
    torch.save({"config": {}, "weights": {}}, elsewhere)
    os.symlink(elsewhere, ws.state_file(1))
    with pytest.raises(UnsafeFile, match=r"it is a symlink$"):
        ws.read(1)
    torch.save({"config": {}, "weights": {}}, ws.state_file(2))
    os.chmod(ws.state_file(2), 0o644)
    with pytest.raises(UnsafeFile, match=r"others can read it \(mode -rw-r--r--\); chmod 600"):
        ws.read(2)
    os.chown(ws.state_file(2), OTHER_UID, -1)
    os.chmod(ws.state_file(2), 0o600)
    with pytest.raises(UnsafeFile, match=f"it belongs to uid {OTHER_UID}"):
        ws.read(2)


class Custom:
    pass


def test_a_config_torch_load_would_not_trust_is_one_line(tmp_path):
    ws = Workspace(tmp_path, rank=0)
    ws.write({"obj": Custom()}, {})
    with pytest.raises(ValueError, match=r"weights_only=True\) refuses it") as err:
        ws.read(0)
    assert "\n" not in str(err.value)
    (tmp_path / "rank_1_state.pth").write_bytes(b"")
    os.chmod(tmp_path / "rank_1_state.pth", 0o600)
    torch.save([1, 2], tmp_path / "rank_1_state.pth")
    with pytest.raises(ValueError, match="is not a workspace state file"):
        ws.read(1)


# ---------------------------------------------------------------- a reader racing a writer

N = 1 << 20  # 4 MB of float32: many write(2) calls, so a torn read would show


WRITES = 12  # versions the writer writes, however slow the machine is


def _writer(path: str, started, done, count) -> None:
    ws = Workspace(path, rank=0)
    started.wait(30)  # the reader is reading before the first write
    for i in range(1, WRITES + 1):
        ws.write({"version": i}, {"w": torch.full((N,), float(i))})
        count.value = i
    done.set()


def _reader(path: str, started, done, out) -> None:
    ws = Workspace(path, rank=1)
    reads, versions, bad = 0, set(), []
    started.set()
    give_up = time.monotonic() + 40
    while not done.is_set() and time.monotonic() < give_up:
        try:
            config, weights = ws.read(0)
        except Exception as exc:  # a torn file that does not even load
            bad.append(f"{type(exc).__name__}: {exc}"[:100])
            continue
        if config is None:
            continue
        reads += 1
        w = weights["w"]
        v = config["version"]
        if w.numel() != N or not bool((w == v).all()):
            bad.append(v)
        versions.add(v)
    out.put((reads, len(versions), bad))


@pytest.mark.timeout(90)
def test_a_reader_racing_a_writer_never_reads_a_partial_file(tmp_path):
    """The reader reads all the time the writer writes (counted in writes, not seconds, so
    a loaded machine slows both sides alike) and never sees a torn or mixed file."""
    ctx = multiprocessing.get_context("spawn")
    started, done = ctx.Event(), ctx.Event()
    count, out = ctx.Value("i", 0), ctx.Queue()
    procs = [
        ctx.Process(target=_writer, args=(str(tmp_path), started, done, count)),
        ctx.Process(target=_reader, args=(str(tmp_path), started, done, out)),
    ]
    for p in procs:
        p.start()
    try:
        reads, versions, bad = out.get(timeout=60)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    assert bad == []
    assert count.value == WRITES, count.value
    assert reads >= 3, reads
    assert versions >= 2, versions  # the reads overlapped several writes


# ---------------------------------------------------------------- --workspace on the magics


@pytest.fixture
def magics():
    from IPython.core.interactiveshell import InteractiveShell

    from nbddp.notebook.magics import _MAGICS

    shell = InteractiveShell.instance()
    shell.run_cell("%load_ext nbddp")
    yield _MAGICS[id(shell)]
    shell.run_cell("%unload_ext nbddp")


def test_workspace_options_are_checked_in_one_line_before_anything_starts(magics, tmp_path):
    with pytest.raises(UsageError, match=r"give an absolute path \(every host must mount it"):
        magics.ddp("start --workspace relative/ws")
    open_to_all = tmp_path / "open"
    open_to_all.mkdir(mode=0o777)
    open_to_all.chmod(0o777)
    with pytest.raises(UsageError) as err:
        magics.ddp(f"start --workspace {open_to_all}")
    assert str(err.value) == (
        f"--workspace: refusing the workspace {open_to_all}: other users can write in it "
        f"(mode drwxrwxrwx); chmod 700 {open_to_all}, or name a folder only you can write"
    )
    with pytest.raises(UsageError, match="--workspace: refusing the workspace"):
        magics.ddp(f"attach --world-size 2 --workspace {open_to_all}")
    assert magics.pool is None  # nothing started
