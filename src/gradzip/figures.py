"""Figures on matplotlib's Agg canvas, without ``pyplot``.

Every PNG gradzip writes (the trainer's loss curve, ``gradzip analyze``'s histograms,
``gradzip compare``'s report) is a ``matplotlib.figure.Figure`` on its own Agg canvas:
no display is needed, the caller's backend is never switched (a notebook that trains
or analyzes keeps its inline plots), and no figure outlives its function in
``pyplot``'s global registry.
"""

from __future__ import annotations

from typing import Any


def figure(width: float = 7.0, height: float = 4.5) -> tuple[Any, Any]:
    """A figure of ``width`` x ``height`` inches with one axes, on an Agg canvas."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()
