"""Nothing lost with a detached pool, through real kernels (jupyter_client), issue 35.

A kernel is SIGKILLed while its cell runs on a detached pool; a new kernel connects: every
rank's namespace digest (names and values) is what it was plus what that cell did. A
third kernel's ``%ddp connect`` is refused and its ``--force`` takes the pool over: neither
changes anything on the ranks. At 2 and 4 ranks.
"""

from __future__ import annotations

import ast
import os
import signal
import time

import pytest
from test_kernel import execute, kernels, one_usage_error, ranks_printing, restarted  # noqa: F401

from helpers import NAMESPACE_DIGEST, detached_family, wait_gone
from tiers import sizes

pytestmark = pytest.mark.kernel

BUILD = (
    "%%ddp --text\nkept = rank * 11 + 5\ntorch.manual_seed(rank)\nw = torch.randn(3)\n"
    "w0 = w.clone()\nmodel = torch.nn.Linear(3, 2)\nnames = {'a': [rank, 'x'], 'b': (1.5, None)}"
)
LAST = (  # the cell the killed kernel leaves running
    "%%ddp --text\nimport time\nw += 1\nprint('tick', flush=True)\ntime.sleep(3)\nlate = rank * 3"
)


def notebook_value(kc, cell: str, var: str):
    """Run ``%%ddp --out var`` ``cell`` and read ``var`` back from the notebook."""
    r = execute(kc, f"%%ddp --text --quiet --no-auto --out {var}\n{cell}")
    assert r.error is None, r.text
    return ast.literal_eval(execute(kc, f"print(repr({var}))").stdout.strip())


def killed_in(km, kc, cell: str, n: int) -> None:
    """Kernel ``kc`` is SIGKILLed while ``cell`` runs on its detached pool, once each of
    ``n`` ranks printed ``tick``."""
    msg_id = kc.execute(cell)
    printed, deadline = "", time.monotonic() + 60
    while ranks_printing(printed, "tick") != set(range(n)):
        msg = kc.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
        if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "stream":
            printed += msg["content"]["text"]
    os.kill(km.provisioner.process.pid, signal.SIGKILL)
    assert wait_gone([km.provisioner.process.pid]) == []


def digest(kc) -> list[dict[str, str]]:
    return notebook_value(kc, NAMESPACE_DIGEST, "digest_")


@pytest.mark.timeout(400)
@pytest.mark.parametrize("n", sizes(2, 4, ids="{}"))
def test_a_kernel_killed_mid_cell_then_a_second_kernel_lose_nothing(kernels, n):  # noqa: F811
    name = f"kn{n}"
    km_a, a = kernels()
    assert execute(a, "%load_ext nbddp").error is None
    assert execute(a, f"%ddp start -n {n} --detached {name}").error is None
    with detached_family(name) as family:
        assert execute(a, BUILD).error is None
        before = digest(a)

        killed_in(km_a, a, LAST, n)  # kernel A is killed while its cell runs; it runs on

        # kernel B connects: the cell's end, and every rank as it was plus what it did
        _, b = kernels()
        assert execute(b, "%load_ext nbddp").error is None
        r = execute(b, f"%ddp connect {name}")
        assert r.error is None, r.text
        assert "a cell ran meanwhile" in r.stdout, r.text
        after = digest(b)
        for r_ in range(n):
            assert sorted(after[r_]) == sorted([*before[r_], "late", "time"])  # the cell's
            unchanged = {k for k in before[r_] if k != "w"}
            assert {k: after[r_][k] for k in unchanged} == {k: before[r_][k] for k in unchanged}
        assert notebook_value(b, "(torch.equal(w, w0 + 1), late)", "wl_") == [
            (True, r_ * 3) for r_ in range(n)
        ]

        # kernel C: refused, then takes over; neither changes a thing on the ranks
        _, c = kernels()
        assert execute(c, "%load_ext nbddp").error is None
        said = one_usage_error(execute(c, f"%ddp connect {name}"))
        assert "connected to another kernel" in said, said
        assert digest(b) == after
        r = execute(c, f"%ddp connect {name} --force")
        assert r.error is None, r.text
        assert digest(c) == after
        said = one_usage_error(execute(b, "%%ddp --text\nkept"))
        assert "took the detached pool" in said, said
        assert digest(c) == after

        family.stopped_by(lambda: execute(c, f"%ddp stop {name}"))


TRAIN_IN_PLACE = (  # the ranks change the model the notebook sent them, in place
    "%%ddp --text --quiet\nwith torch.no_grad():\n    model.weight.fill_(lr)\n"
    "float(model.weight.sum())"
)
READ = "%%ddp --text --out seen_\n(lr, round(float(model.weight.sum()), 6))"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", sizes(2, 4, ids="{}"))
def test_after_a_kernel_restart_the_ranks_keep_what_an_earlier_kernel_sent(kernels, n):  # noqa: F811
    """Issue 47, item 2: shipped objects' versions were counted from 1 in every kernel. A
    restarted kernel's ``lr`` and fresh ``model`` read by a cell either left the ranks'
    values under a ``shipped lr`` line, or replaced the model the ranks had trained,
    depending only on the order the names were first read. Now the ranks keep theirs,
    the notebook says so once, and ``%ddp push`` sends the notebook's."""
    name = f"kv{n}"
    km, kc = kernels()
    assert execute(kc, "%load_ext nbddp").error is None
    assert execute(kc, f"%ddp start -n {n} --detached {name}").error is None
    with detached_family(name) as family:
        assert execute(kc, "import torch\nlr = 0.1\nmodel = torch.nn.Linear(3, 1)").error is None
        r = execute(kc, TRAIN_IN_PLACE)
        assert r.error is None, r.text
        assert "shipped" in r.text, r.text  # lr and model, automatically

        kc = restarted(km, kc)  # the pool lives on; the new kernel binds both anew
        assert execute(kc, "%load_ext nbddp").error is None
        assert execute(kc, f"%ddp connect {name}").error is None
        setup = "import torch\nmodel = torch.nn.Linear(3, 1)\nlr = 0.001"  # (read in this order)
        assert execute(kc, setup).error is None
        r = execute(kc, READ)
        assert r.error is None, r.text
        kept = [line for line in r.text.splitlines() if "the ranks keep their own" in line]
        assert len(kept) == 1, r.text
        assert kept[0].startswith("nbddp: lr, model: the ranks keep their own"), kept
        assert "%ddp push lr model" in kept[0], kept
        assert "shipped" not in r.text, r.text
        seen = ast.literal_eval(execute(kc, "print(repr(seen_))").stdout.strip())
        assert seen == [(0.1, 0.3)] * n  # the trained model and its lr, on every rank

        r = execute(kc, READ)  # said once
        assert "keep their own" not in r.text, r.text
        assert execute(kc, "%ddp push lr").error is None
        assert execute(kc, READ).error is None
        seen = ast.literal_eval(execute(kc, "print(repr(seen_))").stdout.strip())
        assert seen == [(0.001, 0.3)] * n  # the notebook's lr; the ranks' model still

        family.stopped_by(lambda: execute(kc, f"%ddp stop {name}"))
