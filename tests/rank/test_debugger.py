"""pdb in a rank, answered from the notebook: through a real kernel's stdin channel
(jupyter_client with allow_stdin), and through nbclient, which has none."""

from __future__ import annotations

import queue
import subprocess
import sys
import time

import nbformat
import pytest
from nbclient import NotebookClient
from test_kernel import execute

from helpers import ipc_kernel_manager
from tiers import sizes

pytestmark = pytest.mark.kernel


class Session:
    """What a cell showed, and the prompts its ranks' pdb asked with."""

    def __init__(self) -> None:
        self.stdout = ""
        self.error: dict | None = None
        self.prompts: list[str] = []


def run_with_input(kc, code: str, answer, timeout: float = 90) -> Session:
    """Run ``code`` with an input box: ``answer(session)`` gives each line (None: no answer
    from here, e.g. after pressing stop)."""
    msg_id = kc.execute(code, allow_stdin=True)
    s = Session()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            request = kc.get_stdin_msg(timeout=0.02)
            s.prompts.append(request["content"]["prompt"])
            line = answer(s)
            if line is not None:
                kc.input(line)
        except queue.Empty:
            pass
        try:
            msg = kc.get_iopub_msg(timeout=0.02)
        except queue.Empty:
            continue
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream":
            s.stdout += content["text"]
        elif kind == "error":
            s.error = content
        elif kind == "status" and content["execution_state"] == "idle":
            return s
    raise TimeoutError(f"no idle after {timeout} s; so far: {s.stdout!r}, {s.prompts}")


def lines(*answers: str):
    todo = list(answers)
    return lambda s: todo.pop(0)


def test_breakpoint_in_rank_1_of_3_takes_commands_from_the_input_box(kernel):
    km, kc = kernel
    assert execute(kc, "%load_ext nbddp").error is None
    code = (
        "%%ddp -n 3 --text --no-fold\n"
        "x = rank * 10\n"
        "if rank == 1:\n"
        "    breakpoint()\n"
        "    y = x + 1\n"
        "print('after', rank)"
    )
    s = run_with_input(kc, code, lines("p rank", "p x", "n", "p y", "c"))
    assert s.error is None, s.stdout
    assert s.prompts == ["(Pdb rank 1) "] * 5  # labelled with the rank, one box per line
    said = s.stdout.splitlines()
    assert said.index("1") < said.index("10") < said.index("11")  # p rank, p x, p y
    for rank in range(3):
        assert f"after {rank}" in s.stdout
    # the ranks' state is intact, the debugged rank's line ran
    r = execute(kc, "%%ddp --text --no-fold\nprint(x, globals().get('y'))")
    assert r.error is None, r.text
    assert "[rank 1] 10 11" in r.stdout
    assert "[rank 2] 20 None" in r.stdout

    # q: that rank's cell ends (BdbQuit), the others are not left hanging, state is kept
    code = (
        "%%ddp --text\nimport torch.distributed as dist\n"
        "if rank == 2:\n    breakpoint()\ndist.barrier()"
    )
    s = run_with_input(kc, code, lines("q"))
    assert s.prompts == ["(Pdb rank 2) "]
    assert s.error["ename"] == "CellFailed"
    assert "rank 2: BdbQuit: quit from the debugger" in s.error["evalue"]
    assert execute(kc, "%%ddp --text\nprint(x)").error is None

    # the stop button while the box waits: the cell ends interrupted, the ranks' state stays
    def press_stop(s):
        km.interrupt_kernel()
        return None

    code = "%%ddp --text\nif rank == 0:\n    breakpoint()\n    z = 1\nprint('end', rank)"
    s = run_with_input(kc, code, press_stop)
    assert s.prompts == ["(Pdb rank 0) "]
    assert s.error["ename"] == "CellInterrupted", s.error
    assert "cell interrupted (KeyboardInterrupt)" in s.error["evalue"]
    r = execute(kc, "%%ddp --text --no-fold\nprint('x is', x)")
    assert r.error is None, r.text
    assert "[rank 2] x is 20" in r.stdout

    # two ranks at a breakpoint: served one after the other, each labelled
    code = "%%ddp --text\nif rank in (0, 2):\n    breakpoint()\n    w = rank\nprint('w', rank)"
    s = run_with_input(kc, code, lines("c", "c"))
    assert s.error is None, s.stdout
    assert sorted(s.prompts) == ["(Pdb rank 0) ", "(Pdb rank 2) "]


def test_post_mortem_reads_a_local_of_the_frame_that_raised(kernel):
    _, kc = kernel
    execute(kc, "%load_ext nbddp")
    code = "%%ddp -n 3 --text\ndef f(a):\n    local = a * 2 + 100\n    return 1 / (a - 1)\nf(rank)"
    r = execute(kc, code)
    assert r.error["ename"] == "CellFailed"
    assert "%ddp debug opens pdb where rank 1 failed" in r.stdout
    s = run_with_input(kc, "%ddp debug", lines("p local", "p a", "q"))
    assert s.error is None, s.stdout
    assert s.prompts == ["(Pdb rank 1) "] * 3
    assert "102\n1\n" in s.stdout
    assert "return 1 / (a - 1)" in s.stdout  # where it stopped, in the cell's own lines
    # out of memory: the frames are let go at once (they hold what filled the memory)
    r = execute(
        kc, "%%ddp --text\nimport torch\nif rank == 0:\n    raise torch.OutOfMemoryError('x')"
    )
    assert r.error["ename"] == "CellFailed"
    r = execute(kc, "%ddp debug --rank 0")
    assert "rank 0's last failed cell ran out of memory: its frames were let go" in r.text
    s = run_with_input(kc, "%ddp debug --rank 2", lines("q"))
    assert s.prompts == []  # one line, no session (IPython prints a UsageError as text)
    assert s.stdout.strip() == "UsageError: %ddp debug: rank 2 has no failed cell to debug"
    r = execute(kc, "%ddp debug --rank 7")
    assert r.text.strip() == "UsageError: --rank: no rank 7 in a pool of 3"


def test_without_an_input_box_a_breakpoint_says_so_and_the_cell_ends(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell("%load_ext nbddp"),
        nbformat.v4.new_code_cell(
            "%%ddp -n 3 --text\nif rank == 1:\n    breakpoint()\nprint('done', rank)"
        ),
        nbformat.v4.new_code_cell("%ddp stop"),
    ]
    client = NotebookClient(
        nb,
        km=ipc_kernel_manager(tmp_path),
        timeout=120,
        allow_errors=True,
        resources={"metadata": {}},
    )
    client.execute()
    outputs = nb.cells[1].outputs
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "rank 1 stopped in pdb, but this front end has no input box (stdin)" in text
    errors = [o for o in outputs if o.output_type == "error"]
    assert errors
    assert "rank 1: BdbQuit: quit from the debugger" in errors[0]["evalue"]


# ---------------------------------------------------------------- the pool's side


@pytest.fixture(scope="module", params=sizes(2, 3, 4, 8))
def sized_pool(request):
    from nbddp import Pool

    with Pool(request.param) as pool:
        yield pool


def answer_all(pool, events, answer):
    """Drive a cell, answering each RankDebug with ``answer(event)``; (prompts, CellEnd)."""
    from nbddp.wire import protocol as P

    prompts, end = [], None
    for event in events:
        if isinstance(event, P.RankDebug):
            prompts.append(event)
            pool.debug_reply(event, answer(event))
        elif isinstance(event, P.CellEnd):
            end = event
    return prompts, end


def test_every_rank_at_a_breakpoint_is_served_in_turn_and_labelled(sized_pool):
    n = sized_pool.world_size
    code = "v = rank\nbreakpoint()\nv = v + 100\nv"
    asked: dict[int, int] = {}

    def answer(event):  # first: change v in that rank's frame; then go on
        asked[event.rank] = asked.get(event.rank, 0) + 1
        return "!v = v * 2" if asked[event.rank] == 1 else "c"

    prompts, end = answer_all(sized_pool, sized_pool.run(code, want_values=True), answer)
    assert not end.errors
    assert asked == {r: 2 for r in range(n)}  # every rank, twice, each its own session
    assert all(p.prompt == f"(Pdb rank {p.rank}) " for p in prompts)
    assert end.values == {r: 2 * r + 100 for r in range(n)}


def test_torch_distributed_breakpoint_stops_one_rank_and_the_others_wait(sized_pool):
    n = sized_pool.world_size
    target = n - 1
    code = (
        "import torch.distributed as dist\n"
        f"dist.breakpoint(rank={target})\n"
        "marker = 'went on'\nmarker"
    )
    answers = iter(["p rank", "c"])
    events = sized_pool.run(code, want_values=True)
    prompts, end = answer_all(sized_pool, events, lambda e: next(answers))
    assert not end.errors, end.errors
    assert {p.rank for p in prompts} == {target}
    assert f"{target}\n" in prompts[1].output  # the answer to "p rank"
    assert end.values == {r: "went on" for r in range(n)}


def ipython(typed: str) -> subprocess.CompletedProcess:
    """Terminal IPython reading ``typed`` from its stdin."""
    return subprocess.run(
        [sys.executable, "-m", "IPython", "--simple-prompt", "--no-banner", "--colors=NoColor"],
        input=typed,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_terminal_ipython_asks_on_its_stdin():
    """Terminal IPython, lines piped in as a user would type them."""
    typed = (
        "%load_ext nbddp\n"
        # ranks 0 and 1 wait for rank 2's session: their lines cannot fall between its
        # prompt and its answer
        "%%ddp -n 3 --text --no-fold\nimport torch.distributed as dist\nx = rank\n"
        "if rank != 2:\n    dist.barrier()\nif rank == 2:\n    breakpoint()\n"
        "print('after', rank)\nif rank == 2:\n    dist.barrier()\n\n\n"
        "p x + 40\n"
        "c\n"
        "%ddp stop\n"
        "exit\n"
    )
    out = ipython(typed).stdout
    assert "-> print('after', rank)" in out  # the cell's own next line
    assert "(Pdb rank 2) 42" in out  # the prompt, then the answer to "p x + 40"
    assert "[rank 2] after 2" in out
    assert "nbddp: stopped the pool" in out


def test_a_closed_input_in_the_terminal_quits_that_ranks_pdb_and_nothing_hangs():
    """The typed lines end while rank 1 waits in pdb (Ctrl-D): pdb reads end of input."""
    typed = (
        "%load_ext nbddp\n"
        "%%ddp -n 3 --text\nimport torch.distributed as dist\n"
        "if rank == 1:\n    breakpoint()\ndist.barrier()\nprint('went on', rank)\n\n\n"
    )
    run = ipython(typed)
    out = run.stdout + run.stderr
    assert "(Pdb rank 1)" in out
    assert "rank 1: BdbQuit: quit from the debugger" in out
    assert run.returncode == 0  # IPython went on to the end of its input and exited


def test_execute_closes_a_breakpoint_instead_of_waiting(sized_pool):
    from nbddp import CellFailed

    n = sized_pool.world_size
    with pytest.raises(CellFailed, match="rank 1: BdbQuit: quit from the debugger"):
        sized_pool.execute("if rank == 1:\n    breakpoint()\nrank")
    assert sized_pool.execute("rank") == list(range(n))


def test_ranch_closes_a_breakpoint_instead_of_waiting():
    from nbddp import CellFailed, ranch
    from nbddp.notebook.session import SESSION, default_pool

    def stops():
        import os

        if os.environ["RANK"] == "0":
            breakpoint()
        return 1

    try:
        with pytest.raises(CellFailed, match="rank 0: BdbQuit"):
            ranch(3, stops)
        assert ranch(3, lambda: 2) == [2, 2, 2]
    finally:
        default_pool().stop()
        SESSION.pool = None
