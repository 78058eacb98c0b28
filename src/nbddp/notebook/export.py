"""Notebook -> torchrun script: the ``%%ddp`` cells, with what they used from the notebook.

``python -m nbddp export NOTEBOOK.ipynb -o train.py`` and ``%ddp export train.py``
write one script that runs under ``torchrun --nproc-per-node N`` unchanged:

- the notebook's imports, and the functions and classes the ``%%ddp`` cells use
  (by ``--need``, or read as automatic capture would ship them), with what those
  use in turn, in notebook order;
- what every ``%%ddp`` cell has (the process group, ``rank``, ``world_size``,
  ``local_rank``, ``device``), set up as torchrun scripts do;
- each ``%%ddp`` cell's body in order, its ``--imports`` first; a cell with
  ``--ranks`` becomes an ``if rank in (...)`` block; ``--out`` and
  ``%ddp pull`` lines are left as comments.

Data the notebook computed (a tensor, a list) cannot be written as code: such
names are reported, and marked in the script where they are needed, never
dropped silently. Which names a cell reads comes from ``symtable``, the
compiler's own scoping.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import symtable
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

from ..pool.capture import names_read, parse_ranks
from .options import ddp_cell

__all__ = ["Exported", "check_target", "export", "export_notebook", "globals_read"]

# names every rank has without the notebook (nbddp binds them; torch is imported below)
RANK_NAMES = {"rank", "local_rank", "world_size", "device", "torch", "display", "group", "mesh"}

SETUP = """\
import os

import torch
import torch.distributed as dist

# what every %%ddp cell has: the process group, rank, world_size, local_rank, device
dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
rank, world_size = dist.get_rank(), dist.get_world_size()
local_rank = int(os.environ.get("LOCAL_RANK", rank))
device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
if device.type == "cuda":
    torch.cuda.set_device(device)
"""


def globals_read(code: str) -> set[str]:
    """Global names ``code`` reads before binding them (:func:`nbddp.pool.capture.names_read`)."""
    return set(names_read(code))


@dataclass
class _Def:
    name: str
    source: str
    cell: int
    kind: str  # "def" | "class" | "data"


@dataclass
class Exported:
    script: str
    nproc: int
    notes: list[str] = field(default_factory=list)

    def command(self, path: str) -> str:
        return f"torchrun --nproc-per-node {self.nproc} {path}"


def _without_magics(code: str) -> tuple[str, list[str]]:
    """Code lines with IPython magics and shell escapes turned into comments."""
    lines, magics = [], []
    for line in code.splitlines():
        stripped = line.strip()
        if stripped.startswith(("%", "!")) or "= %" in line or "=%" in line:
            magics.append(stripped)
            lines.append("")
        else:
            lines.append(line)
    return "\n".join(lines), magics


def _notebook_cell(code: str, index: int, defs: dict, imports: list[str]) -> list[str]:
    """Take a plain cell's imports and definitions; return its magic lines."""
    code, magics = _without_magics(code)
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return magics
    for node in tree.body:
        text = ast.get_source_segment(code, node, padded=False) or ""
        if isinstance(node, ast.Import | ast.ImportFrom):
            if text not in imports:
                imports.append(text)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            head = "".join(f"@{ast.get_source_segment(code, d)}\n" for d in node.decorator_list)
            kind = "class" if isinstance(node, ast.ClassDef) else "def"
            defs[node.name] = _Def(node.name, head + text, index, kind)
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        defs[name.id] = _Def(name.id, "", index, "data")
    return magics


def _ddp_options(line: str):
    return ddp_cell.parser.parse_args(shlex.split(line))


def _needed(names: set[str], defs: dict) -> list[_Def]:
    """The definitions ``names`` need, with what those need, in notebook order."""
    seen: dict[str, _Def] = {}
    todo = [n for n in names if n in defs]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen[name] = d = defs[name]
        if d.source:
            todo += [n for n in globals_read(d.source) if n in defs and n not in seen]
    return sorted(seen.values(), key=lambda d: d.cell)


def export(
    cells: list[str], nproc: int | None = None, source: str = "a notebook", target: str = "train.py"
) -> Exported:
    """The script ``target`` for ``cells`` (the notebook's code cells, in order)."""
    defs: dict[str, _Def] = {}
    imports: list[str] = []
    body: list[str] = []
    needed: set[str] = set()
    on_ranks = set(RANK_NAMES)  # names the ranks bound themselves, so far
    sizes = []
    for index, cell in enumerate(cells, 1):
        first, _, rest = cell.partition("\n")
        if not first.startswith("%%ddp"):
            for magic in _notebook_cell(cell, index, defs, imports):
                if "%ddp pull" in magic or "%ddp push" in magic:
                    body.append(f"# (notebook) {magic}")
            continue
        opts = _ddp_options(first[len("%%ddp") :])
        if opts.n:
            sizes.append(opts.n)
        stmts = [part.strip() for part in re.split(r"[;\n]", opts.imports) if part.strip()]
        code = "\n".join([*stmts, rest]) if stmts else rest
        try:
            read = globals_read(code)
        except SyntaxError as exc:
            body.append(f"# ---- cell {index}: not exported, a syntax error: {exc}")
            continue
        wanted = set(" ".join(opts.need).replace(",", " ").split())
        if not opts.no_auto:
            wanted |= read - on_ranks
        needed |= wanted
        on_ranks |= {n for n in _bound(code)}
        body.append(f"# ---- cell {index}: {first.strip()}")
        if opts.ranks:
            chosen = tuple(parse_ranks(opts.ranks))
            code = f"if rank in {chosen}:\n" + textwrap.indent(code or "pass", "    ")
        body.append(code.rstrip())
        if opts.out:
            body.append(f"# --out {opts.out}: each rank's last value went to the notebook")
    nproc = nproc or (sizes[-1] if sizes else 2)
    return _assemble(source, target, nproc, imports, _needed(needed, defs), body)


def _bound(code: str) -> set[str]:
    table = symtable.symtable(code, "<export>", "exec")
    return {s.get_name() for s in table.get_symbols() if s.is_assigned() or s.is_imported()}


def _assemble(source, target, nproc, imports, needed: list[_Def], body: list[str]) -> Exported:
    data = [d for d in needed if d.kind == "data"]
    notes = [
        f"not exported: {d.name} (data from notebook cell {d.cell}; define it in the script)"
        for d in data
    ]
    parts = [
        f'"""Exported by nbddp from {source}: its %%ddp cells as one torchrun script.\n\n'
        f"Run: torchrun --nproc-per-node {nproc} {target}\n"
        '"""\n',
        SETUP,
    ]
    if imports:
        parts.append("# from the notebook: its imports\n" + "\n".join(imports) + "\n")
    code_defs = [d for d in needed if d.kind != "data"]
    if code_defs:
        parts.append(
            "# from the notebook: what the cells use\n"
            + "\n\n\n".join(d.source for d in code_defs)
            + "\n"
        )
    for d in data:
        parts.append(
            f"# nbddp export: {d.name} came from the notebook (cell {d.cell}): define it here\n"
        )
    parts.append("\n".join(body) + "\n\ndist.destroy_process_group()\n")
    return Exported("\n\n".join(parts), nproc, notes)


def check_target(path: str | Path, force: bool = False) -> None:
    """Refuse (ValueError) to write the script over a notebook, ever, or over an existing
    file without ``force``."""
    if Path(path).suffix.lower() == ".ipynb":
        raise ValueError(f"{path} is a notebook: the script is never written over a .ipynb")
    if os.path.lexists(path) and not force:
        raise ValueError(f"{path} exists: --force writes over it")


def export_notebook(
    path: str | Path, nproc: int | None = None, target: str = "train.py"
) -> Exported:
    """:func:`export` of a saved notebook's code cells (read as the JSON it is)."""
    with open(path, encoding="utf-8") as f:
        nb = json.load(f)
    cells = [
        "".join(c["source"]) if isinstance(c["source"], list) else c["source"]
        for c in nb.get("cells", [])
        if c.get("cell_type") == "code"
    ]
    return export(cells, nproc, source=Path(path).name, target=target)
