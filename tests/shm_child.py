"""Every path that ships a big value, through %%ddp in a real IPython shell, where
/dev/shm is small: run by test_small_shm.py under a 32 MB tmpfs in a mount namespace.

``python shm_child.py N MB``: a pool of N ranks, values of MB megabytes. Each step's
outcome (ok, what it found, what it printed) goes to stdout as one JSON line at the end;
a step that fails does not stop the others.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import sys
import tempfile
import time
import traceback

import torch
from IPython.core.interactiveshell import InteractiveShell

N, MB = int(sys.argv[1]), int(sys.argv[2])
NUMEL = MB * 2**20 // 4
DIGEST = "import hashlib\ndef digest(t): return hashlib.sha256(t.numpy().data).hexdigest()\n"


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.numpy().data).hexdigest()


def randn(seed: int, numel: int = NUMEL) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed))


class Child:
    def __init__(self) -> None:
        self.shell = InteractiveShell.instance()
        self.ns = self.shell.user_ns
        self.printed: list[str] = []
        self.steps: dict[str, dict] = {}

    def run(self, code: str) -> None:
        """A cell; an error in it (printed by IPython) raises here."""
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            result = self.shell.run_cell(code)
        self.printed.append(buf.getvalue())
        if not result.success:
            raise RuntimeError(buf.getvalue()[-3000:])

    def leftovers(self) -> list[str]:
        """Files left in the pool's folders, shared memory and disk (markers aside)."""
        from nbddp.notebook.session import default_pool
        from nbddp.wire.carriers import twin

        shm = default_pool().shm_folder
        left = []
        for top in (shm, twin(shm)):
            for d, _, files in os.walk(top):
                left += [os.path.join(d, f) for f in files if not f.startswith(".spilled-")]
        return left

    def step(self, name: str, body) -> None:
        t0 = time.monotonic()
        try:
            found = body(self)
            self.steps[name] = {"ok": True, "found": found, "left": self.leftovers()}
        except Exception:
            self.steps[name] = {"ok": False, "error": traceback.format_exc()[-3000:]}
        self.steps[name]["seconds"] = round(time.monotonic() - t0, 2)


def need(c: Child) -> bool:
    c.ns["x"] = randn(100)
    c.run(f"%%ddp --need x --quiet --out _d\n{DIGEST}digest(x)")
    return c.ns["_d"] == [digest(c.ns.pop("x"))] * N


def race(c: Child) -> bool:
    """The check said there was room, but the write ran out (another writer was faster):
    the partial file goes, and the value is written again on disk."""
    import nbddp.wire.carriers as carriers

    real, carriers.room = carriers.room, lambda folder, nbytes: True
    try:
        return need(c)
    finally:
        carriers.room = real


def out(c: Child) -> bool:
    seeded = f"torch.randn({NUMEL}, generator=torch.Generator().manual_seed(rank))"
    c.run(f"%%ddp --quiet --out _d\ny = {seeded}\ndigest(y)")
    c.ns["ydig"] = c.ns.pop("_d")
    c.run("%%ddp --quiet --out _v\ny")
    sent = [digest(randn(r)) for r in range(N)]
    return [digest(v) for v in c.ns.pop("_v")] == c.ns["ydig"] == sent


def pull(c: Child) -> bool:
    values = c.shell.run_line_magic("ddp", "pull y --all")
    return [digest(v) for v in values] == c.ns["ydig"]


def gather(c: Child) -> bool:
    c.run(
        "%%ddp --quiet --out _g\nfrom nbddp import gather_tensors\n"
        "got = gather_tensors(y)\n[digest(t) for t in got]"
    )
    return c.ns.pop("_g")[0] == c.ns["ydig"]


def copy(c: Child) -> bool:
    c.run(f"%ddp copy y --from {N - 1}")
    c.run("%%ddp --quiet --out _d\ndigest(y)")
    return c.ns.pop("_d") == [c.ns["ydig"][N - 1]] * N


def push(c: Child) -> bool:
    c.ns["z"] = randn(200)
    c.run("%ddp push z")
    c.run("%%ddp --quiet --no-auto --out _d\ndigest(z)")
    return c.ns.pop("_d") == [digest(c.ns.pop("z"))] * N


def replaced(c: Child) -> bool:
    """A rank dies; its replacement gets the notebook's ``w`` (automatic capture)."""
    c.ns["w"] = randn(300, min(NUMEL, 80 * 2**20 // 4))  # under the automatic limit
    c.run("%%ddp --quiet\nlen(w)")
    with contextlib.suppress(RuntimeError):  # (the death is the cell's error)
        c.run("%%ddp --quiet\nimport os\nif rank == 1:\n    os._exit(3)")
    c.run(f"%%ddp --quiet --out _d\n{DIGEST}digest(w)")  # (rank 1 is new: no digest)
    return c.ns.pop("_d") == [digest(c.ns.pop("w"))] * N


def full(c: Child) -> bool:
    """/dev/shm full to the last byte (by someone else): --need, a gather of objects
    (whose pickle cannot be written there either) and --out still arrive."""
    filler = "/dev/shm/filler"
    fd = os.open(filler, os.O_CREAT | os.O_WRONLY, 0o600)
    try:
        for chunk in (2**20, 4096, 1):  # to the last byte
            with contextlib.suppress(OSError):
                while True:
                    os.write(fd, b"\0" * chunk)
    finally:
        os.close(fd)
    try:
        assert os.statvfs("/dev/shm").f_bavail == 0
        ok = need(c)
        c.run(
            "%%ddp --quiet --out _g\nfrom nbddp import gather_objects\n"
            "got = gather_objects({'y': y})\n[digest(o['y']) for o in got]"
        )
        ok = ok and c.ns.pop("_g")[0] == c.ns["ydig"]
        c.run("%%ddp --quiet --out _v\ny")
        return ok and [digest(v) for v in c.ns.pop("_v")] == c.ns["ydig"]
    finally:
        os.unlink(filler)


def main() -> None:
    c = Child()
    c.run("%load_ext nbddp")
    c.run(f"%ddp start -n {N}")
    c.run("%%ddp --quiet\nimport torch\n" + DIGEST)
    for name, body in [
        ("need", need), ("race", race), ("out", out), ("pull", pull), ("gather", gather),
        ("full", full), ("copy", copy), ("push", push), ("replaced", replaced),
    ]:  # fmt: skip
        c.step(name, body)
    c.run("%ddp stop")
    names = lambda d: sorted(n for n in os.listdir(d) if n.startswith("nbddp"))  # noqa: E731
    after = {"shm": names("/dev/shm"), "tmp": names(tempfile.gettempdir())}
    print(json.dumps({"steps": c.steps, "printed": "".join(c.printed), "after": after}))


if __name__ == "__main__":
    main()
