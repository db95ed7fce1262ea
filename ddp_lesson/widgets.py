"""ipywidgets explorers for the notebooks.

Each explorer is an ipywidgets container that builds without a display (a test, a plain
Python process): its controls are ordinary widget traits that code can set, and ``.text`` holds
what it shows as plain text. Its text form (what nbval compares, and what a stored notebook
shows without its kernel) is fixed by the initial settings. ipywidgets and matplotlib are
imported when an explorer is built, not at import.

Explorers: :func:`sampler_explorer` (notebook 02); :func:`ring_allreduce_stepper` (notebook 03);
:func:`shard_calculator` (notebook 08's deep dive); :func:`roofline_calculator` (notebook 09).
"""
from __future__ import annotations

import functools
import html

__all__ = ["sampler_report", "sampler_explorer", "ring_allreduce_stepper",
           "roofline_calculator", "shard_calculator"]


@functools.cache
def _text_form():
    """The explorers' base: an ``ipywidgets.VBox`` whose text form is ``self.header()`` and
    ``self.text`` (not the Python repr)."""
    import ipywidgets as W

    class TextForm(W.VBox):
        def _repr_mimebundle_(self, **kwargs):
            bundle = super()._repr_mimebundle_(**kwargs)
            bundle["text/plain"] = self.header() + "\n" + self.text
            return bundle

    return TextForm


def _pre(text: str) -> str:
    return f"<pre>{html.escape(text)}</pre>"


# =========================================================================== sampler explorer

def _fmt(indices, marks=None) -> str:
    if marks is None:
        return "[" + ", ".join(str(i) for i in indices) + "]"
    return "[" + ", ".join(f"{i}*" if m else str(i) for i, m in zip(indices, marks)) + "]"


def sampler_report(n: int, world_size: int, epoch: int = 0, seed: int = 0,
                   shuffle: bool = False, drop_last: bool = False,
                   call_set_epoch: bool = True) -> str:
    """What every rank's ``DistributedSampler`` yields in one epoch, as plain text.

    ``epoch`` is the loop's epoch; the sampler sees it only when ``call_set_epoch`` (else it
    keeps epoch 0, case A1). Padded repeats are marked ``*``. Pure: no process group.

    Args:
        n: dataset length N, ``>= 0``.
        world_size: number of ranks R (``num_replicas``), ``>= 1``.
        epoch, seed, shuffle, drop_last: the loop's epoch and the sampler's settings.
        call_set_epoch: whether the loop calls ``sampler.set_epoch(epoch)``.

    Returns:
        Lines: the settings, how ``num_samples`` is computed, where the order comes from,
        ``rank r: [...]`` for every rank, the padded repeats and the dropped indices.

    Raises:
        ValueError: ``n < 0`` or ``world_size < 1``.
    """
    from .viz.sampler import sampler_layout

    sampler_epoch = epoch if call_set_epoch else 0
    lay = sampler_layout(n, world_size, shuffle, seed, sampler_epoch, drop_last)
    R, k = world_size, lay.num_samples
    lines = [f"N={n}, world size R={R}, shuffle={shuffle}, drop_last={drop_last}, "
             f"seed={seed}, epoch={epoch}, set_epoch called: {call_set_epoch}"]
    if n % R == 0:
        how = f"N / R = {n} / {R} = {k}"
    elif drop_last:
        how = f"ceil((N - R) / R) = ceil(({n} - {R}) / {R}) = {k}  (drop_last)"
    else:
        how = f"ceil(N / R) = ceil({n} / {R}) = {k}"
    lines.append(f"num_samples per rank: {how}; total_size = {lay.total_size}")
    if not shuffle:
        lines.append("order: 0..N-1 (shuffle=False: seed and epoch change nothing)")
    elif call_set_epoch:
        lines.append(f"order: permutation seeded with seed + epoch = {seed} + {epoch} "
                     f"= {seed + epoch}")
    else:
        lines.append(f"order: permutation seeded with seed + epoch = {seed} + 0 = {seed} "
                     f"(set_epoch never called: the sampler's epoch stays 0, "
                     f"whatever the loop's epoch)")
    for r in range(R):
        lines.append(f"rank {r}: {_fmt(lay.shards[r], lay.is_padding[r])}")
    lines.append(f"padding (* = a repeat: seen more than once this epoch): {_fmt(lay.padding)}"
                 if lay.padding else "padding: none")
    lines.append(f"dropped (not seen this epoch): {_fmt(sorted(lay.dropped))}"
                 if lay.dropped else "dropped: none")
    if k == 0 and n > 0:
        lines.append("every rank gets 0 samples: an epoch runs zero steps")
    return "\n".join(lines)


def _heatmap_png(v: dict) -> bytes:
    """The heatmap for the settings ``v`` (as ``SamplerExplorer.values()``) as PNG bytes; the
    sampler sees the loop's epoch only when ``set_epoch`` is called."""
    import io

    import matplotlib.pyplot as plt

    from .viz.sampler import sampler_heatmap

    epoch = v["epoch"] if v["call_set_epoch"] else 0
    fig = sampler_heatmap(v["n"], v["world_size"], v["shuffle"], v["seed"], epoch,
                          v["drop_last"])
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80)
    plt.close(fig)
    return buf.getvalue()


_CONTROLS = ("n", "world_size", "epoch", "seed", "shuffle", "drop_last", "call_set_epoch")


@functools.cache
def _explorer_class():
    import ipywidgets as W

    class SamplerExplorer(_text_form()):
        """:func:`sampler_explorer`'s widget. Controls (set ``.value``): ``n``, ``world_size``,
        ``epoch``, ``seed``, ``shuffle``, ``drop_last``, ``call_set_epoch``. Views: ``image`` (the
        heatmap PNG, when ``show_figure``), ``report`` (HTML), ``text``. ``set(**values)`` changes
        several controls with one redraw; ``redraws`` counts redraws.
        """

        def __init__(self, initial: dict, show_figure, max_n, max_world_size, max_epoch):
            style = {"description_width": "90px"}
            for name, desc, lo, hi in (("n", "N (samples)", 0, max_n),
                                       ("world_size", "world size", 1, max_world_size),
                                       ("epoch", "epoch", 0, max_epoch), ("seed", "seed", 0, 99)):
                if not lo <= initial[name] <= hi:
                    raise ValueError(f"{name}={initial[name]} is outside the slider range "
                                     f"[{lo}, {hi}]")
                setattr(self, name, W.IntSlider(value=initial[name], min=lo, max=hi,
                                                description=desc, style=style))
            for name, desc in (("shuffle", "shuffle"), ("drop_last", "drop_last"),
                               ("call_set_epoch", "call set_epoch")):
                setattr(self, name, W.Checkbox(value=initial[name], description=desc))
            self.image = W.Image(format="png") if show_figure else None
            self.report = W.HTML()
            self.text = ""
            self.redraws = 0
            self._hold = False
            sliders = W.VBox([self.n, self.world_size, self.epoch, self.seed])
            toggles = W.VBox([self.shuffle, self.drop_last, self.call_set_epoch])
            views = [self.image] if self.image is not None else []
            super().__init__(children=[W.HBox([sliders, toggles]), *views, self.report])
            for name in _CONTROLS:
                getattr(self, name).observe(self._on_change, names="value")
            self.refresh()

        def values(self) -> dict:
            """The current settings, by control name."""
            return {name: getattr(self, name).value for name in _CONTROLS}

        def set(self, **values) -> None:
            """Set several controls at once (names as :meth:`values`), then redraw once."""
            unknown = set(values) - set(_CONTROLS)
            if unknown:
                raise TypeError(f"unknown control(s) {sorted(unknown)}; "
                                f"controls are {list(_CONTROLS)}")
            self._hold = True
            try:
                for name, value in values.items():
                    getattr(self, name).value = value
            finally:
                self._hold = False
            self.refresh()

        def _on_change(self, change) -> None:
            if not self._hold:
                self.refresh()

        def refresh(self) -> None:
            """Recompute the text and redraw the heatmap from the controls."""
            v = self.values()
            self.text = sampler_report(**v)
            self.report.value = _pre(self.text)
            if self.image is not None:
                self.image.value = _heatmap_png(v)
            self.redraws += 1

        def __repr__(self) -> str:
            v = self.values()
            return (f"SamplerExplorer(N={v['n']}, world_size={v['world_size']}, "
                    f"epoch={v['epoch']}, seed={v['seed']}, shuffle={v['shuffle']}, "
                    f"drop_last={v['drop_last']}, set_epoch={v['call_set_epoch']})")

        def header(self) -> str:
            return "sampler explorer (run the notebook to move its sliders)"

    return SamplerExplorer


def sampler_explorer(n: int = 10, world_size: int = 3, epoch: int = 0, seed: int = 0,
                     shuffle: bool = False, drop_last: bool = False,
                     call_set_epoch: bool = True, show_figure: bool = True,
                     max_n: int = 40, max_world_size: int = 8, max_epoch: int = 9):
    """An explorer of how ``DistributedSampler`` deals a dataset out to ranks.

    Sliders for N, world size, epoch and seed; toggles for shuffle, drop_last and "call
    set_epoch". Every change redraws the heatmap (:func:`ddp_lesson.viz.sampler.sampler_heatmap`)
    and the text of :func:`sampler_report`. Nothing communicates.

    Args:
        n, world_size, epoch, seed, shuffle, drop_last, call_set_epoch: initial settings.
        show_figure: draw the heatmap (off: text only, faster).
        max_n, max_world_size, max_epoch: slider ranges.

    Returns:
        A ``SamplerExplorer`` (an ``ipywidgets.VBox``): display it, or drive it
        (``explorer.n.value = 11``, ``explorer.set(shuffle=True, epoch=2)``) and read ``.text``.

    Raises:
        ValueError: an initial value outside its slider's range (named with the numbers).
    """
    initial = {"n": n, "world_size": world_size, "epoch": epoch, "seed": seed,
               "shuffle": shuffle, "drop_last": drop_last, "call_set_epoch": call_set_epoch}
    return _explorer_class()(initial, show_figure, max_n, max_world_size, max_epoch)


# ============================================================ ring all-reduce stepper (notebook 03)


@functools.cache
def _stepper_class():
    import ipywidgets as W

    class RingAllReduceStepper(_text_form()):
        """:func:`ring_allreduce_stepper`'s widget. Controls: ``world_size``, ``step``. Views:
        ``view`` (HTML table), ``text`` (:func:`ddp_lesson.viz.collectives.ring_state_text`);
        ``states``, the simulated states; ``state``, the one shown.
        """

        def __init__(self, world_size, step, values, max_world_size):
            from .collectives import simulate_ring_all_reduce

            self._values = values
            self._values_world_size = world_size if values is not None else None
            self.states = simulate_ring_all_reduce(world_size, values)
            style = {"description_width": "80px"}
            self.world_size = W.IntSlider(value=world_size, min=1, max=max_world_size,
                                          description="world size", style=style)
            self.step = W.IntSlider(value=step, min=0, max=len(self.states) - 1,
                                    description="step", style=style)
            self.view = W.HTML()
            self.text = ""
            super().__init__(children=[W.HBox([self.world_size, self.step]), self.view])
            self.world_size.observe(self._on_world_size, names="value")
            self.step.observe(lambda change: self.refresh(), names="value")
            self.refresh()

        @property
        def state(self):
            """The :class:`~ddp_lesson.collectives.RingState` on show."""
            return self.states[self.step.value]

        def _on_world_size(self, change) -> None:
            from .collectives import simulate_ring_all_reduce

            R = change["new"]
            values = self._values if R == self._values_world_size else None
            self.states = simulate_ring_all_reduce(R, values)
            self.step.value = min(self.step.value, len(self.states) - 1)
            self.step.max = len(self.states) - 1
            self.refresh()

        def refresh(self) -> None:
            """Redraw the table and the text for the current step."""
            from .viz.collectives import ring_state_html, ring_state_text

            self.text = ring_state_text(self.state)
            self.view.value = ring_state_html(self.state)

        def __repr__(self) -> str:
            return (f"RingAllReduceStepper(world_size={self.world_size.value}, "
                    f"step={self.step.value} of {len(self.states) - 1})")

        def header(self) -> str:
            return (f"ring all-reduce stepper, world size {self.world_size.value} (run the "
                    f"notebook to move its sliders)")

    return RingAllReduceStepper


def ring_allreduce_stepper(world_size: int = 3, step: int = 0, values=None,
                           max_world_size: int = 6):
    """A step-by-step picture of the ring all-reduce (reduce-scatter, then all-gather).

    Every rank's chunks after each of the 2(R-1) steps: which chunk moved where, what each rank
    holds, which ranks' inputs it sums. The states are
    :func:`ddp_lesson.collectives.simulate_ring_all_reduce`'s, on the schedule
    :func:`~ddp_lesson.collectives.ring_all_reduce` runs with real send/recv. Nothing
    communicates.

    Args:
        world_size: number of ranks R (1 .. max_world_size).
        step: initial step, 0 (inputs) .. 2(R-1) (done).
        values: ``values[rank]``, that rank's numbers (default: rank r holds
            ``[1, 2, ..., R] · 10^r``, so the sums read digit by digit: 111, 222, 333).
        max_world_size: the world-size slider's maximum.

    Returns:
        A ``RingAllReduceStepper`` (an ``ipywidgets.VBox``); drive it with
        ``stepper.step.value = 2`` and read ``stepper.text`` / ``stepper.state``.

    Raises:
        ValueError: ``world_size`` or ``step`` out of range (named with the numbers).
    """
    if not 1 <= world_size <= max_world_size:
        raise ValueError(f"world_size={world_size} is outside [1, {max_world_size}]")
    last = 2 * (world_size - 1)
    if not 0 <= step <= last:
        raise ValueError(f"step={step} is outside [0, {last}] for world_size {world_size}")
    return _stepper_class()(world_size, step, values, max_world_size)


# ================================================================ roofline calculator (notebook 09)


@functools.cache
def _roofline_class():
    import ipywidgets as W

    class RooflineCalculator(_text_form()):
        """:func:`roofline_calculator`'s widget; ``text`` is the report on show."""

        def __init__(self, model, inputs, hardware, batch_per_gpu, mfu, grad_bytes_per_param):
            from .cost_model import HARDWARE, flops_per_sample

            self._model, self._inputs = model, inputs
            # no control changes the model's FLOPs: counted once (a count runs its backward)
            self._flops = flops_per_sample(model, inputs) if inputs is not None else None
            style = {"description_width": "110px"}
            options = [(k, HARDWARE[k]) for k in sorted(HARDWARE)]
            if hardware not in HARDWARE.values():  # the learner's own Hardware(...)
                options.append(("custom", hardware))
            self.hardware = W.Dropdown(options=options, value=hardware, description="hardware",
                                       style=style)
            self.batch_per_gpu = W.IntSlider(value=batch_per_gpu, min=1, max=4096,
                                             description="batch per GPU", style=style)
            self.mfu = W.FloatSlider(value=mfu, min=0.05, max=1.0, step=0.05,
                                     description="share of peak", style=style)
            self.grad_bytes = W.Dropdown(options=[2, 4], value=grad_bytes_per_param,
                                         description="bytes per grad", style=style)
            self.view, self.text = W.HTML(), ""
            controls = [self.hardware, self.batch_per_gpu, self.mfu, self.grad_bytes]
            super().__init__(children=[*controls, self.view])
            for c in controls:
                c.observe(lambda change: self.refresh(), names="value")
            self.refresh()

        def refresh(self) -> None:
            """Recompute the report from the controls."""
            from .cost_model import roofline_report

            self.text = roofline_report(self._model, self.hardware.value,
                                        batch_per_gpu=self.batch_per_gpu.value,
                                        inputs=self._inputs, mfu=self.mfu.value,
                                        grad_bytes_per_param=self.grad_bytes.value,
                                        flops=self._flops)
            self.view.value = _pre(self.text)

        def header(self) -> str:
            return "roofline calculator (run the notebook to change it)"

    return RooflineCalculator


def roofline_calculator(model, inputs=None, hardware="h100", batch_per_gpu: int = 32,
                        mfu: float = 1.0, grad_bytes_per_param: int = 4):
    """An ipywidgets form over :func:`ddp_lesson.cost_model.roofline_report`: the compute-bound
    batch and predicted efficiency of ``model``.

    Args as ``roofline_report`` (``model``: an ``nn.Module`` with an example batch ``inputs``,
    or a parameter count; ``hardware``: a preset's key or your own ``Hardware(...)``, listed as
    "custom"). Nothing communicates; FLOPs are counted once, when it is built.

    Returns:
        A ``RooflineCalculator`` (``ipywidgets.VBox``) with controls ``hardware``,
        ``batch_per_gpu``, ``mfu``, ``grad_bytes``; read ``.text``.

    Raises:
        KeyError: an unknown hardware preset.
    """
    from .cost_model import hardware_preset

    return _roofline_class()(model, inputs, hardware_preset(hardware), batch_per_gpu, mfu,
                             grad_bytes_per_param)


# ====================================================== FSDP decision calculator (notebook 08)

def shard_calculator(params_billion: float = 7.5, activation_gb: float = 20.0,
                     world_size: int = 8, gpu_gb: float = 80.0):
    """Which ZeRO stage a model needs: :func:`ddp_lesson.memory.decision_lines` for the
    learner's own numbers (mixed-precision Adam; GB = 1e9 bytes; activations per rank).

    Returns an ``ipywidgets.VBox`` of four ``FloatText`` controls (``.children[0]``) and an
    ``HTML`` view; ``.text`` holds the lines, and the text form (a stored notebook) shows them.
    Negative sizes or fewer than one GPU show the memory functions' ``ValueError`` as text.
    """
    import ipywidgets as W

    from .memory import decision_lines

    names = ("params (billions)", "activations GB/rank", "GPUs", "GB per GPU")
    boxes = [W.FloatText(value=v, description=d, style={"description_width": "140px"})
             for v, d in zip((params_billion, activation_gb, world_size, gpu_gb), names)]

    class ShardCalculator(_text_form()):
        def refresh(self, change=None) -> None:
            psi, act, R, gpu = (b.value for b in boxes)
            try:
                self.text = "\n".join(decision_lines(psi * 1e9, act * 1e9, int(R), gpu * 1e9))
            except ValueError as exc:   # shown, not raised inside a widget callback
                self.text = f"cannot compute: {exc}"
            self.children[1].value = _pre(self.text)

        def __repr__(self) -> str:
            return "ShardCalculator(" + ", ".join(f"{b.value:g}" for b in boxes) + ")"

        def header(self) -> str:
            return "shard calculator (run the notebook to edit)"

    calc = ShardCalculator(children=[W.VBox(boxes), W.HTML()])
    calc.refresh()
    for b in boxes:
        b.observe(calc.refresh, names="value")
    return calc
