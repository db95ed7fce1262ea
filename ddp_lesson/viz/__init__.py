"""Matplotlib figures for the notebooks, one module per lesson; each figure function returns a
``matplotlib.figure.Figure``. This package re-exports nothing: import from the lesson's
module (``from ddp_lesson.viz.sampler import sampler_heatmap``).

:mod:`~ddp_lesson.viz.style` (the shared style), ``torchrun`` (notebook 00), ``gradients``
(01), ``sampler`` (02), ``collectives`` (03), ``ddp`` (04), ``training`` (06), ``memory`` (08).

Figures are drawn with pyplot (a cell ends with ``plt.show()``; a caller that only wants the
picture closes it with ``plt.close(fig)``); matplotlib is imported inside the functions.
"""
