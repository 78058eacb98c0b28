"""Rich output from a rank: ``display(obj)``, matplotlib figures, progress bars.

Inside a worker these send :class:`~nbddp.wire.protocol.Display` and
:class:`~nbddp.wire.protocol.Progress` messages to the notebook (only on the ranks
the cell displays from, rank 0 by default); anywhere else ``display`` is
IPython's and ``progress`` just iterates.
"""

from __future__ import annotations

import base64
import io
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

from ..wire import protocol as P

__all__ = ["display", "progress", "rich_bundle"]

T = TypeVar("T")

# set by the worker: where messages go, and whether this rank displays in this cell
_send: Callable[[object], None] | None = None
_displaying = False
_RICH_REPRS = (
    "_repr_html_",
    "_repr_png_",
    "_repr_svg_",
    "_repr_jpeg_",
    "_repr_markdown_",
    "_repr_latex_",
    "_repr_mimebundle_",
)


def attach(send: Callable[[object], None]) -> None:
    """Called once by the worker: publish through ``send``; patch IPython's display."""
    global _send
    _send = send
    try:
        import IPython.core.display_functions as dfun
        import IPython.display as idisp
    except ImportError:
        return
    dfun.display = idisp.display = display


def set_displaying(on: bool) -> None:
    global _displaying
    _displaying = on


def _figure(obj: object):
    mpl_figure = sys.modules.get("matplotlib.figure")
    if mpl_figure is not None and isinstance(obj, mpl_figure.Figure):
        return obj
    return None


def rich_bundle(obj: object) -> tuple[dict, dict] | None:
    """The mime bundle of ``obj`` if it has more than a plain-text repr (figures as PNG)."""
    fig = _figure(obj)
    if fig is not None:
        buf = io.BytesIO()
        fig.savefig(buf, format="png", bbox_inches="tight")
        png = base64.b64encode(buf.getvalue()).decode()
        return {"image/png": png, "text/plain": repr(fig)}, {}
    if not any(hasattr(obj, name) for name in _RICH_REPRS):
        return None
    from IPython.core.formatters import DisplayFormatter

    data, metadata = DisplayFormatter().format(obj)
    data = {k: base64.b64encode(v).decode() if isinstance(v, bytes) else v for k, v in data.items()}
    return (data, metadata) if set(data) - {"text/plain"} else None


def display(*objs: object, raw: bool = False, metadata: dict | None = None, **kwargs) -> None:
    """IPython's ``display``, sent from a rank to the notebook."""
    if _send is None:
        from IPython.display import display as ipython_display

        ipython_display(*objs, raw=raw, metadata=metadata, **kwargs)
        return
    if not _displaying:
        return
    for obj in objs:
        if raw and isinstance(obj, dict):
            data, md = obj, metadata or {}
        else:
            data, md = rich_bundle(obj) or ({"text/plain": repr(obj)}, {})
        _send(P.Display(data, md))


def show_figures() -> None:
    """Publish every open matplotlib figure and close them (``plt.show()`` on a rank)."""
    pyplot = sys.modules.get("matplotlib.pyplot")
    if pyplot is None:
        return
    from matplotlib._pylab_helpers import Gcf

    for manager in Gcf.get_all_fig_managers():
        display(manager.canvas.figure)
    pyplot.close("all")


def progress(
    iterable: Iterable[T], total: int | None = None, desc: str = "", every: float = 0.1
) -> Iterator[T]:
    """Iterate, showing this rank's progress as a bar in its dashboard row."""
    if total is None:
        try:
            total = len(iterable)  # type: ignore[arg-type]
        except TypeError:
            total = None
    done, last = 0, 0.0
    send = _send
    for item in iterable:
        yield item
        done += 1
        now = time.monotonic()
        if send is not None and now - last >= every:
            last = now
            send(P.Progress(done, total, desc))
    if send is not None:
        send(P.Progress(done, total, desc))
