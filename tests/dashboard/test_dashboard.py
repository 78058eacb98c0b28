from __future__ import annotations

import io
import re

import pytest

from nbddp.dashboard.fold import rank_set
from nbddp.dashboard.theme import FAILED_ROW, MUTED, state_colour
from nbddp.dashboard.view import Dashboard, TextSink
from nbddp.wire import protocol as P


def make(**kw):
    out, err = io.StringIO(), io.StringIO()
    return TextSink(stdout=out, stderr=err, **kw), out, err


def end(errors=()):
    return P.CellEnd(1, (0, 1), errors={r: P.ErrorInfo("E", "m", "tb") for r in errors})


def test_lines_are_prefixed_by_rank_and_streams_kept_apart():
    sink, out, err = make()
    sink.handle(P.Output(0, "stdout", "a\nb"))
    sink.handle(P.Output(1, "stderr", "warn\n"))
    assert out.getvalue() == "[rank 0] a\n"  # "b" waits for its newline
    sink.handle(P.Output(0, "stdout", "c\n"))
    sink.close(end())
    assert out.getvalue() == "[rank 0] a\n[rank 0] bc\n"
    assert err.getvalue() == "[rank 1] warn\n"


def test_a_partial_last_line_is_printed_at_the_end():
    sink, out, _ = make()
    sink.handle(P.Output(0, "stdout", "no newline"))
    sink.close(end())
    assert out.getvalue() == "[rank 0] no newline\n"


def test_carriage_returns_keep_the_last_state_of_a_progress_line():
    sink, out, _ = make()
    sink.handle(P.Output(0, "stdout", " 10%\r 50%\r100%\n"))
    sink.close(end())
    assert out.getvalue() == "[rank 0] 100%\n"


def test_output_is_bounded_keeping_the_tail_and_counting_the_rest():
    sink, out, err = make(head=3, tail=2)
    sink.handle(P.Output(0, "stdout", "".join(f"{i}\n" for i in range(10))))
    sink.close(end())
    assert out.getvalue().splitlines() == [
        "[rank 0] 0",
        "[rank 0] 1",
        "[rank 0] 2",
        "[rank 0] 8",
        "[rank 0] 9",
    ]
    assert err.getvalue() == "[nbddp] ... 5 lines not shown ...\n"


def test_results_show_as_out():
    sink, out, _ = make()
    sink.handle(P.RankResult(1, "tensor([1.,\n 2.])"))
    assert out.getvalue() == "[rank 1] Out: tensor([1.,\n[rank 1]       2.])\n"


def test_quiet_shows_nothing_when_all_ranks_succeed():
    sink, out, err = make(quiet=True)
    sink.handle(P.Output(0, "stdout", "hello\n"))
    sink.handle(P.RankResult(0, "1"))
    sink.close(end())
    assert out.getvalue() == err.getvalue() == ""


def test_quiet_shows_the_failed_ranks_output():
    sink, out, _ = make(quiet=True)
    sink.handle(P.Output(0, "stdout", "fine\n"))
    sink.handle(P.Output(1, "stdout", "before the error\n"))
    sink.close(end(errors=[1]))
    assert out.getvalue() == "[rank 1] before the error\n"


def running(sink, ranks):
    for rank in ranks:
        sink.handle(P.RankState(rank, "running"))


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_identical_lines_fold_and_lines_that_differ_keep_their_ranks(n):
    sink, out, err = make()
    running(sink, range(n))
    for rank in range(n):
        own = "abcdefgh"[rank]
        sink.handle(P.Output(rank, "stdout", f"epoch 1 loss 0.25\nrank {own} is here\n"))
    sink.handle(P.Output(0, "stderr", "a warning\n"))
    sink.close(end())
    assert out.getvalue().splitlines() == [
        f"[ranks 0-{n - 1}] epoch 1 loss 0.25",
        *(f"[rank {r}] rank {'abcdefgh'[r]} is here" for r in range(n)),
    ]
    assert err.getvalue() == "[rank 0] a warning\n"


def test_no_fold_shows_every_ranks_line():
    sink, out, _ = make(fold=False)
    running(sink, range(3))
    for rank in range(3):
        sink.handle(P.Output(rank, "stdout", "same\n"))
    sink.close(end())
    assert out.getvalue().splitlines() == ["[rank 0] same", "[rank 1] same", "[rank 2] same"]


def test_identical_results_fold_too():
    sink, out, _ = make()
    running(sink, range(4))
    for rank in range(4):
        sink.handle(P.RankResult(rank, "tensor(6.)"))
    sink.close(end())
    assert out.getvalue() == "[ranks 0-3] Out: tensor(6.)\n"


def test_a_line_only_some_ranks_print_comes_out_after_the_window_on_a_tick():
    now = [0.0]
    sink, out, _ = make(clock=lambda: now[0])
    running(sink, range(4))
    sink.handle(P.Output(1, "stdout", "only rank 1\n"))
    assert out.getvalue() == ""
    now[0] = 0.3
    sink.handle(P.Tick())
    assert out.getvalue() == "[rank 1] only rank 1\n"


# ---------------------------------------------------------------- the widget dashboard


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def dashboard(ranks=(0, 1), **kw):
    clock = Clock()
    d = Dashboard(
        list(ranks), world_size=len(ranks), backend="gloo", devices="cpu", clock=clock, **kw
    )
    return d, clock


def start(d, ranks):
    for rank in ranks:
        d.handle(P.RankState(rank, "running"))


def test_rows_show_state_elapsed_and_last_line():
    d, clock = dashboard()
    start(d, (0, 1))
    d.handle(P.Output(0, "stdout", "epoch 1\nepoch 2\n"))
    clock.t = 1.5
    d.handle(P.RankState(0, "done"))
    d.close(P.CellEnd(1, (0, 1)))
    rows = d.widget.rows
    assert "nbddp-row nbddp-done" in rows
    assert "nbddp-row nbddp-running" in rows
    assert "1.5 s" in rows
    assert "epoch 2" in rows
    assert "2 of 2 ranks" in d.widget.header
    assert "gloo" in d.widget.header


def test_a_failed_rank_turns_red_and_its_log_opens():
    d, _ = dashboard(ranks=(0, 1, 2))
    start(d, (0, 1, 2))
    d.handle(P.Output(2, "stderr", "Traceback ...\n"))
    d.handle(P.RankState(2, "failed"))
    d.handle(P.RankState(1, "failed"))  # the first failure keeps its log open
    d.close(P.CellEnd(1, (0, 1, 2), errors={2: P.ErrorInfo("E", "m", "tb")}))
    assert d.widget.focus == 2
    row = d.widget.rows.split("data-rank='2'")[1].split("</tr>")[0]
    assert f"background:{FAILED_ROW}" in row
    assert "#c62828" in row
    assert "failed" in d.widget.header


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_a_dead_rank_replaced_by_a_new_process_says_so_in_its_red_row(n):
    ranks = tuple(range(n))
    d, _ = dashboard(ranks=ranks)
    start(d, ranks)
    d.handle(P.RankState(n - 1, "dead"))
    for r in ranks[:-1]:
        d.handle(P.RankState(r, "freed"))
    d.handle(P.RankState(n - 1, "replaced"))
    d.close(P.CellEnd(1, ranks, exits={n - 1: P.RankExit(n - 1, -9)}))
    assert d.widget.focus == n - 1  # its log is the one open
    row = d.widget.rows.split(f"data-rank='{n - 1}'")[1].split("</tr>")[0]
    assert "dead: new process" in row
    assert f"background:{FAILED_ROW}" in row
    assert f"color:{state_colour('dead')}" in row  # the dark red of a death


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_the_live_log_is_folded_with_rank_sets_and_streams_told_apart(n):
    d, clock = dashboard(ranks=range(n))
    start(d, range(n))
    for rank in range(n):
        d.handle(P.Output(rank, "stdout", "hello\n"))
    d.handle(P.Output(n - 1, "stderr", "err\n"))
    clock.t = 1.0
    d.handle(P.Tick())
    assert d.widget.lines == [
        [f"0-{n - 1}", "stdout", "hello", ""],
        [str(n - 1), "stderr", "err", ""],
    ]
    d.close(P.CellEnd(1, tuple(range(n))))


def test_renders_are_throttled_and_each_is_one_message_however_much_arrives():
    d, clock = dashboard(interval=0.25)
    sent = []
    d.widget.comm.send = lambda data=None, **kw: sent.append(data)  # what would go out
    start(d, (0, 1))
    for i in range(100_000):  # 2 simulated seconds of output
        d.handle(P.Output(i % 2, "stdout", f"{i}\n"))
        clock.t += 2 / 100_000
    renders = d.renders
    assert renders <= 2 / 0.25 + 2
    assert 0 < len(sent) <= renders  # hold_sync: the changed parts of a render go together
    d.close(P.CellEnd(1, (0, 1)))


def test_the_live_log_keeps_a_bounded_tail_and_counts_the_rest():
    d, clock = dashboard(ranks=(0,))
    d.handle(P.Output(0, "stdout", "".join(f"line {i}\n" for i in range(1000))))
    clock.t = 1.0
    d.handle(P.Output(0, "stdout", "more\n"))
    assert len(d.widget.lines) == Dashboard.LIVE_LINES
    assert d.widget.hidden == 1001 - Dashboard.LIVE_LINES
    assert d.widget.lines[-1] == ["0", "stdout", "more", ""]
    d.close(None)


def test_a_frozen_rank_log_keeps_a_bounded_tail_and_counts_what_it_dropped():
    d, _ = dashboard(ranks=(0,), keep=100)
    d.handle(P.Output(0, "stdout", "".join(f"line {i}\n" for i in range(250))))
    d.close(P.CellEnd(1, (0,)))
    rank0 = d.summary_html(1000).split("data-rank='0'>")[-1]
    assert "… 150 earlier lines not shown" in rank0
    assert "line 149\n" not in rank0
    assert "line 150\n" in rank0
    assert "line 249\n" in rank0


def test_a_progress_bar_with_carriage_returns_is_one_updating_line():
    d, clock = dashboard(ranks=(0,))
    d.handle(P.Output(0, "stdout", "train:  10%|#    |\r"))
    clock.t = 1.0
    d.handle(P.Output(0, "stdout", "train:  50%|##   |\r"))
    assert "train:  50%" in d.widget.rows
    assert "train:  10%" not in d.widget.rows
    d.handle(P.Output(0, "stdout", "train: 100%|#####|\n"))
    d.close(P.CellEnd(1, (0,)))
    assert [g.text for g in d.log] == ["train: 100%|#####|"]


def test_nbddp_progress_shows_as_a_bar_in_the_row():
    d, clock = dashboard(ranks=(0,))
    clock.t = 1.0
    d.handle(P.RankProgress(0, 25, 100, "steps"))
    assert "width:25%" in d.widget.rows
    assert "steps 25/100" in d.widget.rows
    d.close(None)


def test_the_live_output_is_the_widget_with_a_static_summary_beside_it():
    d, clock = dashboard()
    d.handle(P.Output(0, "stdout", "hello from zero\n"))
    d.handle(P.Output(1, "stdout", "hello from one\n"))
    clock.t += 1.0  # lines that differ wait the window (a rank may still print them)
    d.handle(P.Tick())
    bundle = d.bundle()
    assert bundle["application/vnd.jupyter.widget-view+json"]["model_id"] == d.widget.model_id
    assert "hello from zero" in bundle["text/html"]
    d.close(None)


def test_a_finished_cell_is_frozen_to_static_html_and_its_widget_closed():
    from ipywidgets.widgets.widget import _instances

    dashboard()[0].close(None)  # the one shared layout exists from now on
    before = len(_instances)
    d, _ = dashboard()
    assert len(_instances) == before + 1  # one model per cell
    start(d, (0, 1))
    d.handle(P.Output(0, "stdout", "hello from zero\n"))
    d.handle(P.Output(1, "stdout", "hello from one\n"))
    d.handle(P.RankState(1, "failed"))
    d.close(P.CellEnd(1, (0, 1), errors={1: P.ErrorInfo("E", "m", "tb")}))
    assert len(_instances) == before  # nothing accumulates across cells
    bundle = d.frozen_bundle()
    assert set(bundle) == {"text/plain", "text/html"}  # no widget state is saved
    html = bundle["text/html"]
    assert "[0] hello from zero" in html
    assert "[1] hello from one" in html
    # the failed rank's log is open, the all-ranks log closed; its row red
    assert "<details class='nbddp-log' data-rank='1' open><summary>rank 1 log (1 line)<" in html
    assert "<details class='nbddp-log nbddp-log-all'><summary>all ranks log (2 lines)<" in html
    assert f"nbddp-row nbddp-failed' data-rank='1' style='background:{FAILED_ROW};'" in html
    assert "rank 1: failed" in bundle["text/plain"]


def test_a_frozen_log_keeps_its_last_lines_and_counts_the_rest():
    d, _ = dashboard(ranks=(0,))
    d.handle(P.Output(0, "stdout", "".join(f"line {i}\n" for i in range(1500))))
    d.close(P.CellEnd(1, (0,)))
    html = d.frozen_bundle()["text/html"]
    assert "<details class='nbddp-log nbddp-log-all' open>" in html  # no failure: open
    assert "… 500 earlier lines not shown</div>" in html
    assert "line 499\n" not in html
    assert "line 500\n" in html
    assert "line 1499\n" in html


def test_text_lines_and_rows_name_the_host_when_ranks_span_hosts():
    sink, out, _ = make(hosts={0: "node-a", 1: "node-b"})
    sink.handle(P.Output(1, "stdout", "hi\n"))
    sink.close(end())
    assert out.getvalue() == "[rank 1@node-b] hi\n"
    d, _ = dashboard(hosts={0: "node-a", 1: "node-b"})
    d.close(P.CellEnd(1, (0, 1)))
    assert f"rank 1 <span style='color:{MUTED}'>node-b</span>" in d.widget.rows


def test_a_rank_blocked_in_a_collective_shows_what_it_waits_in_and_for_how_long():
    now = [100.0]
    board = Dashboard([0, 1, 2], world_size=3, clock=lambda: now[0], interval=0)
    start(board, range(3))
    board.handle(P.RankWhere(0, "all_reduce, cell line 3: dist.all_reduce(t)", "all_reduce", 88.0))
    board.handle(P.RankWhere(1, "cell line 5: time.sleep(60)", None, 99.0))
    rows = board.widget.rows
    assert "waiting in all_reduce (12 s)" in rows
    assert rows.count("waiting in") == 1
    assert ">running<" in rows
    board.handle(P.RankState(0, "interrupted"))
    assert "waiting in" not in board.widget.rows
    board.close(None)


@pytest.mark.parametrize("n", [17, 64, 1024])
def test_a_large_pool_shows_counts_the_slowest_and_only_the_rows_that_differ(n):
    d, clock = dashboard(ranks=range(n))
    start(d, range(n))
    for rank in range(n):
        d.handle(P.Output(rank, "stdout", "step 1\n"))
    clock.t = 2.0
    for rank in range(n):
        if rank not in (5, n - 1):
            d.handle(P.RankState(rank, "done"))
    clock.t = 3.0
    d.handle(P.RankState(n - 1, "failed"))
    clock.t = 3.5
    d.handle(P.Tick())
    rows = d.widget.rows
    assert f"{n - 2} done" in rows
    assert "1 running" in rows
    assert "1 failed" in rows
    assert "slowest: rank 5 (3.5 s)" in rows
    shown = [int(r.split("'")[0]) for r in rows.split("data-rank='")[1:]]
    assert {5, n - 1} <= set(shown)
    assert len(shown) <= Dashboard.ROWS
    assert d.widget.lines == [[f"0-{n - 1}", "stdout", "step 1", ""]]
    d.close(P.CellEnd(1, tuple(range(n)), errors={n - 1: P.ErrorInfo("E", "m", "tb")}))
    html = d.frozen_bundle()["text/html"]
    assert html.count("<details class='nbddp-log' data-rank=") <= Dashboard.ROWS
    assert len(html) < 20_000  # whatever the number of ranks


def test_a_dashboard_is_one_model_whatever_the_number_of_ranks():
    """Each widget model is a comm opened with the cell and closed at its end."""
    from ipywidgets.widgets.widget import _instances

    dashboard()[0].close(None)
    for n in (8, 256):
        before = len(_instances)
        d, _ = dashboard(ranks=tuple(range(n)))
        assert len(_instances) - before == 1
        d.close(P.CellEnd(1, tuple(range(n))))
        assert len(_instances) == before


def test_a_tqdm_bar_on_stderr_is_progress_not_an_error_and_a_warning_stays_red():
    """tqdm writes to stderr; its bar shows plain (a finished bar in red made a good cell
    look failed), live and frozen; what else a rank writes to stderr stays red."""
    d, _ = dashboard(ranks=(0,))
    start(d, (0,))
    bar = "train: 100%|##########| 10/10 [00:01<00:00,  9.81it/s]"
    d.handle(P.Output(0, "stderr", f"{bar}\n"))
    d.handle(P.Output(0, "stderr", "45it [00:01, 30.12it/s]\n"))  # tqdm with no total
    d.handle(P.Output(0, "stderr", "UserWarning: careful\n"))
    d.handle(P.RankState(0, "done"))
    d.close(P.CellEnd(1, (0,)))
    streams = {text: stream for _ranks, stream, text, _values in d.widget.lines}
    assert streams == {
        bar: "progress",
        "45it [00:01, 30.12it/s]": "progress",
        "UserWarning: careful": "stderr",
    }
    html = d.frozen_bundle()["text/html"]
    red = re.findall(r"<span style='color:[^']*'>([^<]*)</span>", html)
    assert red == ["[0] UserWarning: careful", "UserWarning: careful"]  # all ranks', its own


def test_a_frozen_log_opens_at_its_top_and_rank_labels_align_left():
    """The frozen log is not scrolled to its end (its first lines were cut), and the rows'
    cells say their alignment (a front end's tables align right: frozen labels did)."""
    d, _ = dashboard(ranks=(0, 1))
    start(d, (0, 1))
    d.handle(P.Output(0, "stdout", "".join(f"line {i}\n" for i in range(100))))
    d.close(P.CellEnd(1, (0, 1)))
    html = d.frozen_bundle()["text/html"]
    assert "column-reverse" not in html
    assert "<td style='padding:1px 8px;text-align:left'>rank 0</td>" in html


@pytest.mark.parametrize("n", [2, 3, 8, 40])
def test_nbddp_progress_of_ranks_at_different_speeds_folds_into_one_bar(n):
    d, clock = dashboard(ranks=range(n))
    start(d, range(n))
    clock.t = 1.0
    for rank in range(n):
        d.handle(P.RankProgress(rank, 60 if rank != 1 else 45, 100, "train"))
    d._render(force=True)
    rows = d.widget.rows
    assert rows.count("nbddp-bar") == 1  # one bar, not one per rank
    assert "width:45%" in rows
    assert f"({n} ranks; slowest: rank 1; the others up to 60)" in rows
    assert "train 45/100" in rows
    for rank in range(n):  # every rank at its end, the totals apart: all done, no slowest
        d.handle(P.RankProgress(rank, 40 + rank, 40 + rank, "train"))
    d._render(force=True)
    assert f"({n} ranks; all done)" in d.widget.rows
    d.close(None)


@pytest.mark.parametrize("n", [2, 3, 8])
def test_running_tqdm_bars_show_once_in_the_log_and_each_row_its_position(n):
    """One live bar in the log, the slowest rank's, named, with its ranks' positions to point
    at; each row shows its rank's position, not a bar of its own."""
    d, clock = dashboard(ranks=range(n))
    start(d, range(n))
    bar = "\rtrain: {:>3}%|{:<10}| {}/10 [00:01<00:01,  9.8it/s]"
    for rank in range(n):
        done = 9 if rank else 4
        d.handle(P.Output(rank, "stderr", bar.format(done * 10, "#" * done, done)))
    clock.t = 1.0
    d._render(force=True)
    ((ranks, stream, text, values, _),) = d.widget.bars
    assert (ranks, stream) == (f"0-{n - 1}", "progress")
    assert text == bar.format(40, "####", 4)[1:] + "  (slowest: rank 0; the others up to 9)"
    assert values.splitlines()[:2] == ["rank 0: 4/10", "rank 1: 9/10"]
    assert "%|" not in d.widget.rows  # a row: its position
    assert d.widget.rows.count(">9/10</span>") == n - 1
    d.handle(P.Output(1, "stderr", bar.format(100, "#" * 10, 10) + "\n"))
    d._render(force=True)  # its bar waits for rank 0's to fold; its row says where it is
    assert "<span class='nbddp-progress'>10/10</span>" in d.widget.rows
    for rank in (r for r in range(n) if r != 1):
        d.handle(P.Output(rank, "stderr", bar.format(100, "#" * 10, 10) + "\n"))
    clock.t = 2.0
    d._render(force=True)
    assert d.widget.bars == []
    assert [(rank_set(g.ranks), g.text) for g in d.log] == [
        (f"0-{n - 1}", bar.format(100, "#" * 10, 10)[1:])
    ]
    d.close(None)


def test_text_says_nbddp_progress_folded_at_a_bounded_rate_and_where_it_ended():
    """--text: one line for every rank's bar, the slowest named, when its whole percent
    moved and a second passed; the end said once; --no-fold: each rank's own."""
    clock = Clock()
    sink, out, _ = make(clock=clock)
    for step in range(1, 301):  # 3 s, two ranks at different speeds
        clock.t = step / 100
        sink.handle(P.RankProgress(0, step, 300, "train"))
        sink.handle(P.RankProgress(1, step // 2, 300, "train"))
    sink.close(P.CellEnd(1, (0, 1)))
    said = out.getvalue().splitlines()
    assert len(said) == 3, said  # after 1 s, 2 s, and the end
    for line in said[:2]:
        assert re.fullmatch(
            r"\[ranks 0-1\] train (\d+)/300 \(\d+%\)  \(slowest: rank 1; "
            r"the others up to \d+\)",
            line,
        ), said
    assert said[-1] == "[ranks 0-1] train 150/300 (50%)  (slowest: rank 1; the others up to 300)"
    sink, out, _ = make(clock=clock)  # every rank at its end (totals apart): no slowest
    running(sink, range(2))
    for rank in range(2):
        sink.handle(P.RankProgress(rank, 40 + rank, 40 + rank, "steps"))
    sink.close(P.CellEnd(1, (0, 1)))
    assert out.getvalue().splitlines() == ["[ranks 0-1] steps 40/40 (100%)"]
    sink, out, _ = make(clock=clock, fold=False)
    for rank in range(2):
        sink.handle(P.RankProgress(rank, 10, 10, "train"))
    sink.close(P.CellEnd(1, (0, 1)))
    assert out.getvalue().splitlines() == [f"[rank {r}] train 10/10 (100%)" for r in range(2)]
