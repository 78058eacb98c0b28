"""Folded output through a real kernel: the realistic training cell (each rank prints its
own loss line, then a shared line) folds live in the widget, in the frozen cell and in
``--text``; ``--no-fold`` keeps every line. The tests share one kernel and its 4-rank pool
(``shared_kernel``: checked alive, idle and whole after each)."""

from __future__ import annotations

import html
import re

import pytest
from test_kernel import execute

pytestmark = pytest.mark.kernel

TRAINING = """%%ddp -n 4 {flags}
import time, torch, torch.nn as nn
import torch.distributed as dist
torch.manual_seed(rank)
net = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Conv2d(1, 4, 3), nn.Flatten(),
                                                        nn.Linear(144, 2)))
opt = torch.optim.SGD(net.parameters(), lr=0.1)
for epoch in range(2):
    x, y = torch.randn(8, 1, 8, 8), torch.randint(0, 2, (8,))
    loss = nn.functional.cross_entropy(net(x), y)
    opt.zero_grad(); loss.backward(); opt.step()
    print(f"rank {{rank}} epoch {{epoch}} loss {{loss.item():.4f}}")
    print(("ant", "bee", "cat", "dog")[rank], "checked its batch")  # a line of its own
    print(f"epoch {{epoch}} finished")
    time.sleep(0.6)  # the live widget draws the epoch's lines
print("training done")
"""


def run(kc, code: str, timeout: float = 120) -> tuple[dict, list[list], str]:
    """Run ``code``: the error (if any), every live ``lines`` state the widget was sent, and
    the text the cell printed plus the HTML it displayed last (the frozen cell)."""
    reply = execute(kc, code, timeout)
    lines = [state["lines"] for state in reply.states if "lines" in state]
    shown = [d["text/html"] for d in reply.displays if "text/html" in d]
    return reply.error, lines[-1] if lines else [], reply.text + (shown[-1] if shown else "")


def test_the_training_cell_folds_live_frozen_and_in_text_and_no_fold_keeps_each_line(shared_kernel):
    _, kc = shared_kernel
    assert run(kc, "%load_ext nbddp")[0] is None
    error, live, page = run(kc, TRAINING.format(flags=""))
    assert error is None, page
    # live: what the widget showed before the cell ended, each line once, every rank's
    live_text = [(ranks, line) for ranks, _, line, *_ in live]
    assert ("0-3", "epoch 0 finished") in live_text, live_text
    assert all(ranks == "0-3" or "checked" in line for ranks, line in live_text), live_text
    assert all(live_text.count(("0-3", f"epoch {e} finished")) < 2 for e in range(2))
    frozen = html.unescape(re.sub(r"<[^>]+>", "", page))
    for epoch in range(2):  # the log of every rank, folded
        assert frozen.count(f"[0-3] epoch {epoch} finished") == 1, frozen
        # the values' range, the rank at its outlying end named
        loss = (
            rf"\[0-3\] rank \{{0-3\}} epoch {epoch} loss \{{[\d.]+\.\.[\d.]+, (max|min) rank \d\}}"
        )
        assert re.search(loss, frozen)
    assert frozen.count("[0-3] training done") == 1
    assert not re.search(r"\[\d\] (epoch|training)", frozen)
    assert re.search(r"^rank 2 epoch 1 loss [\d.]+$", frozen, re.M)  # in rank 2's own log
    own = re.findall(r"\[(\d)\] \w+ checked its batch", frozen)
    assert own == ["0", "1", "2", "3"] * 2  # each rank's own line, in rank order
    error, _, text = run(kc, TRAINING.format(flags="--text"))
    assert error is None, text
    assert text.count("[ranks 0-3] epoch 1 finished") == 1
    assert text.count("[ranks 0-3] training done") == 1
    assert "[ranks 0-3] rank {0-3} epoch 1 loss {" in text
    error, _, text = run(kc, TRAINING.format(flags="--text --no-fold"))
    assert error is None, text
    for rank in range(4):
        assert f"[rank {rank}] training done" in text
        assert re.search(rf"^\[rank {rank}\] rank {rank} epoch 1 loss [\d.]+$", text, re.M)


def test_one_error_on_every_rank_is_one_traceback_and_another_error_stays_apart(shared_kernel):
    _, kc = shared_kernel
    assert run(kc, "%load_ext nbddp")[0] is None
    error, _, _ = run(kc, "%%ddp -n 4 --text\nx = 1\nprint(undefined_name)")
    assert error["ename"] == "CellFailed"
    shown = "\n".join(error["traceback"])
    assert error["evalue"] == "ranks 0-3: NameError: name 'undefined_name' is not defined"
    assert shown.count("NameError: name 'undefined_name' is not defined") == 2, shown  # tb, end
    assert "--- ranks 0-3 ---" in shown
    # the cell as the notebook shows it: In [N], the %%ddp line counted
    assert re.search(r'File "In \[\d+\]", line 3, in <module>', shown), shown
    assert "ddp-cell" not in shown
    code = "%%ddp --text\nif rank == 2:\n    raise ValueError('first')\n"
    code += "import time; time.sleep(0.3)\n{}[rank]"
    error, _, _ = run(kc, code)
    first, then = error["evalue"].splitlines()
    assert first == "rank 2: ValueError: first"  # the root cause first, apart
    assert re.fullmatch(
        r"ranks 0, 1, 3: KeyError: (\d) \(rank \1's message; the others' differ\)", then
    )


BARS = """%%ddp -n 4
import time
from tqdm import tqdm
for i in tqdm(range(12), desc="train", mininterval=0, miniters=1):
    time.sleep(0.06 * (rank + 1))  # rank 3 is the slowest
print("training done")
"""

PROGRESS = """%%ddp -n 4 --text
import time, nbddp
for i in nbddp.progress(range(12), desc="steps", every=0.05):
    time.sleep(0.06 * (rank + 1))
"""


def test_tqdm_bars_of_ranks_at_different_speeds_are_one_bar_live_and_frozen_and_in_text(
    shared_kernel,
):
    """Live: the log's one bar is the slowest rank's, named, with the spread, and the rows
    show positions, not bars; frozen: one finished bar; --text: nbddp.progress folded."""
    pytest.importorskip("tqdm")
    _, kc = shared_kernel
    assert run(kc, "%load_ext nbddp")[0] is None
    reply = execute(kc, BARS, 120)
    assert reply.error is None, reply.text
    bars = [state["bars"] for state in reply.states if state.get("bars")]
    assert bars, "no live bar was drawn"
    assert all(len(b) == 1 for b in bars), bars  # one bar, not one per rank
    ranks, stream, text, values, _ = bars[-1][0]
    assert (ranks, stream) == ("0-3", "progress")
    assert re.search(r"^train: +\d+%\|.*\(slowest: rank 3; the others up to 1[12]\)$", text)
    assert values.splitlines()[3].startswith("rank 3: ")  # each rank's position, pointed at
    rows = [state["rows"] for state in reply.states if "rows" in state]
    assert not any("%|" in r for r in rows)  # a row shows its rank's position
    assert any(re.search(r">\d+/12</span>", r) for r in rows)
    frozen = html.unescape(re.sub(r"<[^>]+>", "", reply.html))
    assert len(re.findall(r"\[0-3\] train: 100%\|", frozen)) == 1, frozen
    assert not re.search(r"\[\d\] train:", frozen)
    error, _, text = run(kc, PROGRESS)
    assert error is None, text
    said = [line for line in text.splitlines() if "steps" in line]
    assert said[-1] == "[ranks 0-3] steps 12/12 (100%)", said
    assert all(line.startswith("[ranks 0-3] steps ") for line in said), said
    assert any(line.endswith(")") and "(slowest: rank 3; the others up to" in line for line in said)
