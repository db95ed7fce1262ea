"""Exercise 09.1: the per-GPU batch (in tokens) above which backward hides the all-reduce;
a miss is named by its ratio to the reference (the ring's 2(R-1)/R left out or taken as 2,
gigabits read as gigabytes, 4-byte gradients for bf16, 6P FLOPs)."""
from __future__ import annotations

import random

from ..registry import Exercise, register
from ..values import as_number, call_case, fmt_num, returned


def min_tokens_per_gpu(num_params: float, world_size: int, tflops: float,
                       link_gbit_per_s: float) -> float:
    """Backward ``4P`` FLOPs per token at ``tflops``; ring all-reduce of bf16 gradients (``2P``
    bytes) over ``world_size`` GPUs on a link of ``link_gbit_per_s`` per direction."""
    from ...cost_model import Hardware, compute_bound_batch

    hw = Hardware("exercise", tflops * 1e12, world_size, link_gbit_per_s * 1e9 / 8, 0.0, "")
    return compute_bound_batch(4 * num_params, 2 * num_params, hw, world_size)


_CASES = [(1e9, 8, 989, 3600), (7e9, 2, 312, 2400), (125e6, 4, 65, 128), (70e9, 16, 989, 3600)]
_RNG = random.Random(91)
_CASES += [(_RNG.choice([0.1, 1, 3, 13, 70]) * 1e9, _RNG.choice([3, 5, 8, 32, 64]),
            _RNG.choice([65, 312, 989]), _RNG.choice([100, 200, 400, 2400, 3600]))
           for _ in range(8)]

# ratio got / expected -> what it means (R is filled in)
_SLIPS = [
    (lambda R: R / (2 * (R - 1)), "without the ring's 2(R-1)/R: each GPU sends 2(R-1)/R "
                                  "times the gradient bytes"),
    (lambda R: R / (R - 1), "with 2 instead of 2(R-1)/R: at R={R} the ring sends {f} times "
                            "the bytes, not 2"),
    (lambda R: 1 / 8, "with Gbit/s read as GB/s: 1 Gbit/s is 1e9 / 8 bytes/s"),
    (lambda R: 2.0, "with 4 bytes per gradient: bf16 gradients are 2 bytes"),
    (lambda R: 2 / 3, "with 6P FLOPs per token: backward alone is 4P (forward's 2P runs before "
                      "the all-reduce can start)"),
]


def _run(fn) -> list[str]:
    for P, R, tflops, gbit in _CASES:
        want = min_tokens_per_gpu(P, R, tflops, gbit)
        case = f"{P / 1e9:g}B parameters, {R} GPUs, {tflops} TFLOP/s, {gbit} Gbit/s"
        got = returned(call_case(fn, (P, R, tflops, gbit), f"({case})"), "a number of tokens",
                       as_number)
        if abs(got - want) <= 1e-6 * abs(want):
            continue
        for ratio, why in _SLIPS:
            if want and abs(got / want - ratio(R)) < 1e-6 * ratio(R):
                return [f"{case}: got {fmt_num(got)}, expected {fmt_num(want)}: "
                        + why.format(R=R, f=fmt_num(2 * (R - 1) / R))]
        return [f"{case}: got {fmt_num(got)}, expected {fmt_num(want)} tokens per GPU."]
    return []


register(Exercise(
    "09.1", "compute-bound batch",
    task="Write min_tokens_per_gpu(num_params, world_size, tflops, link_gbit_per_s) -> float: "
         "the tokens per GPU above which backward (4 FLOPs per parameter per token at tflops "
         "TFLOP/s) takes at least as long as a ring all-reduce of bf16 gradients over "
         "world_size GPUs, each link link_gbit_per_s Gbit/s per direction.",
    signature="fn(num_params: float, world_size: int, tflops: float, "
              "link_gbit_per_s: float) -> float",
    reference=min_tokens_per_gpu, run_local=_run,
    checked="4 fixed cases (2 to 16 GPUs, T4 to H100) and 8 drawn from seed 91 (3 to 64 GPUs)"))
