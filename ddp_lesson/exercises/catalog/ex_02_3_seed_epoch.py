"""Exercise 02.3: check that every rank has the same seed and epoch, raising on every rank
with a message naming the ranks that differ from rank 0; at 3 and 2 processes."""
from __future__ import annotations

import re

from .. import solutions as S
from ..registry import Exercise, StopCandidate, register
from ..values import error_record, format_error, is_timeout_error, ranks_text

# world size -> [(seeds per rank, epochs per rank, must it raise, ranks to name)]: the ranks
# to name are those whose (seed, epoch) differs from rank 0's. Two world sizes, so that a
# constant 3 (a list of 3 tensors for all_gather) fails.
_CASES = {3: [((0, 0, 0), (0, 0, 0), False, ()),
              ((7, 7, 7), (3, 3, 3), False, ()),
              ((7, 8, 9), (0, 0, 0), True, (1, 2)),
              ((0, 0, 0), (1, 1, 0), True, (2,))],
          2: [((4, 4), (2, 2), False, ()),
              ((4, 4), (2, 5), True, (1,))]}


def _rank(fn, rank, world_size):
    out = []
    for seeds, epochs, _, _ in _CASES[world_size]:
        try:
            fn(seeds[rank], epochs[rank])
            out.append("ok")
        except Exception as exc:  # raising is expected when the ranks disagree
            out.append(error_record(exc))
            if is_timeout_error(out[-1]):  # but a timeout leaves the ranks out of step
                raise StopCandidate(out) from None
    return out


def _judge(results) -> list[str]:
    R = len(results)
    for i, (seeds, epochs, must_raise, name) in enumerate(_CASES[R]):
        outs = [results[r][i] for r in range(R)]
        raised = [r for r in range(R) if outs[r] != "ok"]
        what = (f"seeds {', '.join(map(str, seeds))} and epochs {', '.join(map(str, epochs))} "
                f"on ranks {ranks_text(range(R))}")
        if not must_raise and raised:
            r = raised[0]
            return [f"with {what} (all agree), rank {r} raised {format_error(outs[r])}: the "
                    "check must pass quietly when the ranks agree."]
        if must_raise and not raised:
            if len(set(seeds)) == 1:
                return [f"with {what} nothing was raised: the epoch matters too (set_epoch called "
                        "on some ranks only gives them different orders)."]
            return [f"with {what} nothing was raised (a seed built from the rank, case A2): "
                    "gather every rank's (seed, epoch) and compare."]
        if must_raise and len(raised) < R:
            ok = [r for r in range(R) if r not in raised]
            return [f"with {what} only rank(s) {ranks_text(raised)} raised; rank(s) "
                    f"{ranks_text(ok)} returned normally and would go on into a collective the "
                    "others never join. "
                    "Gather everyone's values (all_gather) and raise on every rank."]
        if must_raise:
            for r in range(R):
                msg = outs[r].get("message", "")
                unnamed = [q for q in name if not re.search(rf"(?<![\d.]){q}(?![\d.])", msg)]
                if unnamed:
                    quoted = " / ".join(x.strip() for x in msg.splitlines() if x.strip())
                    quoted = quoted if len(quoted) <= 200 else quoted[:197] + "..."
                    return [f"with {what} rank {r} raised, but its message does not name "
                            f"rank(s) {ranks_text(unnamed)}: \"{quoted}\". Say which ranks "
                            "disagree, and with what values."]
    return []


register(Exercise(
    "02.3", "all ranks on the same seed and epoch",
    task="Write check_same_seed_epoch(seed, epoch) -> None, called on every rank at the start "
         "of an epoch: gather every rank's (seed, epoch) and, if they differ, raise on every "
         "rank an error whose message (any number of lines) names, as numbers, the ranks whose "
         "(seed, epoch) differs from rank 0's; listing every rank with its values does it.",
    signature="fn(seed: int, epoch: int) -> None   # a collective; raises on disagreement",
    reference=S.check_same_seed_epoch, kind="distributed", world_sizes=(3, 2),
    run_rank=_rank, judge=_judge,
    checked="3 processes (torchrun, gloo), agreeing ranks, seeds 7/8/9, epochs 1/1/0; "
            "2 processes, epochs 2/5"))
