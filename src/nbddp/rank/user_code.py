"""Running the user's code in a rank, and its errors as data (pure helpers).

A cell runs under a filename starting with :data:`~nbddp.wire.stacks.CELL_PREFIX`, so
its tracebacks, stacks and pdb show the cell's own lines; a torchrun script runs
as ``__main__`` under its own path. Functions and classes shipped from the
notebook are rebuilt over the rank's namespace (:func:`adopt`).
"""

from __future__ import annotations

import ast
import bdb
import builtins
import linecache
import os
import sys
import time
import traceback
import types

import torch

from ..wire import protocol as P
from ..wire import stacks as S

__all__ = ["OUT_OF_MEMORY", "adopt", "error_info", "run_code", "run_script", "unwrap"]

CELL_PREFIX = S.CELL_PREFIX
_LAST_VALUE = "__nbddp_last_value__"
OUT_OF_MEMORY = (MemoryError, getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError))


def run_code(code: str, filename: str, namespace: dict) -> object:
    """Run ``code`` in ``namespace``; return the value of a final expression, else None."""
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
    tree = ast.parse(code, filename)
    last = tree.body[-1] if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    if last is not None:  # kept in the same code object, so pdb's `n` steps onto it
        store = ast.Assign([ast.Name(_LAST_VALUE, ast.Store())], last.value)
        tree.body[-1] = ast.fix_missing_locations(ast.copy_location(store, last))
    namespace.pop(_LAST_VALUE, None)
    exec(compile(tree, filename, "exec"), namespace)
    return namespace.pop(_LAST_VALUE, None)


def error_info(exc: BaseException, entry: str | None = None) -> P.ErrorInfo:
    """The exception as data, its traceback cut to the frames of the user's code.

    The user's code starts at a cell's frame, or at the script file ``entry``.
    """
    tb = exc.__traceback__
    while tb is not None and not _users(tb.tb_frame.f_code.co_filename, entry):
        tb = tb.tb_next
    message = _message(exc)
    try:
        text = "".join(traceback.format_exception(type(exc), exc, tb))
    except Exception:
        text = f"{type(exc).__qualname__}: {message}\n"
    where = S.frames_of(None) if tb is None else _traceback_frames(tb)
    return P.ErrorInfo(
        type(exc).__qualname__, message, text, time.time(), S.collective(where) or ""
    )


def _users(filename: str, entry: str | None) -> bool:
    return filename.startswith(CELL_PREFIX) or filename == entry


def _message(exc: BaseException) -> str:
    try:
        message = str(exc)
    except Exception as err:  # an exception whose __str__ fails still gets reported
        message = f"<str() of the exception failed: {type(err).__name__}: {err}>"
    if isinstance(exc, bdb.BdbQuit) and not message:
        message = "quit from the debugger"
    return message


def _traceback_frames(tb: types.TracebackType) -> tuple[S.Frame, ...]:
    return tuple(
        (f.filename, f.lineno or 0, f.name, "") for f in traceback.extract_tb(tb, limit=50)
    )


def run_script(script: P.Script, namespace: dict) -> None:
    """Run a torchrun script as ``__main__`` in a module of its own, ``sys.argv`` set.

    ``sys.exit(0)`` (or ``None``) ends it as a success, as under torchrun. With
    ``keep``, its globals join ``namespace`` afterwards, even when it failed.
    """
    path = os.path.abspath(script.path)
    module = types.ModuleType("__main__")
    module.__dict__.update(__file__=path, __builtins__=builtins, __cached__=None)
    linecache.cache[path] = (len(script.source), None, script.source.splitlines(True), path)
    saved = sys.argv, sys.modules["__main__"], list(sys.path)
    sys.argv, sys.modules["__main__"] = [path, *script.argv], module
    sys.path.insert(0, os.path.dirname(path))  # as python does for a script
    try:
        exec(compile(script.source, path, "exec"), module.__dict__)
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise
    finally:
        sys.argv, sys.modules["__main__"], sys.path[:] = saved
        if script.keep:
            namespace.update((k, v) for k, v in module.__dict__.items() if not k.startswith("__"))


def adopt(obj: object, namespace: dict) -> object:
    """Make a function or class shipped from the notebook resolve its globals in ``namespace``.

    cloudpickle rebuilds notebook functions with a private globals dict; here
    they are rebuilt over the rank's namespace, so ``--imports`` and the
    rank's own state are visible to them. Names only the private dict holds
    are added to the namespace, never overwriting the rank's own.
    """
    if isinstance(obj, types.FunctionType) and obj.__globals__ is not namespace:
        return _adopt_function(obj, namespace)
    if isinstance(obj, type) and obj.__module__ == "__main__":
        for name, member in list(vars(obj).items()):
            if isinstance(member, types.FunctionType):
                setattr(obj, name, adopt(member, namespace))
    return obj


def _adopt_function(obj: types.FunctionType, namespace: dict) -> types.FunctionType:
    for name, value in obj.__globals__.items():
        if not name.startswith("__"):
            namespace.setdefault(name, value)
    fn = types.FunctionType(
        obj.__code__, namespace, obj.__name__, obj.__defaults__, obj.__closure__
    )
    fn.__kwdefaults__ = obj.__kwdefaults__
    fn.__dict__.update(obj.__dict__)
    fn.__qualname__, fn.__doc__ = obj.__qualname__, obj.__doc__
    fn.__module__, fn.__annotations__ = obj.__module__, obj.__annotations__
    return fn


def unwrap(value: object) -> object:
    """A model trained under DDP comes back as the plain module it wraps."""
    ddp = sys.modules.get("torch.nn.parallel")
    if ddp is not None and isinstance(value, ddp.DistributedDataParallel):
        return value.module
    return value
