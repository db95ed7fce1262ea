"""The α-β cost model of collective communication, and what it predicts for DDP's buckets.

Sending a message of ``n`` bytes costs ``α + n β``: ``α`` the latency (seconds per message),
``β`` seconds per byte (one over the link's bandwidth). From it:

* an all-reduce's time naive (through rank 0), tree and ring, and the ring's bytes per rank;
* algorithm and bus bandwidth, as benchmarks report them, and a fit of α and β to timings;
* DDP's overlap on a serial link: when each bucket's all-reduce runs, how much is exposed;
* data parallelism's roofline on real hardware (:class:`Hardware`): FLOPs per sample counted
  by torch, the per-GPU batch above which backward hides the all-reduce, a step's predicted
  efficiency, and :func:`roofline_report`, the calculator for the learner's own model.

Pure arithmetic: nothing here needs a process group or communicates (but FLOP counting runs
the model once).

Sources
-------
* R. Thakur, R. Rabenseifner and W. Gropp, "Optimization of collective communication
  operations in MPICH", IJHPCA 19(1), 2005 — the α-β(-γ) cost model, tree and ring costs.
* P. Patarasuk and X. Yuan, "Bandwidth optimal all-reduce algorithms for clusters of
  workstations", J. Parallel Distrib. Comput. 69(2), 2009 — the ring is bandwidth-optimal.
* NVIDIA nccl-tests, doc/PERFORMANCE.md — algorithm bandwidth vs bus bandwidth,
  busbw = algbw · 2(R-1)/R for all-reduce.
* J. Austin et al., "How to Scale Your Model" (Google DeepMind, 2025), chapter "How to Think
  About GPUs" (https://jax-ml.github.io/scaling-book/gpus/), section "Rooflines for LLM
  Scaling on GPUs / Data Parallelism" — the compute vs
  all-reduce roofline, ``T_comms = max(in-node, across-node)``, per-GPU bandwidths 450e9 (NVLink)
  and 400e9 (node egress) for H100 nodes.
* J. Kaplan et al., "Scaling Laws for Neural Language Models", 2020, section 2.1 — about
  2 FLOPs per parameter per token forward, 4 backward (``C ≈ 6N``).
* The hardware constants: see :data:`HARDWARE`, each with its source.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .core.bucketed_ddp import ddp_buckets

__all__ = [
    "naive_allreduce_time", "tree_allreduce_time", "ring_allreduce_time",
    "ring_bytes_sent_per_rank", "bus_factor", "algbw", "busbw", "fit_alpha_beta",
    "predict_overlap", "model_ready_times", "predict_bucket_sweep",
    "Hardware", "HARDWARE", "flops_per_sample", "compute_bound_batch", "predict_step",
    "hardware_preset", "roofline_report",
]


# ----------------------------------------------------------------------------- all-reduce cost


def _check_cost_args(
    nbytes: float, world_size: int, alpha_s: float, beta_s_per_byte: float
) -> None:
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if alpha_s < 0 or beta_s_per_byte < 0:
        raise ValueError(
            f"alpha_s and beta_s_per_byte must be >= 0, got {alpha_s}, {beta_s_per_byte}"
        )


def naive_allreduce_time(nbytes: float, world_size: int, alpha_s: float,
                         beta_s_per_byte: float) -> float:
    """Seconds for gather-to-rank-0 + broadcast-from-rank-0 done as R-1 sends each way.

    ``T = 2 (R-1) (α + n β)``: rank 0's link carries every message, one after another.
    """
    _check_cost_args(nbytes, world_size, alpha_s, beta_s_per_byte)
    return 2 * (world_size - 1) * (alpha_s + nbytes * beta_s_per_byte)


def tree_allreduce_time(nbytes: float, world_size: int, alpha_s: float,
                        beta_s_per_byte: float) -> float:
    """Seconds for a binomial-tree reduce followed by a binomial-tree broadcast.

    ``T = 2 ⌈log2 R⌉ (α + n β)``: few messages (good for small n), but each carries the whole
    tensor (bad for large n). Thakur et al. (2005), section 4.
    """
    _check_cost_args(nbytes, world_size, alpha_s, beta_s_per_byte)
    rounds = math.ceil(math.log2(world_size)) if world_size > 1 else 0
    return 2 * rounds * (alpha_s + nbytes * beta_s_per_byte)


def ring_allreduce_time(nbytes: float, world_size: int, alpha_s: float,
                        beta_s_per_byte: float) -> float:
    """Seconds for the ring: ``T = 2 (R-1) α + 2 (R-1)/R · n β``.

    2(R-1) steps, each sending n/R bytes. The bandwidth term is at most ``2 n β`` for any R,
    the lower bound for all-reduce (Patarasuk & Yuan 2009); the latency term grows with R.
    """
    _check_cost_args(nbytes, world_size, alpha_s, beta_s_per_byte)
    return (
        2 * (world_size - 1) * alpha_s
        + 2 * (world_size - 1) / world_size * nbytes * beta_s_per_byte
    )


def ring_bytes_sent_per_rank(nbytes: float, world_size: int) -> float:
    """Bytes each rank sends in a ring all-reduce of ``nbytes``: ``2 (R-1)/R · n``."""
    return bus_factor(world_size) * nbytes


def bus_factor(world_size: int) -> float:
    """``2 (R-1) / R``: busbw / algbw for all-reduce (nccl-tests PERFORMANCE.md)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    return 2 * (world_size - 1) / world_size


def algbw(nbytes: float, seconds: float) -> float:
    """Algorithm bandwidth in bytes/s: the tensor's size over the time of one all-reduce."""
    if seconds <= 0:
        raise ValueError(f"seconds must be > 0, got {seconds}")
    return nbytes / seconds


def busbw(algbw_bytes_per_s: float, world_size: int) -> float:
    """Bus bandwidth in bytes/s, ``algbw · 2(R-1)/R`` (nccl-tests PERFORMANCE.md): what each
    rank's link moved in a bandwidth-optimal all-reduce, comparable with the link's speed."""
    return algbw_bytes_per_s * bus_factor(world_size)


def fit_alpha_beta(nbytes, seconds) -> tuple[float, float]:
    """Least-squares fit of ``seconds ≈ α + nbytes · β`` (relative errors, α clipped at 0).

    ``nbytes``: message sizes in bytes (two distinct at least); ``seconds``: one time each.
    Returns ``(alpha_s, beta_s_per_byte)``.

    Raises:
        ValueError: fewer than two distinct sizes or mismatched lengths.
    """
    xs, ts = [float(x) for x in nbytes], [float(t) for t in seconds]
    if len(xs) != len(ts) or len(set(xs)) < 2:
        raise ValueError("need at least two distinct message sizes, one time each")
    # weight each point by 1/t so small and large messages count alike (relative error)
    w = [1.0 / t for t in ts]
    sw = sum(wi * wi for wi in w)
    sx = sum(wi * wi * x for wi, x in zip(w, xs))
    sxx = sum(wi * wi * x * x for wi, x in zip(w, xs))
    st = sum(wi * wi * t for wi, t in zip(w, ts))
    sxt = sum(wi * wi * x * t for wi, x, t in zip(w, xs, ts))
    det = sw * sxx - sx * sx
    alpha = (sxx * st - sx * sxt) / det
    beta = (sw * sxt - sx * st) / det
    if alpha < 0:  # latency cannot be negative: refit the slope alone
        alpha, beta = 0.0, sxt / sxx
    return alpha, beta


# ----------------------------------------------------------------------------- DDP's buckets


def _check_link(latency_s: float, bandwidth_bytes_per_s: float) -> None:
    if latency_s < 0:
        raise ValueError(f"latency_s must be >= 0, got {latency_s}")
    if not bandwidth_bytes_per_s > 0:
        raise ValueError(f"bandwidth_bytes_per_s must be > 0, got {bandwidth_bytes_per_s}")


def predict_overlap(bucket_nbytes: Sequence[float], bucket_ready_s: Sequence[float],
                    backward_s: float, world_size: int, latency_s: float,
                    bandwidth_bytes_per_s: float, overlap: bool = True) -> dict:
    """When each bucket's all-reduce runs on a serial α-β link, and how much is exposed.

    Bucket ``i`` (``bucket_nbytes``, in launch order) starts at ``max(ready_i, end_{i-1})``
    (``overlap=False``: no earlier than ``backward_s``) and takes :func:`ring_allreduce_time`
    (what ``ddp_lesson.commsim.SimulatedLink`` charges); exposed: ``max(0, end_last -
    backward_s)``. ``bucket_ready_s``: seconds since backward began when each bucket's last
    gradient is ready; ``latency_s``, ``bandwidth_bytes_per_s``: α and 1/β.

    Returns:
        ``{"start": [...], "end": [...], "comm_s": total busy time of the link,
        "exposed_s": ..., "step_s": backward_s + exposed_s}``.

    Raises:
        ValueError: a negative latency or a non-positive bandwidth.
    """
    _check_link(latency_s, bandwidth_bytes_per_s)
    starts, ends, prev_end = [], [], 0.0
    for nbytes, ready in zip(bucket_nbytes, bucket_ready_s):
        start = max(ready if overlap else backward_s, prev_end)
        prev_end = start + ring_allreduce_time(nbytes, world_size, latency_s,
                                               1.0 / bandwidth_bytes_per_s)
        starts.append(start)
        ends.append(prev_end)
    exposed = max(0.0, (ends[-1] if ends else 0.0) - backward_s)
    return {"start": starts, "end": ends, "comm_s": sum(e - s for s, e in zip(starts, ends)),
            "exposed_s": exposed, "step_s": backward_s + exposed}


def model_ready_times(param_nbytes: Sequence[float], backward_s: float) -> list[float]:
    """A simple model of when backward produces each gradient: at a steady rate per byte.

    Gradients arrive in reverse registration order: parameter ``i`` (``param_nbytes``, in
    registration order) is ready once backward (``backward_s`` long) produced the bytes of
    ``i..P-1``. Returns each one's ready time. (Real layers cost parameters *times* feature-map
    size: early, high-resolution layers are slower; the notebook's measured timeline shows it.)
    """
    total = float(sum(param_nbytes)) or 1.0
    ready, done = [0.0] * len(param_nbytes), 0.0
    for i in reversed(range(len(param_nbytes))):
        done += param_nbytes[i]
        ready[i] = backward_s * done / total
    return ready


def predict_bucket_sweep(param_nbytes: Sequence[float], caps_mb: Sequence[float],
                         backward_s: float, world_size: int, latency_s: float,
                         bandwidth_bytes_per_s: float) -> list[dict]:
    """The cost model's exposed communication for each bucket cap (and for NaiveDDP).

    Buckets from :func:`~ddp_lesson.core.bucketed_ddp.ddp_buckets` (torch's after its rebuild,
    with the cap ``caps_mb`` MiB for every bucket) of ``param_nbytes`` (trainable parameters,
    registration order), ready times from :func:`model_ready_times`, the link schedule from
    :func:`predict_overlap` (the other arguments are its). Small buckets start early but pay α
    many times, big ones rarely but the last starts only when backward ends: the exposed time
    has a minimum in between.

    Returns:
        One dict per cap: ``{"cap_mb", "buckets", "exposed_s", "comm_s", "step_s"}``; and a
        last one with ``cap_mb=None`` for NaiveDDP (one message per parameter, after backward).
    """
    ready = model_ready_times(param_nbytes, backward_s)
    rows = []
    for cap in caps_mb:
        buckets = ddp_buckets(param_nbytes, cap)
        pred = predict_overlap([sum(param_nbytes[i] for i in b) for b in buckets],
                               [max(ready[i] for i in b) for b in buckets], backward_s,
                               world_size, latency_s, bandwidth_bytes_per_s)
        rows.append({"cap_mb": cap, "buckets": len(buckets), "exposed_s": pred["exposed_s"],
                     "comm_s": pred["comm_s"], "step_s": pred["step_s"]})
    naive = predict_overlap(list(param_nbytes), [backward_s] * len(param_nbytes), backward_s,
                            world_size, latency_s, bandwidth_bytes_per_s, overlap=False)
    rows.append({"cap_mb": None, "buckets": len(param_nbytes), "exposed_s": naive["exposed_s"],
                 "comm_s": naive["comm_s"], "step_s": naive["step_s"]})
    return rows


# ----------------------------------------------------------------------------- the roofline


@dataclass(frozen=True)
class Hardware:
    """A kind of GPU and its links, for a DDP step's roofline: one GPU's dense peak
    ``flops_per_s`` at the training precision, ``gpus_per_node`` joined by a link of
    ``gpu_bytes_per_s`` per GPU (NVLink, PCIe), ``node_bytes_per_s`` out of a node (all NICs; 0:
    one node), and the ``source``. Bandwidths in bytes/s per direction (the most nccl-tests' bus
    bandwidth can reach)."""

    name: str
    flops_per_s: float
    gpus_per_node: int
    gpu_bytes_per_s: float
    node_bytes_per_s: float
    source: str

    def allreduce_s(self, nbytes: float, world_size: int) -> float:
        """Seconds of an all-reduce of ``nbytes`` over ``world_size`` GPUs (bandwidth term).

        Inside a node, the ring: ``2(R-1)/R · n / W_gpu``. Across ``X`` nodes, hierarchical as in
        "How to Scale Your Model" (GPU chapter): ``max(2(G-1)/G · n / W_gpu,
        2(X-1)/X · n / W_node)``, G GPUs per node. Latency (α) is left out: it matters for
        small buckets, not for the bandwidth roofline.

        Raises:
            ValueError: ``world_size`` < 1, or more than one node where the preset has no
                network or a node is not full.
        """
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        g = min(world_size, self.gpus_per_node)
        t = bus_factor(g) * nbytes / self.gpu_bytes_per_s
        if world_size > g:
            nodes, rest = divmod(world_size, g)
            if rest or not self.node_bytes_per_s:
                raise ValueError(f"{world_size} GPUs do not fill whole nodes of {g} GPUs joined "
                                 f"by a network in {self.name!r}")
            t = max(t, bus_factor(nodes) * nbytes / self.node_bytes_per_s)
        return t


#: Presets. Sources (vendor data sheets; per direction = half the bidirectional figure):
#: H100 SXM data sheet (https://www.nvidia.com/en-us/data-center/h100/, the page the scaling
#: book cites): BF16 1,979 TFLOP/s "with sparsity", dense half = 989e12; NVLink
#: 900 GB/s (both directions). DGX H100: 8 ConnectX-7 400 Gb/s NICs = 400e9 bytes/s a node
#: (the scaling book's "node egress" 400e9). A100 SXM data sheet (nvidia.com, document
#: nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf): BF16 312 TFLOP/s dense,
#: NVLink 600 GB/s; DGX A100: 8 ConnectX-6 200 Gb/s NICs = 200e9 bytes/s. T4 data sheet:
#: 65 TFLOP/s mixed precision (FP16), PCIe Gen3 x16 32 GB/s (both directions); Kaggle's
#: "GPU T4 x2" is two of them in one machine; that they exchange data at the PCIe line rate
#: is assumed (no measured figure for Kaggle's machines was found). The 200 Gb/s network:
#: one NIC per node, 25e9 bytes/s.
HARDWARE = {
    "h100": Hardware("8x H100 SXM per node, NVLink; 8x400 Gb/s", 989e12, 8, 450e9, 400e9,
                     "NVIDIA H100 and DGX H100 data sheets"),
    "a100": Hardware("8x A100 SXM per node, NVLink; 8x200 Gb/s", 312e12, 8, 300e9, 200e9,
                     "NVIDIA A100 and DGX A100 data sheets"),
    "t4x2": Hardware("Kaggle 2x T4, PCIe Gen3 x16", 65e12, 2, 16e9, 0.0,
                     "NVIDIA T4 data sheet"),
    "h100-200g": Hardware("8x H100 SXM per node, one 200 Gb/s NIC", 989e12, 8, 450e9, 25e9,
                          "NVIDIA H100 data sheet; 200 Gb/s = 25e9 bytes/s"),
}


def _as_raw(registered):
    """A formula from torch's ``flop_registry`` (already turned into one that takes tensors),
    marked so that ``FlopCounterMode(custom_mapping=...)`` does not wrap it a second time."""
    def formula(*args, out_val=None, **kwargs):
        return registered(*args, out_val=out_val, **kwargs)
    formula._get_raw = True
    return formula


def flops_per_sample(model, inputs: tuple) -> tuple[float, float]:
    """Forward and backward FLOPs per sample, counted by torch's ``FlopCounterMode``.

    Runs ``model(*inputs)`` (the first input's dim 0 the batch) once and backward from the sum
    of its first tensor output. torch counts matrix products, convolutions and attention
    (``FlopCounterMode``'s registry), not element-wise ops; backward is about twice forward
    (a weight and an input gradient per product).

    Returns:
        ``(forward, backward)`` FLOPs per sample. Leaves gradients in ``model``.
    """
    import torch
    from torch.utils.flop_counter import FlopCounterMode, flop_registry

    # torch 2.15 counts scaled_dot_product_attention's CPU kernels with the formulas of its GPU
    # kernels (torch/utils/flop_counter.py, sdpa_flop and sdpa_backward_flop); 2.13 and 2.14
    # have no formula for them and count no attention on a CPU. Lend them the GPU kernels' own,
    # so every torch in the range gives the same count.
    aten = torch.ops.aten
    lend = {aten._scaled_dot_product_flash_attention_for_cpu:
            aten._scaled_dot_product_flash_attention,
            aten._scaled_dot_product_flash_attention_for_cpu_backward:
            aten._scaled_dot_product_flash_attention_backward}
    mapping = {cpu: _as_raw(flop_registry[gpu]) for cpu, gpu in lend.items()
               if cpu not in flop_registry}
    with FlopCounterMode(display=False, custom_mapping=mapping) as fwd:
        out = model(*inputs)
    out = out if not isinstance(out, (tuple, list)) else out[0]
    with FlopCounterMode(display=False, custom_mapping=mapping) as bwd:
        out.sum().backward()
    n = inputs[0].shape[0]
    return fwd.get_total_flops() / n, bwd.get_total_flops() / n


def compute_bound_batch(backward_flops_per_sample: float, grad_bytes: float, hardware: Hardware,
                        world_size: int, mfu: float = 1.0) -> float:
    """The per-GPU batch above which backward takes longer than the gradient all-reduce.

    ``b* = T_allreduce · C · mfu / F_backward``: with overlap, a bigger batch hides the
    all-reduce entirely (the scaling book's ``B/X > C/W``, per sample instead of per token).

    ``grad_bytes``: bytes all-reduced each step; ``hardware``, ``world_size``: as
    :meth:`Hardware.allreduce_s`; ``mfu``: the share of peak FLOP/s reached (1.0: the book's).

    Raises:
        ValueError: non-positive FLOPs or ``mfu`` outside (0, 1].
    """
    if backward_flops_per_sample <= 0 or not 0 < mfu <= 1:
        raise ValueError(f"need backward FLOPs > 0 and 0 < mfu <= 1, got "
                         f"{backward_flops_per_sample}, {mfu}")
    return (hardware.allreduce_s(grad_bytes, world_size) * hardware.flops_per_s * mfu
            / backward_flops_per_sample)


def predict_step(flops: tuple[float, float], grad_bytes: float, batch_per_gpu: float,
                 hardware: Hardware, world_size: int, mfu: float = 1.0,
                 overlap: bool = True) -> dict:
    """A DDP step predicted by the roofline: compute, all-reduce, exposed, efficiency.

    ``compute = b (F_fwd + F_bwd) / (C mfu)``; the all-reduce overlaps backward
    (``exposed = max(0, T_ar - T_backward)``) or follows it (``overlap=False``). Scaling
    efficiency = throughput on R GPUs / (R x throughput on one) = ``compute / step``.

    Returns:
        ``{"compute_s", "backward_s", "allreduce_s", "exposed_s", "step_s", "efficiency"}``.
    """
    fwd, bwd = flops
    rate = hardware.flops_per_s * mfu
    compute, backward = batch_per_gpu * (fwd + bwd) / rate, batch_per_gpu * bwd / rate
    comm = hardware.allreduce_s(grad_bytes, world_size) if world_size > 1 else 0.0
    exposed = max(0.0, comm - backward) if overlap else comm
    return {"compute_s": compute, "backward_s": backward, "allreduce_s": comm,
            "exposed_s": exposed, "step_s": compute + exposed,
            "efficiency": compute / (compute + exposed)}


def hardware_preset(hardware: Hardware | str) -> Hardware:
    """``hardware`` itself, or the :data:`HARDWARE` preset its key names.

    Raises:
        KeyError: an unknown preset (the known ones are named).
    """
    if isinstance(hardware, str):
        if hardware not in HARDWARE:
            raise KeyError(f"unknown hardware {hardware!r}; presets are {sorted(HARDWARE)}")
        hardware = HARDWARE[hardware]
    return hardware


def roofline_report(model, hardware: Hardware | str = "h100", world_sizes=(2, 8, 64),
                    batch_per_gpu: int = 32, inputs: tuple | None = None,
                    tokens_per_sample: int = 1, grad_bytes_per_param: int = 4,
                    mfu: float = 1.0, flops: tuple[float, float] | None = None) -> str:
    """The calculator: compute-bound batch and predicted efficiency for a model on hardware.

    Args:
        model: an ``nn.Module`` (with ``inputs``, an example batch: FLOPs counted by
            :func:`flops_per_sample`; without: ``2P`` forward and ``4P`` backward per token,
            Kaplan et al. 2020, times ``tokens_per_sample``) or a parameter count.
        hardware: a :data:`HARDWARE` key or a :class:`Hardware`.
        world_sizes: GPU counts to predict (a count the hardware cannot hold gets a line).
        grad_bytes_per_param: 4 (fp32 parameters, also under autocast) or 2 (bf16).
        batch_per_gpu, mfu: samples per GPU per step (efficiency), share of peak FLOP/s.
        flops: with ``inputs``, ``flops_per_sample(model, inputs)`` if already counted (the
            calculator counts once, not at every change of a control).

    Returns:
        Short lines, one fact each. Nothing communicates.

    Raises:
        KeyError: an unknown preset (the known ones are named).
    """
    hardware = hardware_preset(hardware)
    params = model if isinstance(model, (int, float)) else sum(
        p.numel() for p in model.parameters() if p.requires_grad)
    if inputs is not None:
        flops, how = flops or flops_per_sample(model, inputs), "FlopCounterMode"
    else:
        flops, how = (2 * params * tokens_per_sample, 4 * params * tokens_per_sample), "2P/4P"
    grad = params * grad_bytes_per_param
    lines = [f"model: {params:,.0f} parameters, {grad:,.0f} gradient bytes a step",
             f"FLOPs per sample ({how}): forward {flops[0]:.3g}, backward {flops[1]:.3g}",
             f"hardware: {hardware.name}", f"  {hardware.flops_per_s / 1e12:g} TFLOP/s per GPU"
             f" x mfu {mfu:g}; links {hardware.gpu_bytes_per_s / 1e9:g} GB/s per GPU, "
             + (f"{hardware.node_bytes_per_s / 1e9:g} GB/s per node" if hardware.node_bytes_per_s
                else "one node"),
             f"GPUs  all-reduce  compute-bound above  efficiency at {batch_per_gpu}/GPU "
             "(overlap, none)"]
    for r in world_sizes:
        try:
            b = compute_bound_batch(flops[1], grad, hardware, r, mfu)
        except ValueError:
            lines.append(f"{r:4d}  more GPUs than this hardware holds")
            continue
        on, off = (predict_step(flops, grad, batch_per_gpu, hardware, r, mfu, o)
                   for o in (True, False))
        lines.append(f"{r:4d}  {on['allreduce_s'] * 1e3:7.3f} ms  {b:12.1f} samples  "
                     f"{on['efficiency']:8.1%}, {off['efficiency']:.1%}")
    return "\n".join(lines)
