"""The α-β cost model of collective communication, and what it predicts for DDP's buckets.

Sending a message of ``n`` bytes costs ``α + n β``: ``α`` the latency (seconds per message),
``β`` seconds per byte (one over the link's bandwidth). From it:

* the time of an all-reduce done three ways, naive (through rank 0), tree and ring
  (:func:`naive_allreduce_time`, :func:`tree_allreduce_time`, :func:`ring_allreduce_time`), and
  the bytes each rank sends in the ring (:func:`ring_bytes_sent_per_rank`);
* algorithm and bus bandwidth (:func:`algbw`, :func:`busbw`, :func:`bus_factor`), the numbers
  benchmarks report, and a least-squares fit of α and β to measured times
  (:func:`fit_alpha_beta`);
* DDP's overlap on a serial link: when each bucket's all-reduce runs and how much of it is
  exposed after backward (:func:`predict_overlap`, :func:`model_ready_times`,
  :func:`predict_bucket_sweep`).

Pure arithmetic: nothing here needs a process group or communicates.

Sources
-------
* R. Thakur, R. Rabenseifner and W. Gropp, "Optimization of collective communication
  operations in MPICH", IJHPCA 19(1), 2005 — the α-β(-γ) cost model, tree and ring costs.
* P. Patarasuk and X. Yuan, "Bandwidth optimal all-reduce algorithms for clusters of
  workstations", J. Parallel Distrib. Comput. 69(2), 2009 — the ring is bandwidth-optimal.
* NVIDIA nccl-tests, doc/PERFORMANCE.md — algorithm bandwidth vs bus bandwidth,
  busbw = algbw · 2(R-1)/R for all-reduce.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

from .core.bucketed_ddp import ddp_buckets

__all__ = [
    "naive_allreduce_time", "tree_allreduce_time", "ring_allreduce_time",
    "ring_bytes_sent_per_rank", "bus_factor", "algbw", "busbw", "fit_alpha_beta",
    "predict_overlap", "model_ready_times", "predict_bucket_sweep",
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
    """Bus bandwidth in bytes/s: ``algbw · 2(R-1)/R`` (nccl-tests PERFORMANCE.md).

    The rate at which each rank's link actually moved data in a bandwidth-optimal all-reduce,
    so it can be compared with the link's own speed (and across world sizes).
    """
    return algbw_bytes_per_s * bus_factor(world_size)


def fit_alpha_beta(nbytes, seconds) -> tuple[float, float]:
    """Least-squares fit of ``seconds ≈ α + nbytes · β`` (relative errors, α clipped at 0).

    Args:
        nbytes: message sizes in bytes (at least two different sizes).
        seconds: measured time of one message of each size.

    Returns:
        ``(alpha_s, beta_s_per_byte)``.

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

    Bucket ``i`` starts at ``max(ready_i, end_{i-1})`` (with ``overlap=False``: no earlier
    than ``backward_s``) and takes :func:`ring_allreduce_time` (what
    ``ddp_lesson.commsim.SimulatedLink`` charges). Exposed communication is
    ``max(0, end_last - backward_s)``. Pure arithmetic, no process group.

    Args:
        bucket_nbytes: bytes of each bucket, in launch order.
        bucket_ready_s: when each bucket's last gradient is ready (seconds since backward began).
        backward_s: when backward finishes.
        world_size: R.
        latency_s, bandwidth_bytes_per_s: the link (α and 1/β).
        overlap: issue buckets when ready (True) or after backward (False).

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

    Gradients arrive in reverse registration order; parameter ``i`` is ready when backward
    has produced all bytes of parameters ``i..P-1``. (Real layers cost compute in proportion
    to their parameters *times* their feature-map size, so early, high-resolution layers are
    slower than this model says; the notebook's measured timeline shows the difference.)

    Args:
        param_nbytes: bytes per parameter, registration order.
        backward_s: duration of backward.

    Returns:
        Ready time of each parameter, registration order.
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
    those ``BucketedDDP`` builds; an explicit cap for every bucket), ready times from
    :func:`model_ready_times`, link schedule from :func:`predict_overlap`. Small buckets start early
    but pay α many times; big buckets pay α rarely but the last one starts only when backward ends:
    the exposed time has a minimum in between.

    Args:
        param_nbytes: bytes per trainable parameter, registration order.
        caps_mb: bucket caps to try (MiB).
        backward_s, world_size, latency_s, bandwidth_bytes_per_s: as :func:`predict_overlap`.

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
