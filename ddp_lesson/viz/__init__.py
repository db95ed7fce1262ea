"""Matplotlib figures used by the notebooks, one module per lesson; each figure function returns
a ``matplotlib.figure.Figure``.

Import a figure from its lesson's module, e.g. ``from ddp_lesson.viz.sampler import
sampler_heatmap``; this package re-exports nothing, so the import names where the code lives.

* :mod:`~ddp_lesson.viz.style`: the shared style (``subplots``, ``finish``, sizes in points);
* :mod:`~ddp_lesson.viz.torchrun`: what torchrun starts (notebook 00);
* :mod:`~ddp_lesson.viz.gradients`: per-rank gradients (notebook 01);
* :mod:`~ddp_lesson.viz.sampler`: the sampler's layout and figures (notebook 02);
* :mod:`~ddp_lesson.viz.collectives`: ring states, bandwidth, cost model (notebook 03);
* :mod:`~ddp_lesson.viz.ddp`: step timelines, bucket sweep, benchmark, torch's Reducer
  (notebook 04);
* :mod:`~ddp_lesson.viz.training`: loss curves, masks, the scaling study (notebook 06);
* :mod:`~ddp_lesson.viz.memory`: memory and data movement per rank (notebook 08).

Figures are drawn with pyplot (so a notebook cell ends with ``plt.show()`` and the image is
stored as a small PNG); a caller that only wants the picture (a widget, a test) closes the
figure with ``plt.close(fig)``. matplotlib is imported inside the functions, so importing a
module of this package costs nothing.
"""
