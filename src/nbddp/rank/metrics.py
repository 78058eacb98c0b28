"""``nbddp.log_metrics`` on a rank: numbers for the dashboard's charts, cheap every step.

A call appends to this rank's buffer (two ``array`` appends per metric, under a lock);
nothing is sent per call. A flusher thread sends what piled up as one
:class:`~nbddp.wire.protocol.Metrics` message at most every ``EVERY`` seconds, and the
cell's end flushes the rest before its ``Done``, so the notebook has every point of a
cell when the cell ends. Outside a worker (a plain script, the notebook itself) the call
checks its arguments and keeps nothing.
"""

from __future__ import annotations

import threading
import time
from array import array
from collections.abc import Callable, Mapping
from numbers import Real

from ..wire import protocol as P

__all__ = ["log_metrics"]

EVERY = 0.25  # seconds between two sends while points pile up

_send: Callable[[object], None] | None = None
_lock = threading.Lock()  # the buffer and the step counters
_sending = threading.Lock()  # one send at a time, so the cell's end waits for the flusher's
_pending: dict[str | None, dict[str, tuple[array, array]]] = {}  # run -> name -> points
_next_step: dict[str | None, int] = {}  # per run: the step a call without ``step`` gets


def log_metrics(
    metrics: Mapping[str, object], step: int | None = None, *, run: str | None = None
) -> None:
    """Record ``metrics`` (name -> number) at ``step`` for this rank's charts.

    ``step`` defaults to one more than this run's last step (0 first). ``run`` names a
    run that goes on across cells: every cell logging ``run="train"`` continues the same
    charts; without it, each cell draws charts of its own. A number is a Python or numpy
    number, or a one-element tensor (not a string).
    """
    if type(metrics) is not dict and not isinstance(metrics, Mapping):
        raise TypeError(f"log_metrics takes a dict of name -> number, not {type(metrics).__name__}")
    if run is not None and type(run) is not str:
        raise TypeError(f"log_metrics: run is a name (a str), not {type(run).__name__}")
    with _lock:  # (about 0.9 us a call with two metrics: every step can afford it)
        if step is None:
            step = _next_step.get(run, 0)
        elif type(step) is not int:
            step = _int_step(step)
        _next_step[run] = step + 1
        if _send is None:  # not on a rank: check as a rank would, keep nothing
            for name, value in metrics.items():
                _number(name, value)
                if type(name) is not str:
                    raise TypeError(f"log_metrics: a metric's name is a str, not {name!r}")
            return
        names = _pending.get(run)
        if names is None:
            names = _pending[run] = {}
        for name, value in metrics.items():
            if type(value) is not float:
                value = _number(name, value)
            series = names.get(name)
            if series is None:
                if type(name) is not str:
                    raise TypeError(f"log_metrics: a metric's name is a str, not {name!r}")
                series = names[name] = (array("q"), array("d"))
            series[1].append(value)  # the value first: a bad one leaves no step behind
            series[0].append(step)


def _number(name: object, value: object) -> float:
    if isinstance(value, (str, bytes)) or not (isinstance(value, Real) or hasattr(value, "item")):
        raise TypeError(f"log_metrics: {name!r} is not a number ({type(value).__name__})")
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, RuntimeError) as exc:
        raise TypeError(f"log_metrics: {name!r} is not one number: {exc}") from None


def _int_step(step: object) -> int:
    try:
        return int(step.__index__())  # type: ignore[attr-defined]
    except (AttributeError, TypeError):
        raise TypeError(f"log_metrics: step is a whole number, not {step!r}") from None


# ---------------------------------------------------------------- in a worker


def attach(send: Callable[[object], None]) -> None:
    """Called once by the worker: send through ``send``, from a flusher thread."""
    global _send
    _send = send
    threading.Thread(target=_flusher, name="nbddp-metrics", daemon=True).start()


def new_cell() -> None:
    """A cell begins: calls without a run start at step 0 again."""
    with _lock:
        _next_step.pop(None, None)


def flush() -> None:
    """Send every point logged so far (the cell's end, before its Done)."""
    with _sending:
        with _lock:
            if not _pending:
                return
            batch = dict(_pending)
            _pending.clear()
        series = tuple(
            (run, name, steps.tobytes(), values.tobytes())
            for run, names in batch.items()
            for name, (steps, values) in names.items()
        )
        if _send is not None:
            try:
                _send(P.Metrics(series))
            except (OSError, EOFError):
                pass  # the notebook is gone: the rank ends with it


def _flusher() -> None:
    while True:
        time.sleep(EVERY)
        if _pending:
            flush()
