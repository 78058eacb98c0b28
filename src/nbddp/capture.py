"""From the notebook's names and import text to what the ranks receive.

Everything here runs before any rank does, so a missing name or an object
that cannot be pickled is reported (naming the variable and the reason) while
nothing has changed on the ranks.
"""

from __future__ import annotations

import ast
import re

import cloudpickle

from .errors import CaptureError

__all__ = ["check_imports", "collect", "pack", "parse_ranks", "split_names"]


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


def pack(objects: dict[str, object]) -> bytes | None:
    """cloudpickle the objects together; on failure, name the one that cannot go and why."""
    if not objects:
        return None
    try:
        return cloudpickle.dumps(objects)
    except Exception as whole:
        for name, obj in objects.items():
            try:
                cloudpickle.dumps(obj)
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
        tree = ast.parse(text, "<imports>")
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
