"""Exercise 02.4: the exact global accuracy from per-rank counts of the unpadded interleaved
shards of ``DistributedEvalSampler``, at 3 and 2 processes (one case leaves a rank empty)."""
from __future__ import annotations

from .. import solutions as S
from ..registry import Exercise, StopCandidate, register
from ..values import close, error_record, first_error, fmt_num, format_error, returned

_CASES = [(7, {6}), (10, {0, 3, 5}), (11, {1, 2, 4, 10}), (2, set())]


def _counts(n, wrong, rank, world_size):
    shard = range(rank, n, world_size)  # DistributedEvalSampler: unpadded, interleaved
    return sum(i not in wrong for i in shard), len(shard)


def _rank(fn, rank, world_size):
    out = []
    for n, wrong in _CASES:
        try:
            out.append(returned(fn(*_counts(n, wrong, rank, world_size)),
                                "a number (the accuracy)", float))
        except Exception as exc:  # e.g. a division by an empty shard's zero count
            out.append(error_record(exc))
            raise StopCandidate(out) from None  # the ranks may be out of step now
    return out


def _judge(results) -> list[str]:
    R = len(results)
    for i, (n, wrong) in enumerate(_CASES):
        want = (n - len(wrong)) / n
        counts = [_counts(n, wrong, r, R) for r in range(R)]
        split = f"N={n} split {', '.join(str(k) for _, k in counts)} over {R} ranks"
        err = first_error({r: results[r][i] for r in range(R) if len(results[r]) > i})
        if err is not None:
            r, rec = err
            msg = f"{split}: rank {r} raised {format_error(rec)}"
            if counts[r][1] == 0:
                msg += (f". Rank {r}'s shard is empty (count 0): divide once, after the "
                        "all-reduce")
            return [msg + "."]
        for r in range(R):
            got = results[r][i]
            if close(got, want, 1e-6, 1e-9):  # float32 arithmetic is fine
                continue
            shards = ", ".join(f"{c}/{k}" for c, k in counts)
            msg = (f"{split} (correct/count: {shards}): rank {r} returned {fmt_num(got)}, the "
                   f"exact accuracy is {fmt_num(want)}")
            rank_means = [c / k for c, k in counts if k]
            if rank_means and close(got, sum(rank_means) / len(rank_means), 1e-6, 1e-9):
                msg += (": yours is the mean of the ranks' accuracies, which over-weights the "
                        "shorter shards. All-reduce the correct and count numbers, then divide "
                        "once")
            elif counts[r][1] and close(got, counts[r][0] / counts[r][1], 1e-6, 1e-9):
                msg += ": yours is this rank's own accuracy; nothing was all-reduced"
            return [msg + "."]
    return []


register(Exercise(
    "02.4", "exact accuracy from per-rank counts",
    task="Write exact_accuracy(correct, count) -> float, called on every rank with the number of "
         "correct predictions and of samples in its unpadded shard; return the global accuracy, "
         "the same on every rank.",
    signature="fn(correct: int, count: int) -> float   # a collective",
    reference=S.exact_accuracy, kind="distributed", world_sizes=(3, 2),
    run_rank=_rank, judge=_judge,
    checked="3 and 2 processes (torchrun, gloo), N = 7, 10, 11 and 2 (one rank with an empty "
            "shard)"))
