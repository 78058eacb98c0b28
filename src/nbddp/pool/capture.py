"""From the notebook's names and import text to what the ranks receive.

Everything here runs before any rank does, so a missing name or an object
that cannot be pickled is reported (naming the variable and the reason) while
nothing has changed on the ranks.
"""

from __future__ import annotations

import ast
import re
import symtable

from ..wire import payload
from .errors import CaptureError
from .sizes import human, parse_size, size_of

# size_of, human and parse_size live in nbddp.pool.sizes; they are part of what capture offers
__all__ = [
    "check_imports",
    "collect",
    "human",
    "pack",
    "parse_ranks",
    "parse_size",
    "size_of",
    "split_names",
]


def split_names(text: str | None) -> list[str]:
    """``"a,b c"`` -> ``["a", "b", "c"]`` (order kept, duplicates dropped)."""
    names: list[str] = []
    for name in re.split(r"[,\s]+", (text or "").strip()):
        if not name:
            continue
        if not name.isidentifier():
            raise CaptureError(f"not a Python name: {name!r}")
        if name not in names:
            names.append(name)
    return names


def collect(names: list[str], namespace: dict) -> dict[str, object]:
    """The named objects, or an error naming the first that does not exist."""
    missing = [n for n in names if n not in namespace]
    if missing:
        raise CaptureError(
            f"name {missing[0]!r} is not defined in the notebook"
            + (f" (nor {', '.join(map(repr, missing[1:]))})" if missing[1:] else "")
        )
    return {n: namespace[n] for n in names}


def pack(objects: dict[str, object], folder: str | None = None) -> payload.Shipment | None:
    """Pickle the objects once for every rank; big tensors go through shared memory in
    ``folder`` (the pool's own: ``Pool.shm_folder``), or inside the pickle when it is
    None (ranks on other hosts).

    On failure, the error names the object that cannot go and why.
    """
    if not objects:
        return None
    try:
        return payload.dumps(objects, folder)
    except Exception as whole:
        for name, obj in objects.items():
            try:
                payload.dumps(obj)
            except Exception as exc:
                raise CaptureError(
                    f"cannot ship {name!r} ({type(obj).__name__}) to the ranks: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
        raise CaptureError(f"cannot ship the objects: {type(whole).__name__}: {whole}") from whole


def check_imports(text: str | None) -> str:
    """Import statements separated by ``;`` or newlines; anything else is an error."""
    text = (text or "").strip()
    if not text:
        return ""
    try:
        tree = ast.parse(text, "<imports>")  # pragma: no mutate (the name is never shown)
    except SyntaxError as exc:
        raise CaptureError(f"--imports is not valid Python: {exc.msg}: {text!r}") from None
    for stmt in tree.body:
        if not isinstance(stmt, ast.Import | ast.ImportFrom):
            raise CaptureError(f"--imports takes import statements only, not {ast.unparse(stmt)!r}")
    return text


def parse_ranks(text: str | None, world_size: int | None = None) -> list[int] | None:
    """``"0,2-3"`` -> ``[0, 2, 3]``; None for all ranks."""
    if text is None:
        return None
    ranks: set[int] = set()
    for part in text.replace(" ", "").split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m:
            raise CaptureError(f"--ranks takes ranks like 0,2-3, not {text!r}")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if hi < lo:
            raise CaptureError(f"--ranks: empty range {part!r}")
        ranks.update(range(lo, hi + 1))
    if world_size is not None and max(ranks) >= world_size:
        raise CaptureError(f"--ranks: no rank {max(ranks)} in a pool of {world_size}")
    return sorted(ranks)


# ---------------------------------------------------------------- automatic capture

NOT_CAPTURED = frozenset({"In", "Out", "exit", "quit", "get_ipython", "display"})


def names_imported(statements: list[str]) -> set[str]:
    """The names import statements bind."""
    bound: set[str] = set()
    for stmt in statements:
        for node in ast.walk(ast.parse(stmt)):
            if isinstance(node, ast.Import | ast.ImportFrom):
                bound.update((a.asname or a.name).split(".")[0] for a in node.names)
    return bound


def names_read(code: str) -> list[str]:
    """The names a cell reads from the notebook, in order of first use.

    What the compiler sees: a name counts when a read of it resolves to the
    module's globals (at the cell's top level, or inside a function, lambda,
    class body or comprehension that does not bind it; ``symtable`` says which)
    and comes before the cell binds it at its top level. Statements run in
    order; a binding inside ``if``/``for``/``while``/``try``/``match`` counts
    only within that block (it may not happen), one inside ``with`` counts
    after it. A function's reads count where it is defined (it may be called at
    once). Over-counting costs a shipment (a rank keeps its own value: shipped
    names are bound only where unbound); under-counting is a NameError on the
    ranks, so doubt counts the name in.
    """
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return []  # the ranks report the syntax error
    found: dict[str, None] = {}
    _Scope(found).block(tree.body, set())
    return list(found)


class _Scope:
    """The cell's top level, walked in execution order (see :func:`names_read`)."""

    def __init__(self, found: dict[str, None]) -> None:
        self.found = found

    def block(self, body: list[ast.stmt], bound: set[str]) -> None:
        for stmt in body:
            self.statement(stmt, bound)

    def read(self, nodes, bound: set[str], targets: bool = False) -> None:
        """What ``nodes`` read, then what they bind (a statement, or a walrus in an
        expression); ``targets``: they are assignment targets or a match pattern."""
        reads, binds = _reads_and_binds(nodes, targets)
        for name in reads:
            if name not in bound:
                self.found.setdefault(name)
        bound |= binds

    def bind(self, nodes, bound: set[str]) -> None:
        """Names assigned to by ``nodes`` (targets, patterns), after what they read."""
        self.read(nodes, bound, targets=True)

    def statement(self, stmt: ast.stmt, bound: set[str]) -> None:
        if isinstance(stmt, ast.If | ast.While):
            self.read([stmt.test], bound)
            self.block(stmt.body, set(bound))
            self.block(stmt.orelse, set(bound))
        elif isinstance(stmt, ast.For | ast.AsyncFor):
            self.read([stmt.iter], bound)
            inner = set(bound)
            self.bind([stmt.target], inner)
            self.block(stmt.body, inner)
            self.block(stmt.orelse, set(bound))
        elif isinstance(stmt, ast.With | ast.AsyncWith):
            for item in stmt.items:
                self.read([item.context_expr], bound)
                if item.optional_vars is not None:
                    self.bind([item.optional_vars], bound)
            self.block(stmt.body, bound)  # it runs (or the cell fails)
        elif isinstance(stmt, ast.Try | getattr(ast, "TryStar", ast.Try)):
            self.block(stmt.body, set(bound))
            for handler in stmt.handlers:
                inner = set(bound)
                if handler.type is not None:
                    self.read([handler.type], inner)
                if handler.name:
                    inner.add(handler.name)
                self.block(handler.body, inner)
            self.block(stmt.orelse, set(bound))
            self.block(stmt.finalbody, set(bound))
        elif isinstance(stmt, ast.Match):
            self.read([stmt.subject], bound)
            for case in stmt.cases:
                inner = set(bound)
                self.bind([case.pattern], inner)
                if case.guard is not None:
                    self.read([case.guard], inner)
                self.block(case.body, inner)
        else:  # a simple statement, a def or a class: what it reads, then what it binds
            self.read([stmt], bound)


def _reads_and_binds(nodes: list[ast.AST], targets: bool) -> tuple[list[str], set[str]]:
    """Global reads (in order of first appearance) and top-level bindings of ``nodes``,
    from ``symtable`` run on them as a little module of their own.

    ``targets``: the nodes are assignment targets or a match pattern.
    """
    if targets:
        if isinstance(nodes[0], ast.pattern):
            wrapped = ast.Match(
                subject=ast.Name("_", ast.Load()),  # pragma: no mutate (only unparsed)
                cases=[ast.match_case(pattern=nodes[0], body=[ast.Pass()])],
            )
        else:
            wrapped = ast.Assign(targets=list(nodes), value=ast.Constant(None))
        body: list[ast.stmt] = [wrapped]
    else:
        body = list(nodes)  # statements or expressions: unparsed, they read the same
    module = ast.fix_missing_locations(ast.Module(body=body, type_ignores=[]))
    source = ast.unparse(module)
    try:
        top = symtable.symtable(source, "<cell>", "exec")  # pragma: no mutate (the name)
    except SyntaxError:  # what symtable refuses (nonlocal at the top): every name is read
        names = [n.id for n in ast.walk(module) if isinstance(n, ast.Name)]
        return list(dict.fromkeys(names)), set()
    reads: set[str] = set()
    binds: set[str] = set()
    for sym in top.get_symbols():
        if sym.is_referenced():
            reads.add(sym.get_name())
        if sym.is_assigned() or sym.is_imported():
            binds.add(sym.get_name())
    # x += 1 reads x, though symtable marks it only as assigned
    augmented = {
        n.target.id
        for n in ast.walk(module)
        if isinstance(n, ast.AugAssign) and isinstance(n.target, ast.Name)
    }
    reads |= augmented & binds
    stack = [(table, True) for table in top.get_children()]
    while stack:  # functions, lambdas, classes, comprehensions: the globals they read
        table, at_once = stack.pop()
        # a list, set or dict comprehension runs where it stands: its walrus binds here
        at_once = at_once and table.get_name() in ("listcomp", "setcomp", "dictcomp")
        stack += [(child, at_once) for child in table.get_children()]
        for sym in table.get_symbols():
            if not sym.is_global():
                continue
            name = sym.get_name()
            if sym.is_referenced() or (sym.is_assigned() and name in augmented):
                reads.add(name)
            if at_once and sym.is_assigned():
                binds.add(name)
    # del x needs x; a wrapped match reads no "_" of ours
    reads |= {
        n.id for n in ast.walk(module) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Del)
    }
    if targets and isinstance(nodes[0], ast.pattern):
        reads.discard("_")
    first: dict[str, tuple[int, int]] = {}
    for node in ast.walk(module):
        if isinstance(node, ast.Name):
            first.setdefault(node.id, (node.lineno, node.col_offset))
            first[node.id] = min(first[node.id], (node.lineno, node.col_offset))
    ordered = sorted(reads, key=first.__getitem__)  # every name read is a Name node
    return ordered, binds


def import_statements(code: str) -> list[str]:
    """The top-level import statements of (IPython-transformed) notebook code."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return []
    return [
        ast.unparse(node)
        for node in tree.body
        if isinstance(node, ast.Import | ast.ImportFrom)
        and getattr(node, "module", None) != "__future__"
    ]


def select_auto(
    code: str,
    namespace: dict,
    on_ranks: frozenset[str],
    explicit: list[str],
    limit: int,
    imported: set[str] = frozenset(),
    already_sent=lambda name, obj: False,
) -> tuple[dict[str, object], dict[str, int], list[str]]:
    """What automatic capture ships for ``code``, its sizes, and a note per name left behind.

    A name goes when the cell reads it, the notebook has it, and some rank
    lacks it; never a private or IPython name, never one named with --need or
    bound by a replayed import (``imported``), never one ``already_sent`` as it
    is (checked before it is sized: sizing may pickle it), never one bigger than
    ``limit`` bytes (--need ships those) or unpicklable.
    """
    import builtins

    chosen: dict[str, object] = {}
    sizes: dict[str, int] = {}
    notes: list[str] = []
    for name in names_read(code):
        if (
            name in on_ranks
            or name in explicit
            or name in imported
            or name not in namespace
            or name.startswith("_")
            or name in NOT_CAPTURED
            or hasattr(builtins, name)
        ):
            continue
        obj = namespace[name]
        if already_sent(name, obj):
            continue
        try:
            size = size_of(obj, limit)
        except Exception as exc:
            notes.append(f"{name} not shipped: cannot pickle it ({type(exc).__name__}: {exc})")
            continue
        if size is None or size > limit:
            over = "it pickles to more than the" if size is None else f"{human(size)} is over the"
            notes.append(
                f"{name} not shipped automatically: {over} "
                f"{human(limit)} limit (name it with --need {name})"
            )
            continue
        chosen[name], sizes[name] = obj, size
    return chosen, sizes, notes
