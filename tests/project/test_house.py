"""The house (DESIGN.md §2): a package per part, no import circle between modules or
between parts, every part imports only the parts below it, rooms of a bounded size.

Read from the sources with ``ast``: imports under ``TYPE_CHECKING`` do not count (they
are never run). A circle or a boundary counts a function's own imports too (they run when
it is called); what a room brings in on import (the libraries it needs) counts those that
run on import. A part is a folder of src/nbddp; the modules at the top are the public
surface (the package, ``python -m nbddp``, ``python -m nbddp.worker``, ``nbddp.loggers``,
the demo)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "nbddp"

# the parts, from the top down: each imports only those after it
LAYERS = ("notebook", "detached", "dashboard", "pool", "rank", "hosts", "wire")
FRONT = {"notebook", "dashboard"}  # the kernel's front end: IPython, widgets, sinks
CORE = {"pool", "detached"}  # the pool core (in the kernel, or its own process)
RANK_SIDE = {"rank", "hosts"}  # the processes torchrun or the pool starts on a host
TOP = {"__init__", "__main__", "demo", "loggers", "worker"}  # the public surface
FRONT_END_LIBRARIES = ("IPython", "ipykernel", "ipywidgets", "anywidget")
MAX_LINES = 400


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


def module_name(path: Path) -> str:
    """``pool.hub`` for src/nbddp/pool/hub.py, ``pool`` for its __init__, ``worker`` at the top."""
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def part_of(module: str) -> str:
    """The part (folder) a module is in; ``top`` for the modules at the top."""
    return module.split(".")[0] if "." in module or module in LAYERS else "top"


def imports_in(tree: ast.Module, lazy: bool, here: str = "") -> tuple[set[str], set[str]]:
    """(nbddp modules, other top-level packages) that ``tree`` (a module of package
    ``here``, dotted, '' for the top) imports on import (with ``lazy``: or in a call)."""
    ours, others = set(), set()
    for node in _statements(tree.body, lazy):
        if isinstance(node, ast.ImportFrom) and node.level:
            package = here.split(".") if here else []
            package = package[: len(package) - (node.level - 1)]
            base = ".".join([*package, *(node.module.split(".") if node.module else [])])
            ours.update(_resolve(base, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            parts = node.module.split(".")
            if parts[0] == "nbddp":
                base = ".".join(parts[1:])
                ours.update(_resolve(base, a.name) for a in node.names)
            else:
                others.add(parts[0])
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "nbddp" and len(parts) > 1:
                    ours.add(".".join(parts[1:]))
                elif parts[0] != "nbddp":
                    others.add(parts[0])
    return {m for m in ours if m}, others


def _resolve(base: str, name: str) -> str:
    """``from BASE import NAME``: the module NAME if BASE.NAME is one, else BASE."""
    candidate = f"{base}.{name}" if base else name
    if (SRC / f"{candidate.replace('.', '/')}.py").exists() or (
        SRC / candidate.replace(".", "/") / "__init__.py"
    ).exists():
        return candidate
    return base


def _read(path: Path, lazy: bool) -> tuple[set[str], set[str]]:
    module = module_name(path)
    here = module if path.name == "__init__.py" else module.rpartition(".")[0]
    if path.name == "__init__.py" and path.parent == SRC:
        here = ""
    return imports_in(ast.parse(path.read_text()), lazy, here)


FILES = {module_name(p): p for p in sorted(SRC.rglob("*.py")) if "__pycache__" not in p.parts}
MODULES = sorted(FILES)
GRAPH = {m: _read(p, lazy=False) for m, p in FILES.items()}  # on import
EVER = {m: _read(p, lazy=True) for m, p in FILES.items()}  # on import or in a call
PACKAGE_FACES = {m for m in MODULES if m in LAYERS or m == "__init__"}


def reachable(start: str, graph: dict = GRAPH) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for dep in graph[todo.pop()][0]:
            if dep not in seen and dep in graph:
                seen.add(dep)
                todo.append(dep)
    return seen


def part_edges(graph: dict) -> dict[str, set[str]]:
    """Part -> the other parts its modules import (on import or in a call)."""
    edges: dict[str, set[str]] = {}
    for module, (deps, _) in graph.items():
        edges.setdefault(part_of(module), set()).update(
            part_of(d) for d in deps if part_of(d) != part_of(module)
        )
    return edges


def part_circle(graph: dict) -> list[str] | None:
    """A circle between parts (as a path), or None."""
    edges = part_edges(graph)

    def visit(node: str, path: list[str]) -> list[str] | None:
        for dep in sorted(edges.get(node, ())):
            if dep in path:
                return [*path[path.index(dep) :], dep]
            found = visit(dep, [*path, dep])
            if found:
                return found
        return None

    for part in sorted(edges):
        found = visit(part, [part])
        if found:
            return found
    return None


def upward(graph: dict) -> list[str]:
    """Imports from a part to one above it (or beside it, but the top)."""
    order = {part: i for i, part in enumerate(LAYERS)}
    wrong = []
    for module, (deps, _) in graph.items():
        mine = part_of(module)
        if mine == "top":
            continue
        for dep in deps:
            theirs = part_of(dep)
            if theirs != mine and (theirs == "top" or order[theirs] < order[mine]):
                wrong.append(f"{module} -> {dep}")
    return sorted(wrong)


def test_every_module_is_in_a_part():
    stray = [m for m in MODULES if part_of(m) not in LAYERS and m not in TOP]
    assert not stray, f"put these in a part (a folder of src/nbddp): {stray}"


@pytest.mark.parametrize("module", MODULES)
def test_no_import_circles(module):
    """Of any length, a function's own imports included."""
    assert module not in reachable(module, EVER)


def test_no_circle_between_parts():
    assert part_circle(EVER) is None, " -> ".join(part_circle(EVER))


def test_each_part_imports_only_the_parts_below_it():
    """notebook, detached, dashboard, pool, rank, hosts, wire: from the top down."""
    assert not upward(EVER), upward(EVER)


@pytest.mark.parametrize("module", [m for m in MODULES if part_of(m) in CORE])
def test_the_core_knows_no_front_end(module):
    deps = reachable(module, EVER)
    assert not {part_of(d) for d in deps} & FRONT, f"{module} reaches {sorted(deps)}"
    used = set().union(*(GRAPH[d][1] for d in reachable(module) | {module}))
    assert not used & set(FRONT_END_LIBRARIES), f"{module} imports {used}"


@pytest.mark.parametrize("module", [m for m in MODULES if part_of(m) in RANK_SIDE])
def test_the_rank_knows_no_notebook(module):
    deps = {d for d in reachable(module, EVER) if part_of(d) not in RANK_SIDE | {"wire"}}
    assert not deps, f"{module} reaches {sorted(deps)}"


@pytest.mark.parametrize("module", [m for m in MODULES if part_of(m) == "wire"])
def test_the_wire_imports_nothing_above_it(module):
    above = {d for d in EVER[module][0] if part_of(d) != "wire"}
    assert not above, f"{module} imports {sorted(above)}"


@pytest.mark.parametrize("module", MODULES)
def test_each_room_is_of_a_size_one_can_hold_in_mind(module):
    lines = len(FILES[module].read_text().splitlines())
    assert lines <= MAX_LINES, f"{FILES[module].relative_to(SRC)} has {lines} lines: split it"


def test_the_checks_can_see_a_circle_and_an_upward_import():
    broken = dict(EVER)
    broken["wire.protocol"] = (EVER["wire.protocol"][0] | {"pool.hub"}, set())
    assert "wire.protocol -> pool.hub" in upward(broken)
    assert part_circle(broken) is not None  # pool -> wire -> pool
    assert "wire.protocol" in reachable("wire.protocol", broken)
    saved = dict(GRAPH)
    try:
        GRAPH["pool.hub"] = (
            GRAPH["pool.hub"][0] | {"pool.facade"},
            GRAPH["pool.hub"][1] | {"IPython"},
        )
        assert "pool.hub" in reachable("pool.hub")
        assert "IPython" in set().union(*(GRAPH[d][1] for d in reachable("pool.roster")))
    finally:
        GRAPH.clear()
        GRAPH.update(saved)
    lazy = ast.parse("def connect():\n    from ..detached.client import connect\n")
    assert imports_in(lazy, lazy=True, here="pool") == ({"detached.client"}, set())
    assert imports_in(lazy, lazy=False, here="pool") == (set(), set())
    modules = ast.parse("from ..wire import protocol as P\nfrom . import hub\n")
    assert imports_in(modules, lazy=False, here="pool") == ({"wire.protocol", "pool.hub"}, set())
    typing_only = ast.parse("if TYPE_CHECKING:\n    from . import facade\n")
    assert imports_in(typing_only, lazy=True, here="pool") == (set(), set())


# recovery decides, the pool's repair part carries out (issue 40, one way through): what
# recovery may import (its words and its facts' types), and it is handed no pool to drive
DECIDER_IMPORTS = {
    "wire.protocol",
    "wire.stacks",
    "pool.deathnote",
    "pool.stopnote",
    "pool.errors",
    "pool.deadlock",
}


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
    ours = EVER["pool.recovery"][0]
    assert ours <= DECIDER_IMPORTS, f"recovery imports {sorted(ours - DECIDER_IMPORTS)}"
    tree = ast.parse(FILES["pool.recovery"].read_text())
    assert not names_the_pool(tree), names_the_pool(tree)
    carriers = {m for m in MODULES if "pool.recovery" in EVER[m][0]}
    assert carriers == {"pool.repair"}, f"{sorted(carriers)} ask recovery"


def test_the_decider_check_sees_a_pool():
    old = ast.parse("from .roster import RankGone\ndef replace(pool, dead):\n    pool.reap()\n")
    assert imports_in(old, lazy=True, here="pool")[0] - DECIDER_IMPORTS == {"pool.roster"}
    assert names_the_pool(old) == ["2: argument pool", "3: pool"]
