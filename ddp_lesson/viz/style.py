"""One style for every figure of the series: resolution, minimum width, font sizes.

Every figure function of :mod:`ddp_lesson.viz` starts with :func:`subplots` and ends with
:func:`finish`, so a figure is at least 720 px wide at 100% zoom and no text is under 9 pt.
matplotlib is imported inside the functions, so importing this module costs nothing.
"""
from __future__ import annotations

__all__ = ["DPI", "MIN_WIDTH_IN", "SMALL_PT", "LABEL_PT", "TITLE_PT", "subplots", "finish"]


#: Every figure is drawn at this resolution (dots per inch) ...
DPI = 100
#: ... and at least this wide (inches): 7.2 in x 100 dpi = 720 px, readable at 100% zoom.
MIN_WIDTH_IN = 7.2
#: The smallest text in any figure (points): tick labels, legends, annotations.
SMALL_PT = 9
#: Axis labels and panel titles.
LABEL_PT = 10
#: Figure titles.
TITLE_PT = 11


def subplots(nrows: int = 1, ncols: int = 1, figsize=(MIN_WIDTH_IN, 3.2), **kwargs):
    """``plt.subplots`` in the series' style: :data:`DPI`, at least :data:`MIN_WIDTH_IN` wide
    (a narrower ``figsize`` is scaled up, keeping its aspect), default font :data:`LABEL_PT`.
    """
    import matplotlib.pyplot as plt

    w, h = figsize
    if w < MIN_WIDTH_IN:
        w, h = MIN_WIDTH_IN, h * MIN_WIDTH_IN / w
    with plt.rc_context({"font.size": LABEL_PT, "axes.titlesize": LABEL_PT,
                         "axes.labelsize": LABEL_PT, "xtick.labelsize": SMALL_PT,
                         "ytick.labelsize": SMALL_PT, "legend.fontsize": SMALL_PT}):
        return plt.subplots(nrows, ncols, figsize=(w, h), dpi=DPI, **kwargs)


def finish(fig, rect=None):
    """Raise any text below :data:`SMALL_PT` to it (a label set elsewhere at a smaller size),
    then lay the figure out (``tight_layout``, within ``rect`` if given). Returns ``fig``."""
    from matplotlib.text import Text

    for text in fig.findobj(Text):
        if text.get_text() and text.get_fontsize() < SMALL_PT:
            text.set_fontsize(SMALL_PT)
    fig.tight_layout(**({"rect": rect} if rect else {}))
    return fig
