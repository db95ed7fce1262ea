"""Exercise 08.1: the fewest ranks on which ZeRO-3 fits a model's states (checked here; the
explanation uses :func:`ddp_lesson.memory.memory_per_rank`)."""
from __future__ import annotations

import random

from .. import solutions as S
from ..registry import Exercise, register
from ..values import as_number, call_case, fmt_num, returned

_CASES = [(70e9, 80e9), (7.5e9, 80e9), (1e9, 80e9), (70e9, 40e9), (175e9, 80e9),
          (13e9, 24e9)]
# Then sizes drawn from a fixed seed (0.1B to 500B parameters, 16 to 192 GB), some exactly at
# a whole number of ranks: a table of the answers above, or round() instead of ceil, fails.
_RNG = random.Random(71)
_CASES += [(round(_RNG.uniform(0.1, 500), 1) * 1e9,
            _RNG.choice([16, 24, 40, 48, 80, 141, 192]) * 1e9) for _ in range(10)]
_CASES += [(30e9, 48e9), (0.5e9, 8e9)]  # 10 and 1 ranks exactly


def _run(fn) -> list[str]:
    from ...memory import memory_per_rank

    for psi, gpu in _CASES:
        want = S.min_ranks_zero3(psi, gpu)
        raw = call_case(fn, (psi, gpu), f"({psi / 1e9:g}B, {gpu / 1e9:g} GB)")
        got = returned(raw, "a whole number of ranks", as_number)
        case = f"{psi / 1e9:g}B parameters on {gpu / 1e9:g} GB ranks"
        if got != int(got):
            return [f"{case}: got {fmt_num(got)} ranks; a number of ranks is a whole number "
                    f"(round up: {want})."]
        got = int(got)
        if got == want:
            continue
        if got < 1:
            return [f"{case}: got {got} ranks; at least one is needed."]
        per = memory_per_rank(psi, got, 3).total_bytes / 1e9
        if per > gpu / 1e9:
            return [
                f"{case}: on {got} rank{'s' if got != 1 else ''} ZeRO-3 keeps "
                f"{fmt_num(per)} GB per rank, more than "
                f"{gpu / 1e9:g} GB; {want} ranks are needed."
            ]
        fewer = memory_per_rank(psi, want, 3).total_bytes / 1e9
        return [f"{case}: {got} ranks fit, but so do {want} ({fmt_num(fewer)} GB each): the "
                "question asks for the fewest."]
    return []


register(Exercise(
    "08.1", "fewest ranks for ZeRO-3",
    task="Write min_ranks_zero3(num_params, gpu_bytes) -> int: the fewest ranks on which the "
         "model states of mixed-precision Adam (16 bytes per parameter, ZeRO paper) fit under "
         "ZeRO-3 in gpu_bytes per rank (activations ignored).",
    signature="fn(num_params: float, gpu_bytes: float) -> int",
    reference=S.min_ranks_zero3, run_local=_run,
    checked="6 models from 1B to 175B parameters on 24, 40 and 80 GB ranks, then 12 more "
            "(0.1B to 500B, 8 to 192 GB; 10 drawn from a fixed seed)"))
