"""Exercise 08.6: bytes one GPU needs at each ZeRO stage (checked here) against
:func:`ddp_lesson.memory.per_rank_bytes`, naming the likely slip: Adam's moments forgotten, the
activations divided or left out, another stage's figure."""
from __future__ import annotations

import random

from .. import solutions as S
from ..registry import Exercise, register
from ..values import as_number, call_case, close, fmt_num, returned

_CASES = [(7.5e9, 20e9, 64, s) for s in range(4)] + [(70e9, 30e9, 8, 3), (1e9, 2e9, 1, 0)]
_RNG = random.Random(86)  # more sizes from a fixed seed: a table of the answers above fails
_CASES += [(round(_RNG.uniform(0.1, 200), 1) * 1e9, round(_RNG.uniform(0, 60), 1) * 1e9,
            _RNG.choice([2, 3, 4, 8, 16, 64]), _RNG.randrange(4)) for _ in range(10)]


_SHARDS = ["nothing", "the optimizer state", "the optimizer state and the gradients",
           "the optimizer state, the gradients and the parameters"]


def _slip(psi, act, R, stage, got) -> str:
    from ...memory import memory_per_rank

    states = memory_per_rank(psi, R, stage)
    slips = {"Adam's two moments are missing (12 bytes of optimizer state per parameter: "
             "fp32 master weight, momentum and variance)":
             memory_per_rank(psi, R, stage, optimizer_bytes=4).total_bytes + act,
             "the activations were divided by the world size: each rank keeps those of its "
             "own micro-batch at every stage": states.total_bytes + act / R,
             "the activations are missing": states.total_bytes}
    slips.update({f"that is stage {s}'s figure: stage {stage} shards {_SHARDS[stage]}":
                  memory_per_rank(psi, R, s).total_bytes + act for s in range(4) if s != stage})
    return next((why for why, v in slips.items() if close(got, v, rtol=1e-6, atol=1)), "")


def _run(fn) -> list[str]:
    from ...memory import per_rank_bytes

    for psi, act, R, stage in _CASES:
        case = (f"{psi / 1e9:g}B parameters, {act / 1e9:g} GB of activations, {R} ranks, "
                f"stage {stage}")
        got = returned(call_case(fn, (psi, act, R, stage), case), "a number of bytes",
                       as_number)
        want = per_rank_bytes(psi, act, R, stage)
        if not close(got, want, rtol=1e-6, atol=1):
            why = _slip(psi, act, R, stage, got)
            return [f"{case}: got {fmt_num(got / 1e9)} GB, expected {fmt_num(want / 1e9)} GB"
                    + (f": {why}." if why else ".")]
    return []


register(Exercise(
    "08.6", "bytes per rank at a ZeRO stage",
    task="Write bytes_per_rank(num_params, activation_bytes, world_size, stage) -> float: "
         "the bytes one GPU needs for mixed-precision Adam (2 + 2 + 12 bytes per parameter, "
         "ZeRO paper) at stage 0 (DDP) to 3 (FSDP), plus activation_bytes, the activations "
         "of that rank's micro-batch. A model fits on G GPUs of M bytes at the stages where "
         "this is <= M.",
    signature="fn(num_params: float, activation_bytes: float, world_size: int, "
              "stage: int) -> float",
    reference=S.bytes_per_rank, run_local=_run,
    checked="6 fixed cases (the ZeRO paper's 7.5B on 64 ranks at each stage) and 10 drawn "
            "from seed 86 (0.1B to 200B parameters, 0 to 60 GB of activations, 2 to 64 ranks)"))
