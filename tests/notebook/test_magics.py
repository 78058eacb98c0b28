"""%%ddp and %ddp through a real IPython InteractiveShell and real ranks."""

from __future__ import annotations

import math
import os
import re
import signal
import time

import pytest
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell

from helpers import namespace_digests, wait_gone
from nbddp.wire.stacks import rank_set
from tiers import sizes


@pytest.fixture(scope="module")
def shell():
    sh = InteractiveShell.instance()
    sh.run_cell("%load_ext nbddp")
    yield sh
    sh.run_cell("%ddp stop")
    sh.run_cell("%unload_ext nbddp")


def magics(shell):
    from nbddp.notebook.magics import _MAGICS

    return _MAGICS[id(shell)]


def test_the_core_example_end_to_end(shell, run):
    result, out = run(
        '%%ddp -n 2 --imports "import torch.distributed as dist"\n'
        "t = torch.ones(3) * rank\n"
        "dist.all_reduce(t)\n"
        "print(t)"
    )
    assert result.success, out
    assert "[ranks 0-1] tensor([1., 1., 1.])" in out  # the same line from both ranks, once

    result, out = run("%%ddp\nprint(t.sum())")
    assert result.success
    assert "[ranks 0-1] tensor(3.)" in out

    run("import torch\ndef loss(y): return (y ** 2).mean()\ndata = torch.randn(8)")
    result, out = run("%%ddp --need loss,data --out vals\nloss(data) + rank")
    assert result.success, out
    expected = shell.user_ns["loss"](shell.user_ns["data"])
    vals = shell.user_ns["vals"]
    assert len(vals) == 2
    assert float(vals[0]) == pytest.approx(float(expected))
    assert float(vals[1]) == pytest.approx(float(expected) + 1)

    result, out = run("%ddp status")
    lines = out.strip().splitlines()
    assert lines[0].split() == ["rank", "pid", "host", "device", "state", "uptime", "rss"]
    pids = magics(shell).pool.pids
    assert [line.split()[:2] for line in lines[1:]] == [["0", str(pids[0])], ["1", str(pids[1])]]
    assert all(" idle " in line and "MiB" in line for line in lines[1:])

    result, out = run("%ddp restart")
    assert result.success
    assert "restarted 2 ranks" in out
    assert wait_gone(pids) == []
    new_pids = magics(shell).pool.pids
    result, out = run("%%ddp --no-fold\nprint(rank)")
    assert result.success
    assert "[rank 1] 1" in out

    result, out = run("%ddp stop")
    assert "stopped the pool" in out
    assert wait_gone(new_pids) == []


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", sizes(2, 3, 4, 8, ids="{}"))
def test_a_death_that_ddp_status_reads_is_replaced_by_the_next_cell(shell, run, n):
    """A rank SIGKILLed between cells, then `%ddp status` (which reads its death): the next
    cell replaces that rank and every other rank keeps its namespace (before, the session
    took the pool for not started and started it: `the pool did not start: rank N exited
    while starting`, and the cell did not run)."""
    run(f"%%ddp -n {n} --text\nx = rank * 10")
    pool = magics(shell).pool
    bad, before, pids = n - 1, namespace_digests(pool), pool.roster.pids()
    os.kill(pids[bad], signal.SIGKILL)
    assert wait_gone([pids[bad]]) == []
    time.sleep(0.2)  # its connections close
    _, shown = run("%ddp status")
    assert re.search(rf"^{bad} +{pids[bad]} .* dead ", shown, re.M), shown
    _, shown = run("%ddp stacks")  # (not `every rank is idle`)
    assert f"{rank_set(range(n - 1))} {'are' if n > 2 else 'is'} idle" in shown, shown
    assert f"rank {bad} did not answer (a rank that died" in shown, shown
    result, out = run("%%ddp --text\nprint(rank, x if 'x' in globals() else None)")
    assert result.success, out
    assert f"rank {bad}: a new process took its place" in out, out
    after = namespace_digests(pool)
    assert [after[r] for r in range(n - 1)] == [before[r] for r in range(n - 1)]
    assert pool.roster.pids()[bad] != pids[bad]
    assert {k: v for k, v in pool.roster.pids().items() if k != bad} == {
        k: v for k, v in pids.items() if k != bad
    }


@pytest.mark.timeout(120)
def test_options_that_restart_a_pool_whose_death_status_read_say_what_is_lost(shell, run):
    """The same pool, a rank dead and read by `%ddp status`, then `%ddp start --seed 1`
    (new options: new processes): refused, naming the others' state (it was not: the pool
    read as not started, so nothing was said); with --force, a new pool that says it."""
    run("%%ddp -n 3 --text\nx = rank * 10")
    pool = magics(shell).pool
    os.kill(pool.roster.pids()[2], signal.SIGKILL)
    assert wait_gone([pool.roster.pids()[2]]) == []
    time.sleep(0.2)
    run("%ddp status")
    result, out = run("%ddp start -n 3 --seed 1")
    assert isinstance(result.error_in_exec, UsageError), out
    assert "--seed needs new processes for every rank: every rank's state would be lost" in out
    assert "held x" in out, out
    assert "`%ddp start -n 3 --seed 1 --force`" in out, out
    result, out = run("%ddp start -n 3 --seed 1 --force")
    assert result.success, out
    assert "every rank's state is lost" in out, out
    assert "x" in out.split("every rank's state is lost", 1)[1].splitlines()[0], out
    run("%ddp start -n 3")  # (the module's options back)


def test_a_rank_error_fails_the_cell_with_each_ranks_traceback(run):
    result, out = run("%%ddp -n 2\nx = 1\nif rank == 1:\n    1 / 0")
    assert not result.success
    assert "rank 1: ZeroDivisionError: division by zero" in str(result.error_in_exec)
    assert "--- rank 1 ---" in out
    assert re.search(r'File "In \[\d+\]", line 4, in <module>', out)  # as the cell reads
    assert "CellFailed: rank 1: ZeroDivisionError: division by zero" in out
    assert "--- rank 0 ---" not in out


BAD_INPUT = [
    ("%%ddp -n 0\nmarker = 1", "world size must be at least 1"),
    ("%%ddp -n abc\nmarker = 1", "must be a whole number, not 'abc'"),
    ("%%ddp --bogus\nmarker = 1", "unrecognized arguments: --bogus"),
    ("%%ddp --need nope\nmarker = 1", "name 'nope' is not defined in the notebook"),
    ("%%ddp --need lock\nmarker = 1", "cannot ship 'lock' (lock) to the ranks"),
    ('%%ddp --imports "x = 1"\nmarker = 1', "import statements only"),
    ("%%ddp --ranks 7\nmarker = 1", "no rank 7 in a pool of 2"),
    ("%%ddp --ranks x\nmarker = 1", "ranks like 0,2-3"),
    ("%%ddp --out 1x\nmarker = 1", "--out takes a variable name"),
    ("%%ddp --timeout -1\nmarker = 1", "positive number of seconds"),
    ("%ddp frobnicate", "unknown %ddp command 'frobnicate'"),
    ("%ddp", "%ddp needs a command"),
    ("%ddp push nope", "name 'nope' is not defined"),
    ("%ddp pull x --rank 9", "no rank 9 in a pool of 2"),
    ("%ddp copy kept", "the following arguments are required: --from"),
    ("%ddp copy kept --from 9", "--from: no rank 9 in a pool of 2"),
    ("%ddp copy nope --from 0", "rank 0: name 'nope' is not defined on this rank"),
    ("%ddp copy kept --from 0 --to 0", "rank 0 is the source: copy to the others"),
    ("%ddp copy kept --from 0 --to 7", "no rank 7 in a pool of 2"),
    ("%ddp start --on-death never", "argument --on-death: invalid choice: 'never'"),
]


@pytest.mark.parametrize(("cell", "message"), BAD_INPUT, ids=[c for c, _ in BAD_INPUT])
def test_bad_input_is_one_line_and_leaves_the_pool_as_it_was(shell, run, cell, message):
    run("import threading\nlock = threading.Lock()")
    assert run("%%ddp -n 2\nkept = rank")[0].success
    pids = magics(shell).pool.pids
    result, out = run(cell)
    assert isinstance(result.error_in_exec, UsageError)
    assert message in out
    assert "Traceback" not in out, out
    assert len(out.strip().splitlines()) == 1, out
    assert magics(shell).pool.pids == pids
    result, out = run("%%ddp --out k\nkept")
    assert shell.user_ns["k"] == [0, 1]
    result, _ = run("%%ddp --out m\n'marker' in globals()")
    assert shell.user_ns["m"] == [False, False]  # no rank ran the bad cell


def test_a_dead_rank_is_replaced_and_copy_heals_it(shell, run):
    """Automatic capture and the notebook's imports reach the new rank; %ddp copy gives
    it rank 0's model."""
    run("import math\nscale = 3")
    assert run("%%ddp -n 3\ntorch.manual_seed(rank)\nmodel = torch.nn.Linear(3, 2)\nstep = rank")[
        0
    ].success
    assert run("%%ddp\nimport json as js")[0].success  # a rank's own import
    result, out = run("%%ddp\nimport os\nif rank == 2:\n    os._exit(3)")
    message = str(result.error_in_exec)
    assert message.splitlines()[0] == "rank 2 died (exit code 3)", message
    had = re.search(
        r"^rank 2: a new process took its place; it had (.*) \(gone\) and had "
        r"imported (.*)$",
        message,
        re.M,
    )  # (imports of earlier tests' cells too)
    assert had, message
    # (and kept, when an earlier test's rank 2 died: its new process re-ran kept's cell)
    assert set(had[1].split(", ")) - {"kept"} == {"model", "step"}, message
    assert {"js", "math"} <= set(had[2].split(", ")), message
    result, out = run(
        "%%ddp --out seen\n(step if 'step' in globals() else None, math.pi * scale, js.dumps(1))"
    )
    assert result.success, out
    assert re.search(r"replayed \d+ imports", out), out  # the notebook's and cells', again
    pi3 = math.pi * 3
    # rank 2 re-ran the cell that made model and step (no collective): its own step
    assert shell.user_ns["seen"] == [(0, pi3, "1"), (1, pi3, "1"), (2, pi3, "1")]
    assert re.search(r"^rank 2 re-ran In \[\d+\]", message, re.M), message
    result, out = run("%ddp copy model --from 0 --to 2")
    assert result.success, out
    assert re.fullmatch(
        r"nbddp: copied model from rank 0 to rank 2 \(.+ in the message, .+ s\)\n", out
    )
    run("%%ddp --out sums\nsum(p.sum().item() for p in model.parameters())")
    sums = shell.user_ns["sums"]
    assert sums[2] == sums[0] != sums[1]


def test_a_new_size_resizes_the_pool_in_one_line(shell, run):
    run("%%ddp -n 2\npass")
    result, out = run("%%ddp -n 1 --out ws\nworld_size")
    assert result.success
    assert "resized the pool 2 -> 1 rank in" in out
    assert "rank 1 stopped (it held " in out
    assert shell.user_ns["ws"] == [1]


def test_ranks_quiet_and_timeout(shell, run):
    run("%%ddp -n 2\npass")
    result, out = run("%%ddp --ranks 1 --out r\nprint('only', rank)\nrank")
    assert "[rank 1] only 1" in out
    assert "[rank 0]" not in out
    assert shell.user_ns["r"] == [None, 1]

    result, out = run("%%ddp --quiet\nprint('hidden')\nrank")
    assert result.success
    assert out == ""

    result, out = run("%%ddp --quiet\nprint('shown because', rank)\n1 / rank")
    assert "[rank 0] shown because 0" in out
    assert "[rank 1] shown" not in out

    result, out = run("%%ddp --timeout 0.5\nimport time\ntime.sleep(30)")
    assert not result.success
    assert "cell timed out" in out
    assert run("%%ddp --out alive\nrank")[0].success
    assert shell.user_ns["alive"] == [0, 1]


def test_a_timed_out_cell_says_where_each_rank_was_and_stacks_recall_it(shell, run):
    run("%%ddp -n 3\npass")
    code = "%%ddp --timeout 1\nimport time, torch.distributed as dist\n"
    code += "if rank == 1:\n    time.sleep(30)\ndist.barrier()"
    result, out = run(code)
    assert not result.success
    assert "cell timed out" in out
    assert "rank 1: cell line 4: time.sleep(30)" in out  # the %%ddp line is line 1
    assert "ranks 0, 2: barrier, cell line 5: dist.barrier()" in out
    result, out = run("%ddp stacks")
    assert "every rank is idle (ranks 0-2)" in out
    assert "rank 1: cell line 4: time.sleep(30)" in out.split("last cell was interrupted")[1]
    assert run("%%ddp --out alive\nrank")[0].success  # and nothing was lost
    assert shell.user_ns["alive"] == [0, 1, 2]


def test_sys_exit_in_a_cell_is_an_error_and_keeps_the_rank(shell, run):
    run("%%ddp -n 2\nkept = rank * 7")
    result, out = run("%%ddp\nimport sys\nif rank == 1:\n    sys.exit(3)")
    assert not result.success
    assert "rank 1: SystemExit: 3" in out
    assert run("%%ddp --out k\nkept")[0].success
    assert shell.user_ns["k"] == [0, 7]


def test_start_with_debug_turns_on_torchs_collective_checks(shell, run):
    result, out = run("%ddp start -n 2 --debug --force")
    assert result.success
    assert magics(shell).pool.debug
    code = "%%ddp\nimport torch.distributed as dist\n"
    code += "dist.barrier() if rank == 0 else dist.all_reduce(torch.ones(1))"
    result, out = run(code)
    assert not result.success
    assert "Detected mismatch between collectives" in out
    run("%ddp start -n 2 --force")
    assert not magics(shell).pool.debug


def test_push_and_pull(shell, run):
    run("%%ddp -n 2\npass")
    run("payload = {'a': [1, 2]}\ndef double(x): return 2 * x")
    result, _ = run("%ddp push payload double --ranks 1")
    assert result.success
    assert run("%%ddp --ranks 1 --out got\ndouble(payload['a'])")[0].success
    assert shell.user_ns["got"] == [None, [1, 2, 1, 2]]
    run("%%ddp\nmine = rank * 3")
    assert shell.run_line_magic("ddp", "pull mine") == 0
    assert shell.run_line_magic("ddp", "pull mine --rank 1") == 3
    assert shell.run_line_magic("ddp", "pull mine --all") == [0, 3]


def test_start_with_options_and_unload_stops_everything(shell, run):
    result, out = run("%ddp start -n 2 --start-method spawn --timeout 60 --force")
    assert result.success
    assert "started 2 ranks" in out
    pool = magics(shell).pool
    assert pool.start_method == "spawn"
    assert pool.pg_timeout == 60
    pids = pool.pids
    run("%unload_ext nbddp")
    assert wait_gone(pids) == []
    run("%load_ext nbddp")
    result, out = run("%ddp status")
    assert "no pool is running" in out


def test_ddp_run_runs_a_torchrun_script_and_keep_leaves_its_globals(shell, run, tmp_path):
    script = tmp_path / "tiny.py"
    script.write_text(
        "import sys\nimport torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "result = dist.get_rank() * int(sys.argv[1])\n"
        "print('argv', sys.argv[1:], 'rank', dist.get_rank())\n"
        "dist.destroy_process_group()\n"
    )
    run("%%ddp -n 2\npass")
    result, out = run(f"%ddp run --keep {script} 5 --flag")
    assert result.success, out
    # folded with rank 0's line or not (0.25 s apart): rank 1's line, with its rank
    assert re.search(r"^\[ranks? (0-)?1\] argv \['5', '--flag'\] rank (1|\{0-1\})$", out, re.M), out
    assert run("%%ddp --out r\nresult")[0].success
    assert shell.user_ns["r"] == [0, 5]
    result, out = run(f"%ddp run --ranks 0,1 {tmp_path / 'missing.py'}")
    assert not result.success
    assert "no such script" in out
    assert out.count("\n") <= 2


def test_need_takes_names_separated_by_commas_and_spaces(shell, run):
    run("a1, b1, c1 = 1, 2, 3")
    result, out = run("%%ddp -n 2 --no-auto --need a1,b1 c1 --out s\na1 + b1 + c1")
    assert result.success, out
    assert shell.user_ns["s"] == [6, 6]


def test_start_with_threads(shell, run):
    result, out = run("%ddp start -n 2 --threads 2")
    assert result.success, out
    assert run("%%ddp --out t\ntorch.get_num_threads()")[0].success
    assert shell.user_ns["t"] == [2, 2]
    result, out = run("%ddp start -n 2 --threads many")
    assert not result.success
    assert "threads" in out
    run("%ddp start -n 2")


@pytest.mark.parametrize("asked", ["%ddp", "%%ddp"])
def test_the_help_shows_every_subcommand_and_every_option_from_the_parsers(shell, asked):
    from nbddp.notebook.magics import PARSERS, SUBCOMMANDS

    shown = shell.object_inspect_mime(asked)["text/plain"]
    for command in SUBCOMMANDS:
        assert f"%ddp {command}" in shown, command
    for magic in PARSERS.values():
        for action in magic.parser._actions:
            if action.help and action.help != "show this help message and exit":
                first_words = " ".join(action.help.split()[:4])
                assert first_words in " ".join(shown.split()), (action.dest, first_words)
            for flag in action.option_strings:
                assert flag in shown, flag
