"""Exercise 06.4: the learning rate for a global batch (linear, sqrt or no scaling), checked
here against :func:`ddp_lesson.gradients.scale_lr`, the trainer's own rule."""
from __future__ import annotations

import math
import random

from .. import solutions as S
from ..registry import Exercise, register
from ..values import as_number, call_case, fmt_num, returned

_CASES = [(0.1, 256, 128, 4, 1, "linear"), (0.1, 16, 8, 4, 1, "linear"),
          (0.1, 8, 2, 2, 4, "linear"), (0.4, 64, 4, 4, 2, "sqrt"),
          (0.05, 32, 8, 8, 1, "none"), (0.2, 16, 16, 4, 1, "sqrt"),
          (0.3, 64, 8, 2, 1, "none")]
# Then draws from a fixed seed: a table of the answers above, or a constant world size or
# accumulation count, fails them.
_RNG = random.Random(54)
_CASES += [(round(_RNG.uniform(0.001, 1.0), 4), _RNG.choice([16, 32, 64, 256, 1024]),
            _RNG.choice([1, 2, 3, 8, 24]), _RNG.randint(1, 16),
            _RNG.randint(1, 6), _RNG.choice(["linear", "sqrt", "none"]))
           for _ in range(12)]


def _run(fn) -> list[str]:
    from ...gradients import scale_lr as scaled_lr

    for base_lr, base_batch, b, R, k, rule in _CASES:
        want = scaled_lr(base_lr, base_batch, b * R * k, rule)
        case = (f"lr {base_lr} tuned at batch {base_batch}, {R} processes x {b} samples x "
                f"{k} accumulation step(s), rule {rule!r}")
        got = returned(call_case(fn, (base_lr, base_batch, b, R, k, rule), f"({case})"),
                       "a learning rate", as_number)
        if math.isclose(got, want, rel_tol=1e-9):
            continue
        msg = f"{case}: got {fmt_num(got)}, expected {fmt_num(want)} (global batch {b * R * k})"

        def same(value, got=got):
            return math.isclose(got, value, rel_tol=1e-9)
        other_rules = [o for o in ("linear", "sqrt", "none")
                       if o != rule and same(scaled_lr(base_lr, base_batch, b * R * k, o))]
        if same(want / R):
            msg += (f": yours is divided by the {R} processes. With averaged gradients the "
                    "learning rate follows the global batch only")
        elif other_rules:  # before accumulation: sqrt taken as linear can look like a k slip
            o = other_rules[0]
            msg += (f": that is the {o!r} rule's value for this global batch, not the "
                    f"{rule!r} rule's. {_RULES[rule]}")
        elif k > 1 and same(scaled_lr(base_lr, base_batch, b * R, rule)):
            msg += ": the accumulation steps are part of the global batch too"
        elif same(scaled_lr(base_lr, base_batch, b, rule)):
            msg += ": yours follows the per-rank batch; the rule uses the global batch"
        return [msg + "."]
    return []


_RULES = {"linear": "linear: base_lr x global batch / base_batch",
          "sqrt": "sqrt: base_lr x sqrt(global batch / base_batch)",
          "none": "none: base_lr unchanged"}


register(Exercise(
    "06.4", "the learning rate for a global batch",
    task="Write effective_lr(base_lr, base_batch, per_rank_batch, world_size, "
         "grad_accum_steps, rule) -> float: the learning rate the trainer uses "
         "(--lr-scaling linear, sqrt or none) when base_lr was tuned at base_batch.",
    signature="fn(base_lr, base_batch, per_rank_batch, world_size, grad_accum_steps, rule)"
              " -> float",
    reference=S.effective_lr, run_local=_run,
    checked="7 settings (linear, sqrt, none; with and without accumulation), then 12 drawn "
            "from a fixed seed"))
