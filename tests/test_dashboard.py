from __future__ import annotations

import io

from nbddp import protocol as P
from nbddp.dashboard import Dashboard, TextSink


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
    assert err.getvalue() == "[rank 0] ... 5 lines not shown ...\n"


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


def test_rows_show_state_elapsed_and_last_line():
    d, clock = dashboard()
    d.handle(P.RankState(0, "running"))
    d.handle(P.RankState(1, "running"))
    d.handle(P.Output(0, "stdout", "epoch 1\nepoch 2\n"))
    clock.t = 1.5
    d.handle(P.RankState(0, "done"))
    d.close(P.CellEnd(1, (0, 1)))
    assert "nbddp-row nbddp-done" in d.table.value and "nbddp-row nbddp-running" in d.table.value
    assert "1.5 s" in d.table.value and "epoch 2" in d.table.value
    assert "2 of 2 ranks" in d.header.value and "gloo" in d.header.value


def test_a_failed_rank_turns_red_and_its_pane_opens():
    d, _ = dashboard(ranks=(0, 1, 2))
    for r in (0, 1, 2):
        d.handle(P.RankState(r, "running"))
    d.handle(P.Output(2, "stderr", "Traceback ...\n"))
    d.handle(P.RankState(2, "failed"))
    d.handle(P.RankState(1, "failed"))  # the first failure keeps its pane open
    d.close(P.CellEnd(1, (0, 1, 2), errors={2: P.ErrorInfo("E", "m", "tb")}))
    assert d.tabs.selected_index == 3 and d.tabs.titles[3] == "rank 2"
    row = d.table.value.split("data-rank='2'")[1].split("</tr>")[0]
    assert "background:#fde7e7" in row and "#c62828" in row
    assert "failed" in d.header.value


def test_stdout_and_stderr_are_told_apart_and_all_ranks_interleave_with_labels():
    d, _ = dashboard()
    d.handle(P.Output(0, "stdout", "out0\n"))
    d.handle(P.Output(1, "stderr", "err1\n"))
    d.close(P.CellEnd(1, (0, 1)))
    assert "<span style='color:#b71c1c'>err1</span>" in d.panes[2].value
    assert "out0\n" in d.panes[1].value and "err1" not in d.panes[1].value
    everything = d.panes[0].value
    assert everything.index("[0] out0") < everything.index("[1] err1")


def test_renders_are_throttled_however_much_arrives():
    d, clock = dashboard(interval=0.25)
    changes = []
    for widget in (d.header, d.table, *d.panes):
        widget.observe(lambda change: changes.append(change), names="value")
    for i in range(100_000):  # 2 simulated seconds of output
        d.handle(P.Output(i % 2, "stdout", f"{i}\n"))
        clock.t += 2 / 100_000
    d.close(P.CellEnd(1, (0, 1)))
    assert d.renders <= 2 / 0.25 + 2
    # each render sends the header, the table, the interleaved pane and one rank pane
    assert len(changes) <= 4 * d.renders + 2


def test_panes_keep_a_bounded_tail_and_count_what_they_dropped():
    d, _ = dashboard(ranks=(0,), keep=100)
    d.handle(P.Output(0, "stdout", "".join(f"line {i}\n" for i in range(250))))
    d.close(P.CellEnd(1, (0,)))
    pane = d.panes[1].value
    assert "… 150 earlier lines not shown" in pane
    assert "line 149\n" not in pane and "line 150\n" in pane and "line 249\n" in pane


def test_while_running_a_pane_shows_its_live_tail():
    d, clock = dashboard(ranks=(0,))
    d.handle(P.Output(0, "stdout", "".join(f"line {i}\n" for i in range(1000))))
    clock.t = 1.0
    d.handle(P.Output(0, "stdout", "more\n"))
    assert "601 earlier lines not shown (more show when the cell ends)" in d.panes[1].value
    assert "more\n" in d.panes[1].value


def test_a_progress_bar_with_carriage_returns_is_one_updating_line():
    d, clock = dashboard(ranks=(0,))
    d.handle(P.Output(0, "stdout", "train:  10%|#    |\r"))
    clock.t = 1.0
    d.handle(P.Output(0, "stdout", "train:  50%|##   |\r"))
    assert "train:  50%" in d.table.value and "train:  10%" not in d.table.value
    d.handle(P.Output(0, "stdout", "train: 100%|#####|\n"))
    d.close(P.CellEnd(1, (0,)))
    assert d.panes[1].value.count("train:") == 1 and "100%" in d.panes[1].value


def test_nbddp_progress_shows_as_a_bar_in_the_row():
    d, clock = dashboard(ranks=(0,))
    clock.t = 1.0
    d.handle(P.RankProgress(0, 25, 100, "steps"))
    assert "width:25%" in d.table.value and "steps 25/100" in d.table.value


def test_the_live_output_is_the_widget_with_a_static_summary_beside_it():
    d, _ = dashboard()
    d.handle(P.Output(0, "stdout", "hello from 0\n"))
    bundle = d.bundle()
    assert bundle["application/vnd.jupyter.widget-view+json"]["model_id"] == d.widget.model_id
    assert "hello from 0" in bundle["text/html"]


def test_a_finished_cell_is_frozen_to_static_html_and_its_widgets_closed():
    from ipywidgets.widgets.widget import _instances

    before = len(_instances)
    d, _ = dashboard()
    assert len(_instances) > before
    d.handle(P.Output(0, "stdout", "hello from 0\n"))
    d.handle(P.Output(1, "stdout", "hello from 1\n"))
    d.handle(P.RankState(1, "failed"))
    d.close(P.CellEnd(1, (0, 1), errors={1: P.ErrorInfo("E", "m", "tb")}))
    assert len(_instances) == before  # nothing accumulates across cells
    bundle = d.frozen_bundle()
    assert set(bundle) == {"text/plain", "text/html"}  # no widget state is saved
    html = bundle["text/html"]
    assert "hello from 0" in html and "hello from 1" in html
    assert "[0] hello from 0" in html and "[1] hello from 1" in html  # all ranks, interleaved
    # the failed rank's log is open, the all-ranks log closed; its row red
    assert "<details class='nbddp-log' data-rank='1' open><summary>rank 1 log" in html
    assert "<details class='nbddp-log nbddp-log-all'><summary>all ranks log" in html
    assert "nbddp-row nbddp-failed' data-rank='1' style='background:#fde7e7;'" in html
    assert "rank 1: failed" in bundle["text/plain"]


def test_a_frozen_log_keeps_its_last_lines_and_counts_the_rest():
    d, _ = dashboard(ranks=(0,))
    d.handle(P.Output(0, "stdout", "".join(f"line {i}\n" for i in range(1500))))
    d.close(P.CellEnd(1, (0,)))
    html = d.frozen_bundle()["text/html"]
    assert "<details class='nbddp-log nbddp-log-all' open>" in html  # no failure: open
    assert "… 500 earlier lines not shown</div>" in html
    assert "line 499\n" not in html and "line 500\n" in html and "line 1499\n" in html


def test_text_lines_and_rows_name_the_host_when_ranks_span_hosts():
    sink, out, _ = make(hosts={0: "node-a", 1: "node-b"})
    sink.handle(P.Output(1, "stdout", "hi\n"))
    sink.close(end())
    assert out.getvalue() == "[rank 1@node-b] hi\n"
    d, _ = dashboard(hosts={0: "node-a", 1: "node-b"})
    d.close(P.CellEnd(1, (0, 1)))
    assert "rank 1 <span style='color:#888'>node-b</span>" in d.table.value


def test_a_rank_blocked_in_a_collective_shows_what_it_waits_in_and_for_how_long():
    now = [100.0]
    board = Dashboard([0, 1, 2], world_size=3, clock=lambda: now[0], interval=0)
    for rank in range(3):
        board.handle(P.RankState(rank, "running"))
    board.handle(P.RankWhere(0, "all_reduce, cell line 3: dist.all_reduce(t)", "all_reduce", 88.0))
    board.handle(P.RankWhere(1, "cell line 5: time.sleep(60)", None, 99.0))
    table = board._table_html(now[0])
    assert "waiting in all_reduce (12 s)" in table
    assert table.count("waiting in") == 1 and ">running<" in table
    board.handle(P.RankState(0, "interrupted"))
    assert "waiting in" not in board._table_html(now[0])


def test_a_dashboard_opens_one_model_per_rank_plus_a_few():
    """Each widget model is a comm opened with the cell and closed at its end: the HTML
    parts share one layout and one style instead of bringing two each."""
    from ipywidgets.widgets.widget import _instances

    before = len(_instances)
    d, _ = dashboard(ranks=tuple(range(8)))
    opened = len(_instances) - before
    assert opened <= 8 + 10, opened
    d.close(P.CellEnd(1, tuple(range(8))))
    assert len(_instances) == before
