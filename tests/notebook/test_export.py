"""Notebook -> torchrun script (``python -m nbddp export``, ``%ddp export``)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import free_port
from nbddp.notebook.export import export, export_notebook, globals_read

ROOT = Path(__file__).parents[2]
TORCHRUN = Path(sys.executable).with_name("torchrun")


def torchrun(script: Path, n: int, timeout: float = 240) -> str:
    """Run ``script`` under torchrun; its whole session is ended if it overstays."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NBDDP_", "MASTER_"))}
    port = str(free_port())
    proc = subprocess.Popen(
        [str(TORCHRUN), "--nproc-per-node", str(n), "--master-port", port, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=script.parent,
        env=env,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, out + err
    return out


def test_notebook_02_exported_runs_under_torchrun_and_prints_what_the_notebook_printed(tmp_path):
    script = tmp_path / "train.py"
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "nbddp",
            "export",
            str(ROOT / "notebooks/02-ddp-cnn.ipynb"),
            "-o",
            str(script),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert f"torchrun --nproc-per-node 2 {script}" in cli.stdout
    saved = (ROOT / "notebooks/02-ddp-cnn.ipynb").read_text()
    expected = sorted(set(re.findall(r"epoch \d: loss \d\.\d+", saved)))
    assert len(expected) == 6  # 3 epochs x 2 ranks, in the notebook's saved dashboards
    printed = sorted(set(re.findall(r"epoch \d: loss \d\.\d+", torchrun(script, 2))))
    assert printed == expected


def test_cells_become_one_script_with_what_they_used_and_data_is_reported():
    cells = [
        "%load_ext nbddp",
        "import math\nfrom torch import nn\n\ndef helper(x):\n    return x * SCALE\n\n"
        "SCALE = 3\n\n@staticmethod\ndef unused():\n    pass\n\n"
        "def double(x):\n    return helper(x) + math.floor(0.5)\n\nclass Net(nn.Module):\n"
        "    pass\n\nweights = [1, 2]",
        "%%ddp -n 4 --imports 'import os; import json'\nnet = Net()\nvalue = double(rank)",
        "%%ddp --ranks 0,2 --out vals\nprint(value, weights)",
        "%%ddp --no-auto --need double\nprint(double(net is not None))",
        "got = %ddp pull value --all\nprint(got)",
    ]
    result = export(cells, source="test.ipynb", target="t.py")
    script = result.script
    assert result.nproc == 4
    assert result.command("t.py") == "torchrun --nproc-per-node 4 t.py"
    compile(script, "t.py", "exec")  # valid Python
    assert "import math\nfrom torch import nn" in script
    assert "def helper(x):" in script
    assert "def double(x):" in script
    assert "class Net(nn.Module):" in script
    assert "unused" not in script
    assert "import os\n import json" not in script
    assert "import os\nimport json\nnet = Net()" in script
    assert "if rank in (0, 2):\n    print(value, weights)" in script
    assert "# --out vals: each rank's last value went to the notebook" in script
    assert "# (notebook) got = %ddp pull value --all" in script
    assert "%load_ext" not in script
    assert "print(got)" not in script
    # SCALE (used by helper) and weights (read by a cell) are data from the notebook
    assert sorted(result.notes) == [
        "not exported: SCALE (data from notebook cell 2; define it in the script)",
        "not exported: weights (data from notebook cell 2; define it in the script)",
    ]
    assert "# nbddp export: weights came from the notebook (cell 2): define it here" in script


@pytest.mark.parametrize(
    ("code", "reads"),
    [
        ("def f(x):\n    return x * 2\nprint(f(x))", {"x", "print"}),
        ("class A:\n    n_items = 1\nprint(n_items)", {"n_items", "print"}),
        ("y = [i * k for i in range(3)]", {"k", "range"}),
        ("def g():\n    global z\n    z = 1\n    return w\ng()", {"w"}),
        ("import os\nos.getcwd()", set()),
        (
            "def outer():\n    a = 1\n    def inner():\n        return a + b\n    return inner\n"
            "outer()()",
            {"b"},
        ),
        (
            "try:\n    raise ValueError\nexcept ValueError as e:\n    print(e)",
            {"ValueError", "print"},
        ),
        ("lam = lambda q: q + r\nlam(1)", {"r"}),
    ],
)
def test_globals_read_matches_what_python_needs_to_run_the_code(code, reads):
    """Each case runs every name it reads: Python's answer is what it needs to run."""
    import builtins

    assert globals_read(code) == reads
    given = {name: 1 for name in reads if not hasattr(builtins, name)}
    exec(compile(code, "<t>", "exec"), dict(given))  # runs with exactly those names
    for missing in given:  # and fails without any one of them
        with pytest.raises(NameError):
            exec(compile(code, "<t>", "exec"), {k: v for k, v in given.items() if k != missing})


def test_export_notebook_reads_the_saved_file(tmp_path):
    result = export_notebook(ROOT / "notebooks/01-quickstart.ipynb", target="q.py")
    compile(result.script, "q.py", "exec")
    assert "dist.init_process_group" in result.script


def test_the_cli_says_what_went_wrong_in_one_line(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "nbddp", "export", str(tmp_path / "none.ipynb"), "-o", "x.py"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 1
    assert out.stderr.count("\n") == 1
    assert out.stderr.startswith("nbddp export: ")


def test_ddp_export_writes_the_sessions_cells(tmp_path):
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_cell("%load_ext nbddp", store_history=True)
    try:
        shell.run_cell("def twice(x):\n    return 2 * x", store_history=True)
        shell.history_manager.input_hist_raw.append("%%ddp -n 3\nprint(twice(rank))")
        target = tmp_path / "session.py"
        shell.run_cell(f"%ddp export {target}", store_history=True)
        script = target.read_text()
        assert "def twice(x):" in script
        assert "print(twice(rank))" in script
        assert "%ddp export" not in script
        printed = torchrun(target, 3)  # three processes: their lines may interleave
        assert sorted("".join(printed.split())) == ["0", "2", "4"]
    finally:
        shell.run_cell("%unload_ext nbddp")


def test_the_cli_writes_over_no_file_without_force_and_never_over_a_notebook(tmp_path, capsys):
    from nbddp.__main__ import main

    notebook = tmp_path / "nb.ipynb"
    notebook.write_text((ROOT / "notebooks/01-quickstart.ipynb").read_text())
    saved = notebook.read_text()
    target = tmp_path / "train.py"
    target.write_text("# mine\n")
    assert main(["export", str(notebook), "-o", str(target)]) == 1
    assert "exists" in capsys.readouterr().err
    assert target.read_text() == "# mine\n"
    assert main(["export", str(notebook), "-o", str(target), "--force"]) == 0
    assert "dist.init_process_group" in target.read_text()
    for args in ([], ["--force"]):
        assert main(["export", str(notebook), "-o", str(notebook), *args]) == 1
        assert ".ipynb" in capsys.readouterr().err
        assert notebook.read_text() == saved


def test_ddp_export_writes_over_no_file_without_force_and_never_over_a_notebook(tmp_path):
    from IPython.core.error import UsageError
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_cell("%load_ext nbddp", store_history=True)
    try:
        shell.history_manager.input_hist_raw.append("%%ddp -n 2\nprint(rank)")
        target = tmp_path / "train.py"
        target.write_text("# mine\n")
        result = shell.run_cell(f"%ddp export {target}")
        assert isinstance(result.error_in_exec, UsageError)
        assert target.read_text() == "# mine\n"
        assert shell.run_cell(f"%ddp export {target} --force").success
        assert "print(rank)" in target.read_text()
        notebook = tmp_path / "nb.ipynb"
        for line in (f"%ddp export {notebook}", f"%ddp export {notebook} --force"):
            result = shell.run_cell(line)
            assert isinstance(result.error_in_exec, UsageError)
            assert not notebook.exists()
    finally:
        shell.run_cell("%unload_ext nbddp")
