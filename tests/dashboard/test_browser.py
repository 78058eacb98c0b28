"""The dashboard in a real browser: JupyterLab on loopback, headless Debian Chromium: a
failing rank, 16 ranks folding, pdb in the input box, a replaced rank, and the README's
picture (scripts/screenshot.sh). The charts: test_browser_charts.py.

Skipped where /usr/bin/chromium, playwright or jupyterlab is missing; CI
installs all three (.ci/run). A screenshot is kept in artifacts/.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from browser_kit import (
    ARTIFACTS,
    SKIPS,
    frozen_chart,
    frozen_dashboard,
    playwright,
    readable,
    run_all,
    screenshot_after,
    svg_class,
)
from tiers import slow

pytestmark = SKIPS

CELLS = [
    "%load_ext nbddp",
    "%%ddp -n 4\n"
    "import sys, time, torch.distributed as dist\n"
    "print(f'hello from rank {rank}')\n"
    "print(f'a warning on rank {rank}', file=sys.stderr)\n"
    "t = torch.ones(1)\n"
    "if rank == 2:\n"
    "    time.sleep(4)  # the live dashboard is looked at meanwhile\n"
    "    raise ValueError('rank two is unhappy')\n"
    "dist.all_reduce(t)",
]


# 16 ranks: the same lines fold into one, rank 7 fails before the collective
CELLS_16 = [
    "%load_ext nbddp",
    "%%ddp -n 16\n"
    "import time, torch.distributed as dist\n"
    "for epoch in range(3):\n"
    "    print(f'epoch {epoch} loss 0.25')\n"
    "t = torch.ones(1)\n"
    "if rank == 7:\n"
    "    time.sleep(4)  # the live dashboard is looked at meanwhile\n"
    "    raise ValueError('rank seven is unhappy')\n"
    "dist.all_reduce(t)",
]


@slow
@pytest.mark.timeout(300)
def test_a_rank_of_four_failing_before_a_collective_ends_the_cell_with_its_row_red(lab, page):
    expect = playwright.expect
    url, _ = lab
    with screenshot_after(page, "dashboard.png"):
        cell = run_all(page, url)
        error = cell.locator(
            ".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']"
        )
        # while it runs: the live widget, a row per rank, every rank's lines in the first tab
        live = cell.locator(".nbddp-dashboard")
        expect(live).to_be_visible(timeout=120_000)
        expect(live.locator(".nbddp-row")).to_have_count(4)
        expect(live.locator(".nbddp-row.nbddp-running")).not_to_have_count(0)
        # lines that differ only in their numbers fold into one, with their values
        expect(live.locator(".nbddp-pane:visible")).to_contain_text("[0-3] hello from rank {0-3}")
        page.screenshot(path=str(ARTIFACTS / "dashboard-live.png"), full_page=True)
        expect(error).to_contain_text("rank 2: ValueError: rank two is unhappy", timeout=120_000)
        expect(error).to_contain_text(
            "ranks 0, 1, 3: freed from a collective (all_reduce) after rank 2 failed"
        )
        expect(cell.locator(".jp-InputArea-prompt")).not_to_contain_text("[*]")  # it ended
        ranks = cell.locator(".nbddp-ranks")  # each row ends with the rank's last line
        for rank in range(4):
            expect(ranks).to_contain_text(f"rank {rank}")
        failed = cell.locator(".nbddp-row.nbddp-failed")
        expect(failed).to_have_count(1)
        assert failed.get_attribute("data-rank") == "2"
        background = failed.evaluate("e => getComputedStyle(e).backgroundColor")
        assert background == "rgba(198, 40, 40, 0.15)"  # a red tint over the theme's
        readable(failed.locator("td").nth(1), "`failed` on its row")
        expect(cell.locator(".nbddp-row.nbddp-freed")).to_have_count(3)
        # the failed rank's pane is the one open, and shows its lines, stderr apart
        pane = cell.locator(".nbddp-pane:visible")
        expect(pane).to_contain_text("hello from rank 2")
        warning = pane.locator("span", has_text="a warning on rank 2")
        readable(warning, "a stderr line")
        colours = [e.evaluate("e => getComputedStyle(e).color") for e in (warning, pane)]
        assert colours[0] != colours[1]  # coloured apart from stdout
        assert "Loading widget" not in cell.locator(".jp-Cell-outputArea").inner_text()
        # the finished dashboard is frozen: static HTML, no widget view left
        expect(cell.locator(".nbddp-summary")).to_have_count(1)
        expect(cell.locator(".jupyter-widgets")).to_have_count(0)
        # the "all ranks" log interleaves every rank, labelled
        everyone = cell.locator("details.nbddp-log-all")
        everyone.locator("summary").click()
        expect(everyone.locator(".nbddp-pane")).to_contain_text("[0-3] hello from rank {0-3}")


@slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("lab", [CELLS_16], indirect=True)
def test_sixteen_ranks_fold_their_lines_and_the_failed_rank_stands_out(lab, page):
    expect = playwright.expect
    url, _ = lab
    with screenshot_after(page, "dashboard-16.png"):
        cell = run_all(page, url)
        live = cell.locator(".nbddp-dashboard.nbddp-live")
        expect(live).to_be_visible(timeout=120_000)
        # 48 lines from 16 ranks are three folded lines
        pane = live.locator(".nbddp-pane")
        for epoch in range(3):
            expect(pane).to_contain_text(f"[0-15] epoch {epoch} loss 0.25")
        expect(pane.locator(".nbddp-line")).to_have_count(3)
        # one rank's log, picked from the list
        live.locator("select.nbddp-choose").select_option("7")
        expect(pane).to_contain_text("epoch 2 loss 0.25")
        expect(pane).not_to_contain_text("[0-15]")
        page.screenshot(path=str(ARTIFACTS / "dashboard-16-live.png"), full_page=True)
        error = cell.locator(
            ".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']"
        )
        expect(error).to_contain_text("rank 7: ValueError: rank seven is unhappy", timeout=120_000)
        expect(cell.locator(".jp-InputArea-prompt")).not_to_contain_text("[*]")
        failed = cell.locator(".nbddp-row.nbddp-failed")
        expect(failed).to_have_count(1)
        assert failed.get_attribute("data-rank") == "7"
        expect(cell.locator(".nbddp-row.nbddp-freed")).to_have_count(15)
        expect(cell.locator(".jupyter-widgets")).to_have_count(0)  # frozen
        everyone = cell.locator("details.nbddp-log-all")
        expect(everyone).to_contain_text("all ranks log (3 lines)")


CELLS_PDB = [
    "%load_ext nbddp",
    "%%ddp -n 3\nx = rank * 10\nif rank == 1:\n    breakpoint()\n    y = x + 1\n"
    "print('after', rank)",
]


@slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("lab", [CELLS_PDB], indirect=True)
def test_a_breakpoint_in_a_rank_asks_in_the_cells_input_box(lab, page):
    expect = playwright.expect
    url, _ = lab
    with screenshot_after(page, "debugger-end.png"):
        cell = run_all(page, url)
        box = cell.locator(".jp-Stdin-input")
        expect(box).to_be_visible(timeout=120_000)
        expect(cell.locator(".jp-Stdin-prompt")).to_contain_text("(Pdb rank 1)")
        expect(cell.locator(".nbddp-row.nbddp-debugging")).to_have_count(1)  # the dashboard
        expect(cell.locator(".jp-Cell-outputArea")).to_contain_text("-> y = x + 1")
        box.fill("p x")
        box.press("Enter")
        outputs = cell.locator(".jp-Cell-outputArea")
        expect(outputs).to_contain_text("10")
        page.screenshot(path=str(ARTIFACTS / "debugger.png"), full_page=True)
        expect(cell.locator(".jp-Stdin-input")).to_have_count(2)  # the next line's box
        box = cell.locator(".jp-Stdin-input").last
        expect(box).to_be_visible()
        box.fill("c")
        box.press("Enter")
        expect(cell.locator(".jp-InputArea-prompt")).not_to_contain_text("[*]", timeout=60_000)
        expect(cell.locator(".nbddp-row.nbddp-done")).to_have_count(3)
        # two lines asked and answered, no third prompt. JupyterLab shows an answered line
        # as a spent input box, 4.6 also (or instead) as the prompt and answer in text: each
        # way must count two.
        answered = outputs.inner_text()
        lines = [line for line in answered.splitlines() if line.startswith("(Pdb rank 1)")]
        as_text = [line.split(")", 1)[1].strip() for line in lines]
        as_text = [a for a in as_text if a]
        boxes = cell.locator(".jp-Stdin-prompt").count()
        assert as_text in ([], ["p x", "c"]), answered
        assert max(len(as_text), boxes) == 2, (boxes, answered)


# rank 2 of 4 kills itself while the others wait for it in all_reduce; the cell after it
CELLS_REPLACED = [
    "%load_ext nbddp",
    "%%ddp -n 4\n"
    "import os, signal, time, torch.distributed as dist\n"
    "kept = rank * 10\n"
    "t = torch.ones(1)\n"
    "print(f'ready on rank {rank}')\n"
    "if rank == 2:\n"
    "    time.sleep(2)  # the others wait in all_reduce meanwhile\n"
    "    os.kill(os.getpid(), signal.SIGKILL)\n"
    "dist.all_reduce(t)",
    "%%ddp\n"
    "import torch.distributed as dist\n"
    "t = torch.ones(1) * (rank + 1)\n"
    "dist.all_reduce(t)\n"
    "print(f'sum {t.item():g}')\n"
    "print(f\"kept {globals().get('kept')}\")",
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("lab", [CELLS_REPLACED], indirect=True)
def test_a_rank_of_four_killed_in_a_collective_is_replaced_and_the_next_cell_runs(lab, page):
    expect = playwright.expect
    url, _ = lab
    with screenshot_after(page, "replaced-rank.png"):
        cell = run_all(page, url)  # "Run all" stops at the cell's error
        error = cell.locator(
            ".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']"
        )
        expect(error).to_contain_text("rank 2 died (killed by SIGKILL)", timeout=120_000)
        expect(error).to_contain_text(
            "ranks 0, 1, 3: freed from a collective (all_reduce) after rank 2 died; state kept"
        )
        expect(error).to_contain_text("rank 2: a new process took its place; it had ")
        expect(error).to_contain_text("the process group was re-formed with the new rank 2")
        expect(cell.locator(".jp-InputArea-prompt")).not_to_contain_text("[*]")
        # the dashboard: rank 2's row red and saying it has a new process, the others freed
        dead = cell.locator(".nbddp-row.nbddp-replaced")
        expect(dead).to_have_count(1)
        assert dead.get_attribute("data-rank") == "2"
        expect(dead).to_contain_text("dead: new process")
        tint = dead.evaluate("e => getComputedStyle(e).backgroundColor")
        assert tint == "rgba(198, 40, 40, 0.15)"
        readable(dead.locator("td").nth(1), "`dead: new process` on its row")
        freed = cell.locator(".nbddp-row.nbddp-freed")
        expect(freed).to_have_count(3)
        assert sorted(freed.nth(i).get_attribute("data-rank") for i in range(3)) == ["0", "1", "3"]
        for i in range(3):
            expect(freed.nth(i)).to_contain_text("freed")
        expect(cell.locator(".jupyter-widgets")).to_have_count(0)  # frozen
        # the next cell, run by hand: all 4 ranks, the survivors' state kept
        cells = page.locator(".jp-Notebook .jp-Cell")
        after = cells.nth(2)
        after.locator(".jp-InputPrompt").click()
        page.keyboard.press("Escape")
        page.keyboard.press("Control+Enter")  # run it, add no cell below
        expect(after.locator(".nbddp-row.nbddp-done")).to_have_count(4, timeout=60_000)
        expect(after.locator(".jp-InputArea-prompt")).not_to_contain_text("[*]")
        expect(after.locator(".jupyter-widgets")).to_have_count(0)
        log = after.locator("details.nbddp-log-all .nbddp-pane")
        expect(log).to_contain_text("[0-3] sum 10")
        expect(log).to_contain_text("[0-1,3] kept {0,10,30}")  # (numbers fold)
        expect(log).to_contain_text("[2] kept None")
        stderr = ".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']"
        expect(after.locator(stderr)).to_have_count(0)  # no error, no note of lost state
        # the picture (docs/img/replaced-rank.png): the notebook alone, both cells whole
        page.evaluate(
            "() => { window.jupyterapp.commands.execute('application:toggle-left-area'); }"
        )
        expect(page.locator(".jp-DirListing")).to_be_hidden()
        page.set_viewport_size({"width": 1100, "height": 1500})
        panel = page.locator(".jp-NotebookPanel").bounding_box()
        first, last = cells.nth(0).bounding_box(), after.bounding_box()
        top, bottom = first["y"] - 10, last["y"] + last["height"] + 10
        clip = {"x": panel["x"], "y": top, "width": panel["width"], "height": bottom - top}
        page.screenshot(path=str(ARTIFACTS / "replaced-rank-notebook.png"), clip=clip)


# -- the README's picture (scripts/screenshot.sh): a real training cell, all in view

CELLS_SHOWCASE = [
    "%load_ext nbddp",
    "%%ddp -n 4\n"
    "import math, time, torch, torch.distributed as dist, nbddp\n"
    "from tqdm import tqdm\n"
    "for epoch in range(3):\n"
    "    for step in tqdm(range(100), desc=f'epoch {epoch}', mininterval=0.1):\n"
    "        s = epoch * 100 + step\n"
    "        loss = (1 + 0.1 * rank) * math.exp(-s / 70) + 0.03 * math.sin(s / 5 + 2 * rank)\n"
    "        nbddp.log_metrics({'loss': loss + 0.05}, step=s)\n"
    "        time.sleep(0.02 * (1 + 0.5 * rank))  # rank 3 is the slowest\n"
    "    mean = torch.tensor([loss])\n"
    "    dist.all_reduce(mean)  # the ranks meet at the end of each epoch\n"
    "    print(f'rank {rank} epoch {epoch} loss {loss + 0.05:.4f}')\n"
    "    print(f'epoch {epoch}: mean loss {mean.item() / world_size:.4f}')\n"
    "print('checkpoint saved')",
]


def picture(name: str) -> Path:
    """Where a picture goes: docs/img/ with NBDDP_SCREENSHOT set (scripts/screenshot.sh),
    else artifacts/."""
    ARTIFACTS.mkdir(exist_ok=True)
    if os.environ.get("NBDDP_SCREENSHOT"):
        return ARTIFACTS.parent / "docs" / "img" / name
    return ARTIFACTS / name


@slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("lab", [CELLS_SHOWCASE], indirect=True)
def test_a_training_cell_shows_one_folded_bar_and_a_folded_lines_values_a_click_away(lab, browser):
    """Live: the ranks' tqdm bars as one, the slowest rank named (docs/img/folded-bar.png);
    a folded line's per-rank values a click (and a hover) away. Frozen: the same values on
    hover; the README's picture (docs/img/dashboard.png)."""
    expect = playwright.expect
    url, _ = lab
    page = browser.new_page(viewport={"width": 1000, "height": 1400}, device_scale_factor=2)
    try:
        cell = run_all(page, url)
        page.evaluate(
            "() => { window.jupyterapp.commands.execute('application:toggle-left-area'); }"
        )
        live = cell.locator(".nbddp-dashboard.nbddp-live")
        bar = live.locator(".nbddp-bar-live")
        expect(bar).to_contain_text("(slowest: rank", timeout=120_000)
        expect(bar).to_have_count(1)  # one bar, not one per rank
        expect(live.locator(".nbddp-ranks")).not_to_contain_text("%|")  # rows: positions
        live.screenshot(path=str(picture("folded-bar.png")))
        # a folded line: its values on hover (title) and below it on a click
        loss = live.locator(".nbddp-folded", has_text="epoch 0 loss {")
        expect(loss).to_have_count(1, timeout=60_000)
        expect(loss).to_contain_text(re.compile(r"loss \{[\d.]+\.\.[\d.]+, (max|min) rank \d\}"))
        assert "rank 3: 3 0 " in loss.get_attribute("title")
        loss.click()
        values = live.locator(".nbddp-values")
        expect(values).to_contain_text("loss lowest", timeout=5_000)
        expect(values).to_contain_text("rank 2: 2 0 ")
        page.screenshot(path=str(ARTIFACTS / "folded-values.png"))
        frozen = frozen_dashboard(cell)
        log = frozen.locator("details.nbddp-log-all")
        expect(log).to_have_attribute("open", "")
        folded = log.locator(".nbddp-folded", has_text="epoch 2 loss {")
        folded.hover()
        assert "rank 1: 1 2 " in folded.get_attribute("title")
        expect(log).to_contain_text("[0-3] epoch 2: mean loss")
        expect(log).to_contain_text(re.compile(r"\[0-3\] epoch 2: 100%\|[#█]+\| 100/100"))
        expect(log).to_contain_text("[0-3] checkpoint saved")
        loss_chart, root = frozen_chart(frozen, "loss")
        lines = svg_class(root, "nbddp-line")
        assert [e.get("data-label") for e in lines] == [f"rank {r}" for r in range(4)]
        outputs = cell.locator(".jp-Cell-outputArea")
        for shown in (loss_chart, log):
            expect(shown).to_be_in_viewport()
        box = outputs.bounding_box()  # the outputs, not the empty prompt column left of them
        left = outputs.locator(".jp-OutputArea-output").first.bounding_box()["x"] - 8
        clip = {
            **box,
            "x": left,
            "width": box["x"] + box["width"] - left,
            "height": box["height"] + 8,
        }
        target = picture("dashboard.png")
        page.screenshot(path=str(target), clip=clip)
        print(f"screenshot: {target}")
    finally:
        page.screenshot(path=str(ARTIFACTS / "dashboard-showcase-page.png"), full_page=True)
