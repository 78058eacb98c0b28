"""The house (DESIGN.md §2): no import circles, nothing imported upward, rooms of a
bounded size. Read from the sources with ``ast``: imports under ``TYPE_CHECKING``
do not count (they are never run). A circle counts a function's own imports too (they
run when it is called); what a room brings in on import (its level, the libraries it
needs) counts those that run on import."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src" / "nbddp"

# the pool's core: it runs without IPython, and (detached, later) in a process of its own
CORE = {
    "pool", "hub", "listener", "roster", "processes", "cell", "recovery", "outcome",
    "queries", "layout", "logs", "drive", "sigint", "supervisor", "launch", "payload",
    "capture", "protocol", "events", "errors", "stacks", "streams", "sizes", "store",
    "copying", "detached", "detached_client", "detached_wire", "pool_calls", "wire",
    "handshake", "private", "tls", "markers", "resizing", "healing", "deathnote",
    "carriers", "detached_folder", "detached_kernels", "detached_outbox", "detached_pool",
    "gpus", "pool_life", "pool_repair", "codec", "deadlock", "hosts_lost",
}  # fmt: skip
FRONT = {
    "magics", "options", "session", "prompts", "autocapture", "attaching", "api",
    "dashboard", "dashboard_html", "dashboard_widget", "sinks", "fold", "fold_shape", "export",
    "demo", "remote", "detaching", "reports", "magics_pool", "metric_store", "charts", "theme",
    "fold_group", "fold_lines", "progress_fold",
}  # fmt: skip
WORKER = {
    "worker", "worker_control", "worker_group", "worker_shims", "worker_cell",
    "worker_code", "ddp", "debugger", "profiling", "collectives", "rich", "mpl_backend",
    "worker_copy", "metrics", "loggers", "workspace", "worker_held", "worker_wrap",
    "worker_holder", "worker_seq",
}  # fmt: skip
# shared by the notebook, the worker and the relay: the wire, errors as data, stacks, the
# listener (the relay's is the notebook's), streams, shipped data, the launcher, the
# authenticated connections and private files
SHARED = {
    "protocol", "events", "errors", "stacks", "payload", "launch", "listener", "streams", "store",
    "wire", "handshake", "private", "tls", "markers", "carriers", "gpus", "codec",
}  # fmt: skip
NOTEBOOK_SIDE = CORE - SHARED
FRONT_END_LIBRARIES = ("IPython", "ipykernel", "ipywidgets", "anywidget")
MAX_LINES = 450


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _statements(body: list[ast.stmt], lazy: bool):
    """The statements that run on import (with ``lazy``, in functions and classes too: a
    function's own imports run when it is called); never under ``if TYPE_CHECKING``."""
    for node in body:
        if isinstance(node, ast.If) and _type_checking(node):
            continue
        yield node
        for field in ("body", "orelse", "finalbody", "handlers"):
            inner = getattr(node, field, None)
            if isinstance(inner, list) and (
                lazy or not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            ):
                yield from _statements(inner, lazy)


def imports_of(module: str, lazy: bool = False) -> tuple[set[str], set[str]]:
    """(nbddp modules, other top-level packages) that importing ``module`` imports (with
    ``lazy``: or that its functions import when called)."""
    return imports_in(ast.parse((SRC / f"{module}.py").read_text()), lazy)


def imports_in(tree: ast.Module, lazy: bool) -> tuple[set[str], set[str]]:
    ours, others = set(), set()
    for node in _statements(tree.body, lazy):
        if isinstance(node, ast.ImportFrom) and node.level:
            if node.module:
                ours.add(node.module.split(".")[0])
            else:
                ours.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module == "nbddp":
            ours.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            parts = node.module.split(".")
            (ours.add(parts[1]) if parts[0] == "nbddp" else others.add(parts[0]))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "nbddp" and len(parts) > 1:
                    ours.add(parts[1])
                else:
                    others.add(parts[0])
    return ours - {"__init__"}, others


MODULES = sorted(p.stem for p in SRC.glob("*.py") if p.stem not in ("__init__", "__main__"))
GRAPH = {m: imports_of(m) for m in MODULES}  # on import
EVER = {m: imports_of(m, lazy=True) for m in MODULES}  # on import or in a call


def reachable(start: str, graph: dict = GRAPH) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for dep in graph[todo.pop()][0]:
            if dep not in seen and dep in graph:
                seen.add(dep)
                todo.append(dep)
    return seen


def test_every_module_is_in_one_room():
    assert set(MODULES) <= CORE | FRONT | WORKER | {"relay", "relay_carry", "_vendor"}, (
        set(MODULES) - CORE - FRONT - WORKER
    )


@pytest.mark.parametrize("module", MODULES)
def test_no_import_circles(module):
    """Of any length, a function's own imports included."""
    assert module not in reachable(module, EVER)


@pytest.mark.parametrize("module", sorted(CORE))
def test_the_core_knows_no_front_end(module):
    deps = reachable(module) | {module}
    assert not deps & FRONT, f"{module} reaches {sorted(deps & FRONT)}"
    used = set().union(*(GRAPH[d][1] for d in deps))
    assert not used & set(FRONT_END_LIBRARIES), f"{module} imports {used}"


@pytest.mark.parametrize("module", sorted(WORKER))
def test_the_worker_knows_no_notebook(module):
    deps = reachable(module) | {module}
    assert not deps & (NOTEBOOK_SIDE | FRONT), f"{module} reaches {sorted(deps & NOTEBOOK_SIDE)}"


@pytest.mark.parametrize("module", MODULES)
def test_each_room_is_of_a_size_one_can_hold_in_mind(module):
    lines = len((SRC / f"{module}.py").read_text().splitlines())
    assert lines <= MAX_LINES, f"{module}.py has {lines} lines: split it"


def test_the_checks_can_see_a_circle_and_an_upward_import():
    saved = dict(GRAPH)
    try:
        GRAPH["hub"] = (GRAPH["hub"][0] | {"pool"}, GRAPH["hub"][1] | {"IPython"})
        assert "hub" in reachable("hub")
        assert "IPython" in set().union(*(GRAPH[d][1] for d in reachable("roster")))
        lazy = ast.parse("def connect():\n    from .detached_client import connect\n")
        assert imports_in(lazy, lazy=True) == ({"detached_client"}, set())
        assert imports_in(lazy, lazy=False) == (set(), set())
        typing_only = ast.parse("if TYPE_CHECKING:\n    from . import pool\n")
        assert imports_in(typing_only, lazy=True) == (set(), set())
    finally:
        GRAPH.clear()
        GRAPH.update(saved)


# recovery decides, the pool's repair part carries out (issue 40, one way through): what
# recovery may import (its words and its facts' types), and it is handed no pool to drive
DECIDER_IMPORTS = {"protocol", "stacks", "deathnote", "errors", "deadlock"}


def names_the_pool(tree: ast.Module) -> list[str]:
    """Where ``tree`` takes, names or reaches into a pool (``pool``, ``self.pool``,
    ``pool.roster``...): each as ``line: what``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.arg) and node.arg == "pool":
            found.append(f"{node.lineno}: argument pool")
        elif isinstance(node, ast.Name) and node.id == "pool":
            found.append(f"{node.lineno}: pool")
        elif isinstance(node, ast.Attribute) and node.attr in ("pool", "roster", "hub", "procs"):
            found.append(f"{node.lineno}: .{node.attr}")
    return found


def test_recovery_decides_and_touches_nothing():
    """recovery reads typed facts and returns decisions: it imports none of the parts that
    own ranks, processes or connections, and never takes or reaches into a pool (the old
    recovery drove ``pool.reap``, ``pool.roster``, ``pool.hub``... itself)."""
    tree = ast.parse((SRC / "recovery.py").read_text())
    ours, _ = imports_in(tree, lazy=True)
    assert ours <= DECIDER_IMPORTS, f"recovery imports {sorted(ours - DECIDER_IMPORTS)}"
    assert not names_the_pool(tree), names_the_pool(tree)
    carriers = {m for m in MODULES if "recovery" in EVER[m][0]}
    assert carriers == {"pool_repair"}, f"{sorted(carriers)} ask recovery"


def test_the_decider_check_sees_a_pool():
    old = ast.parse("from .roster import RankGone\ndef replace(pool, dead):\n    pool.reap()\n")
    assert imports_in(old, lazy=True)[0] - DECIDER_IMPORTS == {"roster"}
    assert names_the_pool(old) == ["2: argument pool", "3: pool"]
