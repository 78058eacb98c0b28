"""The dashboard's widget and its display in the notebook: one anywidget per cell
(drawn by ``dashboard.js``), and a display that does not wait on the kernel's
output thread for nothing."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

from .theme import LIVE_CSS

__all__ = ["flush_only_pending", "new_widget"]

_WIDGET_CLASS = None
_LAYOUT = None


def new_widget(**state):
    """One anywidget (one comm) per cell; every dashboard shares a single layout model."""
    global _WIDGET_CLASS, _LAYOUT
    if _WIDGET_CLASS is None:
        import ipywidgets

        _WIDGET_CLASS, _LAYOUT = _widget_class(), ipywidgets.Layout()
    return _WIDGET_CLASS(layout=_LAYOUT, **state)


def _widget_class():
    import anywidget
    import ipywidgets
    import traitlets as t

    class DashboardWidget(anywidget.AnyWidget):
        # declared on the class, not added per instance as AnyWidget.__init__ does
        # (add_traits makes a class for every widget: 1.7 ms a cell, measured)
        _esm = t.Unicode(Path(__file__).with_name("dashboard.js").read_text()).tag(sync=True)
        _css = t.Unicode(LIVE_CSS).tag(sync=True)  # nbddp.dashboard.theme: colours from the theme's
        _anywidget_id = t.Unicode("nbddp.dashboard.view.DashboardWidget").tag(sync=True)
        ranks = t.List(t.Int()).tag(sync=True)
        header = t.Unicode().tag(sync=True)
        rows = t.Unicode().tag(sync=True)
        lines = t.List().tag(sync=True)  # [rank set, stream, text, values], the live tail
        hidden = t.Int().tag(sync=True)  # lines before that tail
        bars = t.List().tag(sync=True)  # the tqdm bars running, folded: as ``lines``
        charts = t.Unicode().tag(sync=True)  # the metric charts, inline SVG
        focus = t.Int(-1).tag(sync=True)  # the rank whose log opens (the first failure)

        def __init__(self, **kwargs) -> None:
            if _in_colab():
                from google.colab import output

                output.enable_custom_widget_manager()
            ipywidgets.DOMWidget.__init__(self, **kwargs)

    return DashboardWidget


@contextlib.contextmanager
def flush_only_pending():
    """Display without waiting on the kernel's output thread when nothing is printed.

    ipykernel flushes stdout and stderr before every display message (so printed
    text stays before it), and each flush waits for its I/O thread: about 0.7 ms a
    stream on this machine, 3 ms a cell. A stream with no write pending since its
    last flush has nothing to put first, so only streams with pending output are
    flushed here.
    """
    from IPython import get_ipython

    pub = getattr(get_ipython(), "display_pub", None)
    if pub is None or "_flush_streams" not in type(pub).__dict__:
        yield
        return

    def flush_pending() -> None:
        for stream in (sys.stdout, sys.stderr):
            if getattr(stream, "_flush_pending", True):
                stream.flush()

    pub._flush_streams = flush_pending
    try:
        yield
    finally:
        del pub._flush_streams


def _in_colab() -> bool:
    return "google.colab" in sys.modules
