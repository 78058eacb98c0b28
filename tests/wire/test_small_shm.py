"""Small shared memory is not an error (issue 35, item 8): under a small /dev/shm (Docker's
64 MB default, Kubernetes pods), every path that ships a value three times its size
(--need, --out, pull, push, copy, gather_tensors, a replaced rank's automatic capture)
succeeds with the same
bytes, through a private folder on disk: also when a write runs out of space midway
("race"), and when /dev/shm is full to the last byte ("full"). The pool says so once,
with the figure, and leaves nothing in /dev/shm or on disk.

Each world size runs once, in a child (tests/shm_child.py) inside a mount namespace
with a 32 MB tmpfs over /dev/shm (``unshare --mount``: root, or a user namespace);
the tests below read its report, one per path.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tiers import sizes

HERE = Path(__file__).resolve().parents[1]
SRC = HERE.parent / "src"
# each value over three times what /dev/shm holds: 32 MB here, half of Docker's 64 MB
# default, so the same ratio ships half the bytes
MB = 100
MOUNT = "mount -t tmpfs -o size=32m tmpfs /dev/shm"


def _namespaces_work() -> str | None:
    """Why a 64 MB /dev/shm cannot be made here (None: it can)."""
    if shutil.which("unshare") is None:
        return "no unshare(1) here"
    probe = subprocess.run(
        ["unshare", "--mount", "sh", "-c", MOUNT], capture_output=True, text=True, timeout=30
    )
    if probe.returncode:
        return f"cannot mount a tmpfs in a mount namespace: {probe.stderr.strip()[:200]}"
    return None


WHY_NOT = _namespaces_work()
pytestmark = [
    pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or ""),
    pytest.mark.timeout(600),
]


@pytest.fixture(scope="module", params=sizes(2, 4))
def report(request, tmp_path_factory):
    """The child's report at ``n`` ranks, and the private temp dir it ran with."""
    tmp = tmp_path_factory.mktemp(f"smallshm{request.param}")
    env = dict(os.environ, TMPDIR=str(tmp), PYTHONPATH=str(SRC))
    env.pop("NBDDP_SHM_DIR", None)
    child = f"{MOUNT} && exec {sys.executable} {HERE / 'shm_child.py'} {request.param} {MB}"
    proc = subprocess.run(
        ["unshare", "--mount", "sh", "-c", child],
        capture_output=True,
        text=True,
        timeout=540,
        env=env,
        cwd=tmp,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), tmp


PATHS = ["need", "race", "out", "pull", "gather", "full", "copy", "push", "replaced"]


@pytest.mark.parametrize("path", PATHS)
def test_a_value_three_times_the_size_of_shared_memory_arrives_whole(report, path):
    step = report[0]["steps"][path]
    assert step["ok"], step.get("error")
    assert step["found"] is True, "the bytes that arrived are not the bytes sent"
    assert step["left"] == [], "files were left in the pool's folders"


def test_the_pool_says_once_where_such_values_go_with_the_figure(report):
    printed = report[0]["printed"]
    said = [line for line in printed.splitlines() if "/dev/shm holds" in line]
    assert len(said) == 1, printed[-3000:]
    assert said[0].startswith("nbddp: /dev/shm holds 32.0 MB here (")
    assert "go through a private folder on disk (" in said[0]
    assert "No space left" not in printed


def test_nothing_is_left_in_shared_memory_nor_on_disk(report):
    after, tmp = report
    assert after["after"] == {"shm": [], "tmp": []}
    assert [p.name for p in tmp.iterdir() if p.name.startswith("nbddp")] == []
