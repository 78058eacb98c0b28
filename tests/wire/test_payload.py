"""Payloads: cloudpickle, with big tensors through shared-memory files."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from nbddp.wire import carriers, payload


@pytest.fixture
def directory(tmp_path):
    return str(tmp_path)


def test_big_tensors_go_through_files_and_come_back_as_real_tensors(directory):
    big = torch.randn(1 << 19)  # 2 MB
    shipment = payload.dumps({"big": big, "small": torch.ones(3)}, directory)
    assert len(shipment.files) == 1
    assert len(shipment.data) < 10_000
    loaded = payload.loads(shipment.data)
    shipment.remove()
    assert not os.listdir(directory)
    assert torch.equal(loaded["big"], big)
    assert torch.equal(loaded["small"], torch.ones(3))
    loaded["big"][0] = 123.0  # its own memory: writable, and the original is untouched
    assert big[0] != 123.0


def test_parameters_keep_their_type_and_grad_flag(directory):
    p = torch.nn.Parameter(torch.randn(1 << 19))
    frozen = torch.nn.Parameter(torch.randn(1 << 19), requires_grad=False)
    loaded = payload.loads(payload.dumps([p, frozen], directory).data)
    assert isinstance(loaded[0], torch.nn.Parameter)
    assert loaded[0].requires_grad
    assert isinstance(loaded[1], torch.nn.Parameter)
    assert not loaded[1].requires_grad


def test_modules_round_trip_with_their_weights(directory):
    model = torch.nn.Linear(1024, 1024)
    shipment = payload.dumps(model, directory)
    assert shipment.files  # the 4 MB weight went through a file
    loaded = payload.loads(shipment.data)
    assert torch.equal(loaded.weight, model.weight)
    assert torch.equal(loaded.bias, model.bias)


def test_numpy_arrays_and_odd_tensors(directory):
    arr = np.arange(1 << 18, dtype=np.float64)
    view = torch.randn(1024, 1024)[:, ::2]  # not contiguous
    half = torch.randn(1 << 20, dtype=torch.bfloat16)
    loaded = payload.loads(payload.dumps([arr, view, half], directory).data)
    assert isinstance(loaded[0], np.ndarray)
    assert (loaded[0] == arr).all()
    assert torch.equal(loaded[1], view)
    assert torch.equal(loaded[2], half)


def test_without_a_directory_everything_is_inline(directory):
    shipment = payload.dumps(torch.randn(1 << 19))
    assert shipment.files == []
    assert len(shipment.data) > 2_000_000


def test_a_failed_dump_leaves_no_files(directory):
    import threading

    with pytest.raises(TypeError):
        payload.dumps([torch.randn(1 << 19), threading.Lock()], directory)
    assert not os.listdir(directory)


def test_shared_memory_folders_of_dead_processes_are_swept(tmp_path):
    import subprocess
    import sys

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    ).stdout.strip()
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    stale = os.path.join(base or "/tmp", f"nbddp-{dead}-leftover")
    os.makedirs(stale)
    mine = payload.shm_dir()
    try:
        assert not os.path.exists(stale)
        assert os.path.basename(mine).startswith(f"nbddp-{os.getpid()}-")
    finally:
        os.rmdir(mine)


def test_a_pool_leaves_no_shared_memory_behind():
    from nbddp import Pool

    before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    with Pool(2) as pool:
        assert pool.execute("torch.ones(2**20).sum().item()") == [2.0**20] * 2
        assert pool.execute("torch.ones(2**20)")[1].shape == (2**20,)  # a big value, back
        os.kill(pool.pids[1], 9)  # a killed rank cleans up nothing itself
    after = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    assert not {n for n in after - before if n.startswith("nbddp-") and not _elsewhere(n)}


def _elsewhere(name: str) -> bool:
    """A folder of another live process (a test run beside this one): not this test's."""
    import psutil

    pid = name.split("-")[1]
    return pid.isdigit() and int(pid) != os.getpid() and psutil.pid_exists(int(pid))


# ---------------------------------------------------------------- views share their storage


def test_views_of_one_tensor_stay_views_of_one_tensor(directory):
    """What torch.save keeps: writing through one view shows in the other, big or small."""
    for a in (torch.arange(10), torch.arange(1 << 20)):  # inline, then through a file
        shipment = payload.dumps({"a": a, "b": a[2:5], "t": a[:8].view(2, 4).t()}, directory)
        loaded = payload.loads(shipment.data)
        shipment.remove()
        b, t = loaded["b"], loaded["t"]
        assert torch.equal(b, a[2:5])
        assert torch.equal(t, a[:8].view(2, 4).t())
        assert t.stride() == (1, 4)
        b[0] = 99
        assert loaded["a"][2].item() == 99
        assert t[2, 0].item() == 99
        assert a[2].item() == 2  # the sender's tensor is untouched


def test_a_view_of_another_dtype_shares_too(directory):
    a = torch.zeros(1 << 19)  # 2 MB of float32
    loaded = payload.loads(payload.dumps([a, a.view(torch.int32)], directory).data)
    loaded[1][0] = 1
    assert loaded[0][0].item() == torch.tensor([1], dtype=torch.int32).view(torch.float32).item()


def test_a_small_view_of_a_big_tensor_writes_only_its_own_bytes():
    big = torch.arange(1 << 22, dtype=torch.float32)  # 16 MB
    folder = payload.shm_dir()
    try:
        shipment = payload.dumps({"v": big[1000:1010]}, folder)
        (path,) = shipment.files
        assert os.stat(path).st_blocks * 512 <= 8192  # a page or two; the rest is a hole
        assert payload.loads(shipment.data)["v"].tolist() == list(range(1000, 1010))
        shipment.remove()
    finally:
        os.rmdir(folder)


def test_small_tensors_keep_their_grad_flag_and_attributes():
    t = torch.ones(3, requires_grad=True)
    t.tag = "kept"
    loaded = payload.loads(payload.dumps(t).data)
    assert loaded.requires_grad
    assert loaded.tag == "kept"
    conj = torch.tensor([1 + 2j]).conj()  # torch's own pickling: the conjugate bit is kept
    assert payload.loads(payload.dumps(conj).data).tolist() == [1 - 2j]


@pytest.mark.parametrize("n", [2, 3])
def test_views_shipped_to_a_pool_are_views_there(n):
    from nbddp import Pool

    small = torch.arange(10)
    big = torch.arange(1 << 20)  # 8 MB: through the pool's shared-memory folder
    with Pool(n) as pool:
        needs = {"a": small, "b": small[2:5], "c": big, "d": big[2:5]}
        seen = pool.execute("b[0] = 99; d[0] = 98; (a[2].item(), c[2].item())", needs=needs)
        assert seen == [(99, 98)] * n
    assert small[2].item() == 2
    assert big[2].item() == 2


# ---------------------------------------------------------------- who owns a folder in /dev/shm

HOLD_LOCK = (
    "import fcntl, os, sys\n"
    "fd = os.open(sys.argv[1], os.O_RDONLY)\n"
    "fcntl.flock(fd, fcntl.LOCK_EX)\n"
    "print('held', flush=True)\n"
    "sys.stdin.read()\n"
)


def test_a_folder_is_kept_while_its_lock_is_held_whatever_pid_its_name_carries():
    """/dev/shm shared across PID namespaces (--ipc=host): the pid in a folder's name may
    be dead here yet alive there, or alive here and someone else's. The lock decides."""
    import subprocess
    import sys

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    ).stdout.strip()
    base = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"
    mine = payload.shm_dir()  # the new kind of folder, made by a live owner: held
    live = os.path.join(os.path.dirname(mine), f"nbddp-{dead}-Lheldelsewhere")
    orphan = os.path.join(base, f"nbddp-{os.getpid()}-Lnobodyholdsit")  # pid alive, no owner
    os.makedirs(live, mode=0o700)
    os.makedirs(orphan, mode=0o700)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, live], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    made = []
    try:
        assert holder.stdout.readline() == b"held\n"
        made.append(payload.shm_dir())  # sweeps
        assert os.path.isdir(live), "a folder whose lock a live process holds was removed"
        assert os.path.isdir(mine)
        assert not os.path.exists(orphan), "a folder nobody holds was kept"
        holder.stdin.close()
        assert holder.wait() == 0
        made.append(payload.shm_dir())  # the holder is gone: now it goes
        assert not os.path.exists(live)
        assert os.path.isdir(mine)
    finally:
        holder.kill()
        holder.wait()
        for path in [mine, live, orphan, *made]:
            if os.path.isdir(path):
                os.rmdir(path)


def test_the_lock_of_a_removed_folder_is_let_go():
    """Pools remove their folder themselves; the lock's descriptor goes at the next call."""
    first = payload.shm_dir()
    os.rmdir(first)
    second = payload.shm_dir()
    try:
        assert first not in carriers._held
        assert second in carriers._held
    finally:
        os.rmdir(second)


@pytest.fixture
def small_shm(monkeypatch):
    """A fresh shared-memory folder (and its disk twin) where /dev/shm has no room left."""
    if not os.path.isdir(carriers.SHM):
        pytest.skip("no /dev/shm here")
    real = carriers.room
    monkeypatch.setattr(
        carriers, "room", lambda f, n: not f.startswith(carriers.SHM) and real(f, n)
    )
    folder = payload.shm_dir()
    yield folder
    disk = carriers.twin(folder)
    payload.remove_locked_dir(folder)
    assert not os.path.exists(folder)
    assert not os.path.exists(disk)


def test_what_does_not_fit_in_shared_memory_goes_to_its_twin_on_disk_read_not_mapped(small_shm):
    disk = carriers.twin(small_shm)
    assert os.path.isdir(disk)
    assert os.stat(disk).st_mode & 0o777 == 0o700
    big, arr = torch.randn(1 << 19), np.arange(1 << 18, dtype=np.float64)
    shipment = payload.dumps({"big": big, "arr": arr, "view": big[10:20]}, small_shm)
    assert [os.path.dirname(f) for f in shipment.files] == [disk, disk]
    assert b"_read_storage_file" in shipment.data
    assert b"_load_storage_file" not in shipment.data
    assert carriers.spilled(small_shm) == ["disk"]  # for the pool's one note
    loaded = payload.loads(shipment.data)
    shipment.remove()
    assert torch.equal(loaded["big"], big)
    assert (loaded["arr"] == arr).all()
    assert loaded["view"].untyped_storage().data_ptr() == loaded["big"].untyped_storage().data_ptr()
    assert [f for f in os.listdir(small_shm) if not f.startswith(".spilled-")] == []
    assert os.listdir(disk) == []


def test_with_no_room_on_disk_either_big_tensors_go_inside_the_pickle(small_shm, monkeypatch):
    monkeypatch.setattr(carriers, "room", lambda f, n: False)
    big = torch.randn(1 << 19)
    shipment = payload.dumps(big, small_shm)
    assert shipment.files == []
    assert len(shipment.data) > big.nbytes
    assert torch.equal(payload.loads(shipment.data), big)
    assert carriers.spilled(small_shm) == ["message"]


def test_a_folder_outside_shared_memory_is_used_as_it_always_was(directory, monkeypatch):
    monkeypatch.setattr(carriers, "room", lambda f, n: False)  # (never asked)
    shipment = payload.dumps(torch.randn(1 << 19), directory)
    assert [os.path.dirname(f) for f in shipment.files] == [directory]
    shipment.remove()


def test_a_write_that_runs_out_midway_is_undone_and_goes_to_disk(small_shm, monkeypatch):
    """The check said there was room, another writer took it: ENOSPC inside a gather's
    folder. The partial file goes; the value is written again in the twin's own folder."""
    import errno
    import tempfile

    monkeypatch.setattr(carriers, "room", lambda f, n: True)
    real, calls = payload._put, []

    def put(fd, view, at):
        calls.append(at)
        if len(calls) == 1:
            real(fd, view[: len(view) // 2], at)  # half of it, then the filesystem is full
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, view, at)

    monkeypatch.setattr(payload, "_put", put)
    folder = tempfile.mkdtemp(prefix="gather-", dir=small_shm)
    big = torch.randn(1 << 19)
    shipment = payload.dumps(big, folder)
    assert os.listdir(folder) == []  # the partial file is gone
    assert [os.path.dirname(f) for f in shipment.files] == [carriers.twin(folder)]
    assert torch.equal(payload.loads(shipment.data), big)
    assert carriers.spilled(small_shm) == ["disk"]
    shipment.remove()
