"""The matplotlib backend of a rank (``MPLBACKEND=module://nbddp.rank.mpl_backend``).

Agg drawing; ``plt.show()`` sends the figures to the notebook as PNG images
(from the ranks a cell displays from) and closes them.
"""

from __future__ import annotations

from matplotlib.backend_bases import FigureManagerBase
from matplotlib.backends.backend_agg import FigureCanvasAgg

from .rich import show_figures

FigureCanvas = FigureCanvasAgg
FigureManager = FigureManagerBase


def show(*args, **kwargs) -> None:
    show_figures()
