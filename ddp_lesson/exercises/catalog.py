"""Every checkable exercise of notebooks 00-07: its task, how it is run, how it is judged.

Each ``_judge_*`` compares what every rank got with the reference computed here, in this
process, from the package (``ddp_lesson.sampler``, ``ddp_lesson.gradients``, ...), and turns the
first difference into a sentence a learner can act on. The inputs each rank uses are
deterministic functions of its rank, so the judge recomputes them instead of shipping them.
"""
from __future__ import annotations

import math
import random
import re
from collections import Counter

import torch

from ..sampler import contiguous_shard_indices, num_samples_per_rank, padded_order, shard_indices
from . import solutions as S
from .core import (
    Exercise,
    StopCandidate,
    as_number,
    as_whole,
    call_case,
    close,
    error_record,
    first_error,
    fmt_list,
    fmt_num,
    format_error,
    is_timeout_error,
    register,
    returned,
    shown,
)


def _ranks(rs) -> str:
    rs = sorted(rs)
    return ", ".join(map(str, rs))


# ===================================================================== 00.3 local rank

#: (processes per node, nodes): the stored ones first, then sizes that are not powers of two
#: (``rank & (nproc - 1)`` is right only for those), one node, and draws from a fixed seed.
_LAYOUTS_00_3 = [(4, 2), (2, 3), (8, 2), (3, 2), (6, 3), (1, 4), (5, 1), (7, 3)]
_RNG_00_3 = random.Random(3)
_LAYOUTS_00_3 += [(_RNG_00_3.randint(1, 16), _RNG_00_3.randint(1, 6)) for _ in range(8)]


def _run_00_3(fn) -> list[str]:
    for nproc, nnodes in _LAYOUTS_00_3:
        for rank in range(nproc * nnodes):
            raw = call_case(fn, (rank, nproc), f"(rank={rank}, nproc_per_node={nproc})")
            got = returned(raw, "a whole number (the GPU index)", as_whole)
            want = rank % nproc
            if got != want:
                hint = ""
                if got == rank // nproc:
                    hint = " (that is the node's number, not the GPU's)"
                elif got == rank:
                    hint = (" (the global rank: on node 1 and beyond there is no GPU with that "
                            "number, the mistake behind the legacy --local_rank pitfall, C1)")
                return [f"rank {rank} with {nproc} processes per node on {nnodes} nodes: got "
                        f"{shown(raw)}, expected {want}{hint}. Each node numbers its GPUs 0 to "
                        f"{nproc - 1}: rank {rank} is node {rank // nproc}'s process {want}."]
    return []


register(Exercise(
    "00.3", "GPU index from the global rank",
    task="Write local_rank_from_rank(rank, nproc_per_node) -> int: which GPU of its node the "
         "process with global rank `rank` uses when every node runs nproc_per_node processes.",
    signature="fn(rank: int, nproc_per_node: int) -> int",
    reference=S.local_rank_from_rank, run_local=_run_00_3,
    checked="every rank of 16 layouts, 1 to 16 processes per node on 1 to 6 nodes"))


# ===================================================================== 01.4 weighted average

#: Shard sizes per rank. The first three total 8, so a constant 8 could stand in for the total
#: count; the last two total 11 and 13.
_COUNTS_01_4 = ([4, 2, 2], [5, 2, 1], [1, 1, 6], [3, 6, 2], [7, 5, 1])


def _grad_01_4(rank: int) -> torch.Tensor:
    return torch.tensor([rank + 1.0, -0.5 * (rank + 1), rank * rank + 0.25])


def _rank_01_4(fn, rank, world_size):
    out = []
    for counts in _COUNTS_01_4:
        got = fn(_grad_01_4(rank), counts[rank])
        out.append(returned(got, "a tensor of 3 numbers",
                            lambda v: [float(x) for x in torch.as_tensor(v).reshape(-1)]))
    return out


def _judge_01_4(results) -> list[str]:
    from ..gradients import average, weighted_average

    R = len(results)
    grads = [_grad_01_4(r) for r in range(R)]
    for i, counts in enumerate(_COUNTS_01_4):
        want = weighted_average(grads, counts).tolist()
        for r in range(R):
            got = results[r][i]
            if close(got, want):
                continue
            shards = ", ".join(map(str, counts))
            msg = (f"with shards of {shards} samples, rank {r} returned {fmt_list(got)}; the "
                   f"global-batch gradient is {fmt_list(want)}")
            if close(got, average(grads).tolist()):
                msg += (": yours is the plain mean of the 3 gradients, right only for equal "
                        "shards. Weight each rank's gradient by its count: sum n_r * g_r and "
                        "n_r over the ranks (two all-reduces, or one), then divide")
            elif close(got, sum(grads).tolist()):
                msg += ": yours is the plain sum. Weight by the counts and divide by their total"
            elif close(got, sum(g * n for g, n in zip(grads, counts)).tolist()):
                msg += f": yours is sum n_r * g_r; divide it by the total count {sum(counts)}"
            elif close(got, grads[r].tolist()):
                msg += ": yours is this rank's own gradient; nothing was all-reduced"
            elif sum(counts) != 8 and close(got, (weighted_average(grads, counts)
                                                  * sum(counts) / 8).tolist()):
                msg += (f": yours divides by 8, the total of the other cases; here it is "
                        f"{sum(counts)}. All-reduce the counts too")
            others = [s for s in range(R) if s != r and not close(results[s][i], got)]
            if others:
                msg += f". Ranks {_ranks([r] + others)} also disagree with each other"
            return [msg + "."]
    return []


register(Exercise(
    "01.4", "weighted gradient average over unequal shards",
    task="Write weighted_average_gradient(grad, count) -> Tensor, called on every rank with "
         "its mean-loss gradient and its shard's sample count; return sum_r n_r g_r / sum_r n_r "
         "(the same on every rank) using all_reduce.",
    signature="fn(grad: Tensor (3,), count: int) -> Tensor (3,)   # a collective",
    reference=S.weighted_average_gradient, kind="distributed", world_size=3,
    run_rank=_rank_01_4, judge=_judge_01_4,
    checked="3 processes (torchrun, gloo), shards 4/2/2, 5/2/1, 1/1/6, 3/6/2 and 7/5/1"))


# ===================================================================== 01.5 average_gradients

def _toy_01_5(world_size):
    from ..gradients import make_toy_batch, make_toy_model

    x, y = make_toy_batch(4 * world_size)  # 4 samples per rank at every world size
    return make_toy_model(0), x, y


def _rank_01_5(fn, rank, world_size):
    from ..gradients import split_batch

    model, x, y = _toy_01_5(world_size)
    xs, ys = split_batch(x, y, world_size)[rank]
    torch.nn.functional.mse_loss(model(xs), ys).backward()
    fn(model)
    return {n: (None if p.grad is None else p.grad.reshape(-1).tolist())
            for n, p in model.named_parameters()}


def _judge_01_5(results) -> list[str]:
    from ..gradients import split_batch

    R = len(results)
    model, x, y = _toy_01_5(R)
    model.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    want = {n: p.grad.reshape(-1).tolist() for n, p in model.named_parameters()}
    local = []
    for xs, ys in split_batch(x, y, R):
        model.zero_grad()
        torch.nn.functional.mse_loss(model(xs), ys).backward()
        local.append({n: p.grad.reshape(-1).tolist() for n, p in model.named_parameters()})
    for r in range(R):
        for name, w in want.items():
            got = results[r][name]
            if got is None:
                return [f"rank {r}: {name}.grad is None after your function; keep the gradients"]
            if close(got, w):
                continue
            msg = (f"rank {r}: {name}.grad is {fmt_list(got)}, the global-batch gradient is "
                   f"{fmt_list(w)}")
            if close(got, [R * v for v in w]):
                msg += (f": {R}x too big. all_reduce gives the SUM over the ranks; divide by "
                        f"world_size ({R})")
            elif any(close(got, [R * v / k for v in w]) for k in range(1, 9) if k != R):
                k = next(k for k in range(1, 9) if k != R and close(got, [R * v / k for v in w]))
                msg += (f": the sum over the {R} ranks divided by {k}. Divide by "
                        "dist.get_world_size(), not a constant: the checker runs at more than "
                        "one world size")
            elif close(got, local[r][name]):
                bad = [n for n in want if close(results[r][n], local[r][n])]
                msg += (f": still this rank's own gradient. Not averaged here: {', '.join(bad)}; "
                        "every parameter's gradient must be all-reduced, on every rank")
            return [msg + "."]
    return []


register(Exercise(
    "01.5", "average the gradients after backward",
    task="Write average_gradients(model) -> None: after loss.backward() on each rank's shard, "
         "replace every parameter's .grad by its mean over the ranks (in place), so that every "
         "rank holds the global-batch gradient, as DDP does.",
    signature="fn(model: nn.Module) -> None   # a collective",
    reference=S.average_gradients, kind="distributed", world_sizes=(2, 3),
    run_rank=_rank_01_5, judge=_judge_01_5,
    checked="2 and 3 processes (torchrun, gloo), the 19-parameter toy MLP, 4 samples per rank, "
            "against one process on all 8 (12)"))


# ===================================================================== 02.1 sampler

# (N, shuffle, drop_last, seed): simple settings first, so the first problem reported is the
# most basic one.
_SETTINGS_02_1 = [(9, False, False, 0), (10, False, False, 0), (10, True, False, 0),
                  (7, True, False, 5), (2, False, False, 0), (1, True, False, 0),
                  (0, False, False, 0), (12, True, False, 1), (10, False, True, 0),
                  (11, True, True, 3)]
_EPOCHS_02_1 = (0, 1)
#: A fresh sampler is given set_epoch(_FRESH_EPOCH_02_1) before its first pass: an order that
#: follows the number of passes, not the epoch, fails it.
_FRESH_EPOCH_02_1 = 5
#: Samplers for other world sizes, built in one process for every rank (a sampler needs no
#: process group): a constant 3 standing in for num_replicas fails at these.
_OTHER_R_02_1 = (2, 5)


def _rank_02_1(cls, rank, world_size):
    out = []
    for n, shuffle, drop_last, seed in _SETTINGS_02_1:
        rec = {}
        try:
            sampler = cls(list(range(n)), num_replicas=world_size, rank=rank, shuffle=shuffle,
                          seed=seed, drop_last=drop_last)
        except Exception as exc:
            out.append({"construct": error_record(exc)})
            continue
        try:  # the sampler this process builds for its neighbour must match the neighbour's
            other = cls(list(range(n)), num_replicas=world_size, rank=(rank + 1) % world_size,
                        shuffle=shuffle, seed=seed, drop_last=drop_last)
            rec["next"] = [int(i) for i in iter(other)]
        except Exception:
            pass
        for epoch in _EPOCHS_02_1:
            if epoch:
                if not hasattr(sampler, "set_epoch"):
                    rec["no_set_epoch"] = True
                    break
                sampler.set_epoch(epoch)
            try:
                rec[epoch] = [int(i) for i in iter(sampler)]
            except Exception as exc:
                rec[f"iter{epoch}"] = error_record(exc)
                break
        try:
            rec["len"] = len(sampler)
        except Exception as exc:
            rec["len_error"] = error_record(exc)
        rec["extra"] = _extra_02_1(cls, sampler, rank, world_size, n, shuffle, drop_last, seed)
        out.append(rec)
    return out


def _extra_02_1(cls, sampler, rank, world_size, n, shuffle, drop_last, seed) -> dict:
    """What the shortcuts a fixed sequence of calls would miss give: a second pass in the
    same epoch, a fresh sampler given a later epoch first, other world sizes."""
    def orders(make, epoch=None):
        s = make()
        if epoch is not None:
            s.set_epoch(epoch)
        return [int(i) for i in iter(s)], len(s)

    extra = {}
    try:
        extra["again"] = [int(i) for i in iter(sampler)]  # epoch 1 again, no set_epoch between
        extra["fresh"] = orders(lambda: cls(list(range(n)), num_replicas=world_size, rank=rank,
                                            shuffle=shuffle, seed=seed, drop_last=drop_last),
                                _FRESH_EPOCH_02_1)[0]
        for R in _OTHER_R_02_1:
            for r in range(R):
                extra[R, r] = orders(lambda R=R, r=r: cls(list(range(n)), num_replicas=R, rank=r,
                                                          shuffle=shuffle, seed=seed,
                                                          drop_last=drop_last), 2)
    except Exception as exc:
        extra["error"] = error_record(exc)
    return extra


def _judge_02_1_extra(recs, n, shuffle, drop_last, seed) -> str | None:
    """The checks behind the basic ones: the order depends on seed + epoch only (not on how
    many passes were made), and on the num_replicas and rank arguments (not on constants)."""
    R = len(recs)
    setting = _describe_02_1(n, R, shuffle, drop_last, seed)
    for r, rec in enumerate(recs):
        extra = rec["extra"]
        if "error" in extra:
            return (f"{setting}: a second pass, a fresh sampler given set_epoch"
                    f"({_FRESH_EPOCH_02_1}), or one built for another num_replicas raised "
                    f"{format_error(extra['error'])}")
        want = shard_indices(n, R, r, shuffle, seed, _FRESH_EPOCH_02_1, drop_last)
        if extra["fresh"] != want:
            msg = (f"{setting}: on rank {r}, a fresh sampler given set_epoch("
                   f"{_FRESH_EPOCH_02_1}) yields {extra['fresh']}, torch's yields {want} (the "
                   f"order of epoch {_FRESH_EPOCH_02_1})")
            if extra["fresh"] == rec[0]:
                msg += (": yours gave epoch 0's. The order must follow set_epoch, not the "
                        "number of passes: store the epoch, and seed the generator with "
                        "seed + epoch in __iter__ (a resumed run starts at a later epoch)")
            return msg + "."
        if extra["again"] != rec[1]:
            return (f"{setting}: rank {r}'s sampler gave {rec[1]} in epoch 1, then "
                    f"{extra['again']} on a second pass with no set_epoch between: the order "
                    "must depend on seed + epoch only, not on how many passes were made "
                    "(as torch's: a loop may iterate a sampler more than once per epoch).")
    for R2 in _OTHER_R_02_1:
        for r in range(R2):
            got, length = recs[0]["extra"][R2, r]
            want = shard_indices(n, R2, r, shuffle, seed, 2, drop_last)
            per = num_samples_per_rank(n, R2, drop_last)
            where = _describe_02_1(n, R2, shuffle, drop_last, seed, 2)
            if got != want:
                return (f"{where}: the sampler built with num_replicas={R2}, rank={r} yields "
                        f"{got}, torch's yields {want}. Use the num_replicas argument "
                        "everywhere (no constant 3: the checker runs 3 processes, your "
                        "training may not).")
            if length != per:
                return (f"{where}: the sampler built with num_replicas={R2}, rank={r} yields "
                        f"{per} indices but len(sampler) says {length}.")
    return None


def _describe_02_1(n, R, shuffle, drop_last, seed, epoch=None) -> str:
    text = f"N={n}, R={R}, shuffle={shuffle}"
    if shuffle:
        text += f", seed={seed}"
    if drop_last:
        text += ", drop_last=True"
    if epoch is not None and shuffle:
        text += f", epoch {epoch}"
    return text


def _padding_sentence(n, R, shuffle, drop_last, seed, epoch) -> str:
    per = num_samples_per_rank(n, R, drop_last)
    if drop_last:
        return (f"with drop_last=True every rank gets {per} (the order is cut to {per * R}, "
                f"dropping {n - per * R})")
    pad = padded_order(n, R, shuffle, seed, epoch)[n:]
    if not pad:
        return f"every rank gets {per} and no index repeats ({n} divides by {R})"
    which = " and ".join(map(str, pad)) if len(pad) <= 2 else ", ".join(map(str, pad))
    return (f"every rank needs ceil({n}/{R}) = {per}, so the order is padded by wrapping round: "
            f"the padded {'index is' if len(pad) == 1 else 'indices are'} {which}")


def _judge_02_1(results) -> list[str]:
    R = len(results)
    problems = []
    for k, (n, shuffle, drop_last, seed) in enumerate(_SETTINGS_02_1):
        recs = [results[r][k] for r in range(R)]
        setting = _describe_02_1(n, R, shuffle, drop_last, seed)
        problem = None
        for r, rec in enumerate(recs):
            if "construct" in rec:
                problem = (
                    f"{setting}: cls(dataset, num_replicas={R}, rank={r}, shuffle={shuffle}, "
                    f"seed={seed}, drop_last={drop_last}) raised "
                    f"{format_error(rec['construct'])}. Keep torch's signature."
                )
                break
            for epoch in _EPOCHS_02_1:
                if f"iter{epoch}" in rec:
                    problem = (f"{setting}: iterating rank {r}'s sampler raised "
                               f"{format_error(rec[f'iter{epoch}'])}")
                    if 0 < n < R and not drop_last:
                        problem += (". With fewer samples than ranks the order must wrap round "
                                    "more than once: padding once with indices[:pad] is not "
                                    "enough (case A7)")
                    break
            if problem:
                break
            if rec.get("no_set_epoch"):
                problem = ("the sampler has no set_epoch(epoch) method: without it every epoch "
                           "repeats the same order (case A1)")
                break
            if "len_error" in rec:
                problem = (f"len(sampler) raised {format_error(rec['len_error'])}: a DataLoader "
                           "and progress bars need __len__ (the seed's __len__ was indented into "
                           "__iter__, so the class had none)")
                break
        if problem is None:
            problem = _judge_02_1_epochs(recs, n, R, shuffle, drop_last, seed)
        if problem is None:
            per = num_samples_per_rank(n, R, drop_last)
            for r, rec in enumerate(recs):
                if rec["len"] != per:
                    problem = (f"{setting}: rank {r} yields {per} indices but len(sampler) "
                               f"says {rec['len']}; the DataLoader and progress bars trust "
                               "__len__, so it must equal num_samples")
                    break
                nxt = (r + 1) % R
                if "next" in rec and rec["next"] != recs[nxt][0]:
                    problem = (f"{setting}: the sampler built with rank={nxt} in process {r} "
                               f"gives {rec['next']}, but rank {nxt}'s own gives {recs[nxt][0]}: "
                               "use the rank and num_replicas arguments (as torch does), not "
                               "the process group's")
                    break
        if problem:
            problems.append(problem)
    if not problems:  # the basic checks pass: now the shortcuts they would miss
        for k, (n, shuffle, drop_last, seed) in enumerate(_SETTINGS_02_1):
            problem = _judge_02_1_extra([results[r][k] for r in range(R)], n, shuffle,
                                        drop_last, seed)
            if problem:
                return [problem]
    if len(problems) > 1:
        problems[0] += f" ({len(problems)} of {len(_SETTINGS_02_1)} settings fail)"
    return problems[:1]


def _agreed_order(got, n, drop_last):
    """The global order the ranks' shards interleave to, if it is a valid padded (or cut)
    order of ``range(n)`` — i.e. the ranks agree on one order — else None."""
    R = len(got)
    order = [got[r][k] for k in range(len(got[0])) for r in range(R)]
    if drop_last:
        return order if len(set(order)) == len(order) and set(order) <= set(range(n)) else None
    if sorted(order[:n]) != list(range(n)):
        return None
    return order if all(order[k] == order[k % n] for k in range(n, len(order))) else None


def _judge_02_1_epochs(recs, n, R, shuffle, drop_last, seed):
    per = num_samples_per_rank(n, R, drop_last)
    for epoch in _EPOCHS_02_1:
        setting = _describe_02_1(n, R, shuffle, drop_last, seed, epoch)
        got = [rec[epoch] for rec in recs]
        want = [shard_indices(n, R, r, shuffle, seed, epoch, drop_last) for r in range(R)]
        if got == want:
            continue
        if shuffle and epoch and got == [rec[0] for rec in recs] and recs[0][0]:
            return (f"{setting}: the same order as epoch 0. set_epoch must change the "
                    "permutation: seed the generator with seed + epoch (case A1).")
        lengths = [len(g) for g in got]
        if lengths != [per] * R:
            return (f"{setting}: ranks got {', '.join(map(str, lengths))} indices; "
                    + _padding_sentence(n, R, shuffle, drop_last, seed, epoch) + ".")
        contiguous = [contiguous_shard_indices(n, R, r, shuffle, seed, epoch, drop_last)
                      for r in range(R)]
        if got == contiguous:
            return (f"{setting}: every index is covered, but rank 0 got the contiguous block "
                    f"{got[0]} where torch's DistributedSampler deals out interleaved, "
                    f"indices[rank::num_replicas]: {want[0]}. Both split the data; matching torch "
                    "keeps the shards identical when you switch samplers or resume.")
        order = _agreed_order(got, n, drop_last)
        if order is not None:  # one order shared by all ranks, just not torch's
            msg = f"{setting}: the ranks agree on one order, {order}, but torch's is " \
                  f"{padded_order(n, R, shuffle, seed, epoch, drop_last)}"
            if shuffle and order == padded_order(n, R, False, seed, epoch, drop_last):
                msg += ": nothing was shuffled"
            elif shuffle and seed and order == padded_order(n, R, True, 0, epoch, drop_last):
                msg += (f": the seed argument ({seed}) was ignored; "
                        "seed the generator with seed + epoch")
            elif shuffle and epoch and order == padded_order(n, R, True, seed, 0, drop_last):
                msg += ": epoch 0's permutation; seed the generator with seed + epoch (case A1)"
            elif not shuffle:
                msg += ": with shuffle=False the order is 0, 1, ..., N-1"
            elif sorted(order[:n]) == list(range(n)) and order[:n] == \
                    padded_order(n, R, shuffle, seed, epoch, False)[:n]:
                msg += ": the permutation is right; pad by wrapping round to its start, or cut " \
                       "its tail with drop_last"
            else:
                msg += (": draw the order with torch.randperm(N, generator=g) after "
                        "g.manual_seed(seed + epoch), as torch does")
            return msg + "."
        wanted = Counter(padded_order(n, R, shuffle, seed, epoch, drop_last))
        have = Counter(i for g in got for i in g)
        msg = f"{setting}: every rank got {per} indices, but they are not torch's"
        if have != wanted:
            for r, g in enumerate(got):
                twice = [i for i, c in Counter(g).items() if c > 1 and c > wanted[i]]
                if twice:
                    msg = (f"{setting}: rank {r} got index {twice[0]} twice; "
                           + _padding_sentence(n, R, shuffle, drop_last, seed, epoch))
                    break
            else:
                extra = sorted(i for i in have if have[i] > wanted[i])
                missing = sorted(i for i in wanted if have[i] < wanted[i])
                if extra:
                    i = extra[0]
                    on = [r for r, g in enumerate(got) if i in g]
                    msg = (f"{setting}: index {i} is on ranks {_ranks(on)}; "
                           + _padding_sentence(n, R, shuffle, drop_last, seed, epoch))
                if missing:
                    i = missing[0]
                    where = ("on no rank" if not have[i] else
                             f"there {have[i]} time(s) in all, {wanted[i]} expected")
                    msg += (";" if extra else ":") + f" index {i} is {where}"
            if shuffle:
                msg += (". Do all ranks draw the same permutation? Seed it with seed + epoch, "
                        "never with the rank (case A2)")
            return msg + "."
        r = next(r for r in range(R) if got[r] != want[r])
        return (f"{setting}: every index is covered, but rank {r} got {got[r]} where torch's "
                f"DistributedSampler gives {want[r]}.")
    return None


register(Exercise(
    "02.1", "a DistributedSampler equal to torch's",
    task="Write a Sampler class with torch's signature, cls(dataset, num_replicas, rank, "
         "shuffle=True, seed=0, drop_last=False), with set_epoch(epoch), __iter__ and __len__, "
         "that yields, on each rank, exactly the indices torch.utils.data.DistributedSampler "
         "yields.",
    signature="cls(dataset, num_replicas=R, rank=r, shuffle=..., seed=..., drop_last=...)",
    reference=S.DistributedSampler, kind="distributed", world_size=3,
    run_rank=_rank_02_1, judge=_judge_02_1,
    checked="3 processes (torchrun, gloo), N = 0, 1, 2, 7, 9, 10, 11, 12, shuffle and "
            "drop_last on and off, epochs 0, 1 (twice) and 5 (a fresh sampler); "
            "num_replicas 2 and 5 in one process"))


# ===================================================================== 02.3 seed/epoch check

# world size -> [(seeds per rank, epochs per rank, must it raise, ranks to name)]: the ranks
# to name are those whose (seed, epoch) differs from rank 0's. Two world sizes, so that a
# constant 3 (a list of 3 tensors for all_gather) fails.
_CASES_02_3 = {3: [((0, 0, 0), (0, 0, 0), False, ()),
                   ((7, 7, 7), (3, 3, 3), False, ()),
                   ((7, 8, 9), (0, 0, 0), True, (1, 2)),
                   ((0, 0, 0), (1, 1, 0), True, (2,))],
               2: [((4, 4), (2, 2), False, ()),
                   ((4, 4), (2, 5), True, (1,))]}


def _rank_02_3(fn, rank, world_size):
    out = []
    for seeds, epochs, _, _ in _CASES_02_3[world_size]:
        try:
            fn(seeds[rank], epochs[rank])
            out.append("ok")
        except Exception as exc:  # raising is expected when the ranks disagree
            out.append(error_record(exc))
            if is_timeout_error(out[-1]):  # but a timeout leaves the ranks out of step
                raise StopCandidate(out) from None
    return out


def _judge_02_3(results) -> list[str]:
    R = len(results)
    for i, (seeds, epochs, must_raise, name) in enumerate(_CASES_02_3[R]):
        outs = [results[r][i] for r in range(R)]
        raised = [r for r in range(R) if outs[r] != "ok"]
        what = (f"seeds {', '.join(map(str, seeds))} and epochs {', '.join(map(str, epochs))} "
                f"on ranks {_ranks(range(R))}")
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
            return [f"with {what} only rank(s) {_ranks(raised)} raised; rank(s) {_ranks(ok)} "
                    "returned normally and would go on into a collective the others never join. "
                    "Gather everyone's values (all_gather) and raise on every rank."]
        if must_raise:
            for r in range(R):
                msg = outs[r].get("message", "")
                unnamed = [q for q in name if not re.search(rf"(?<![\d.]){q}(?![\d.])", msg)]
                if unnamed:
                    quoted = " / ".join(x.strip() for x in msg.splitlines() if x.strip())
                    quoted = quoted if len(quoted) <= 200 else quoted[:197] + "..."
                    return [f"with {what} rank {r} raised, but its message does not name rank(s) "
                            f"{_ranks(unnamed)}: \"{quoted}\". Say which ranks disagree, and with "
                            "what values."]
    return []


register(Exercise(
    "02.3", "all ranks on the same seed and epoch",
    task="Write check_same_seed_epoch(seed, epoch) -> None, called on every rank at the start "
         "of an epoch: gather every rank's (seed, epoch) and, if they differ, raise on every "
         "rank an error whose message (any number of lines) names, as numbers, the ranks whose "
         "(seed, epoch) differs from rank 0's; listing every rank with its values does it.",
    signature="fn(seed: int, epoch: int) -> None   # a collective; raises on disagreement",
    reference=S.check_same_seed_epoch, kind="distributed", world_sizes=(3, 2),
    run_rank=_rank_02_3, judge=_judge_02_3,
    checked="3 processes (torchrun, gloo), agreeing ranks, seeds 7/8/9, epochs 1/1/0; "
            "2 processes, epochs 2/5"))


# ===================================================================== 02.4 exact accuracy

_CASES_02_4 = [(7, {6}), (10, {0, 3, 5}), (11, {1, 2, 4, 10}), (2, set())]


def _counts_02_4(n, wrong, rank, world_size):
    shard = range(rank, n, world_size)  # DistributedEvalSampler: unpadded, interleaved
    return sum(i not in wrong for i in shard), len(shard)


def _rank_02_4(fn, rank, world_size):
    out = []
    for n, wrong in _CASES_02_4:
        try:
            out.append(returned(fn(*_counts_02_4(n, wrong, rank, world_size)),
                                "a number (the accuracy)", float))
        except Exception as exc:  # e.g. a division by an empty shard's zero count
            out.append(error_record(exc))
            raise StopCandidate(out) from None  # the ranks may be out of step now
    return out


def _judge_02_4(results) -> list[str]:
    R = len(results)
    for i, (n, wrong) in enumerate(_CASES_02_4):
        want = (n - len(wrong)) / n
        counts = [_counts_02_4(n, wrong, r, R) for r in range(R)]
        err = first_error({r: results[r][i] for r in range(R) if len(results[r]) > i})
        if err is not None:
            r, rec = err
            msg = (f"N={n} split {', '.join(str(k) for _, k in counts)} over {R} ranks: rank {r} "
                   f"raised {format_error(rec)}")
            if any(k == 0 for _, k in counts):
                msg += ". A rank may have no sample at all: divide once, after the all-reduce"
            return [msg + "."]
        for r in range(R):
            got = results[r][i]
            if close(got, want, 1e-6, 1e-9):  # float32 arithmetic is fine
                continue
            shards = ", ".join(f"{c}/{k}" for c, k in counts)
            msg = (f"N={n} split {', '.join(str(k) for _, k in counts)} over {R} ranks (correct/"
                   f"count: {shards}): rank {r} returned {fmt_num(got)}, the exact accuracy is "
                   f"{fmt_num(want)}")
            rank_means = [c / k for c, k in counts if k]
            if rank_means and close(got, sum(rank_means) / len(rank_means), 1e-6, 1e-9):
                msg += (
                    ": yours is the mean of the ranks' accuracies, which over-weights the "
                    "shorter shards. All-reduce the correct and count numbers, then divide once"
                )
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
    run_rank=_rank_02_4, judge=_judge_02_4,
    checked="3 and 2 processes (torchrun, gloo), N = 7, 10, 11 and 2 (one rank with an empty "
            "shard)"))


# ===================================================================== 03.3 tree vs ring

_CASES_03_3 = [(5e-6, 1e-10, 8), (5e-6, 1e-10, 4), (5e-6, 1e-10, 16), (5e-6, 1e-10, 5),
               (1e-5, 1e-9, 64), (5e-6, 1e-10, 2), (5e-6, 1e-10, 3)]
# Then alpha, beta and R drawn from a fixed seed (alpha 1-50 us, beta 0.01-1 ns/byte, R 2-128):
# an answer tuned to alpha = 5 us, or a table of the R above, fails them.
_RNG_03_3 = random.Random(33)
_CASES_03_3 += [(_RNG_03_3.uniform(1e-6, 5e-5), _RNG_03_3.uniform(1e-11, 1e-9),
                 _RNG_03_3.randint(2, 128)) for _ in range(12)]


def _run_03_3(fn) -> list[str]:
    from ..collectives import ring_allreduce_time, tree_allreduce_time

    for alpha, beta, R in _CASES_03_3:
        want = S.tree_beats_ring_below(alpha, beta, R)
        case = f"(alpha={alpha * 1e6:.4g} us, beta={beta * 1e9:.4g} ns/byte, R={R})"
        got = returned(call_case(fn, (alpha, beta, R), case), "a number of bytes", as_number)
        if math.isclose(got, want, rel_tol=1e-2, abs_tol=1.0):
            continue
        case = f"R={R}, alpha={alpha * 1e6:.4g} us, beta={beta * 1e9:.4g} ns/byte"
        if want == 0:
            return [f"{case}: got {fmt_num(got)} bytes, but here the tree "
                    f"({math.ceil(math.log2(R))} levels, {2 * math.ceil(math.log2(R))} messages "
                    f"in a row) never beats the ring ({2 * (R - 1)} messages): the answer is 0."]
        t_ring = ring_allreduce_time(max(got, 0), R, alpha, beta) * 1e6
        t_tree = tree_allreduce_time(max(got, 0), R, alpha, beta) * 1e6
        return [f"{case}: got {fmt_num(got)} bytes; at that size the ring takes "
                f"{fmt_num(t_ring)} us and the tree {fmt_num(t_tree)} us. They cross at "
                f"{fmt_num(want)} bytes: solve 2L(alpha + n beta) = 2(R-1) alpha + "
                "2(R-1)/R n beta for n, with L = ceil(log2 R)."]
    return []


register(Exercise(
    "03.3", "where the tree beats the ring",
    task="Write tree_beats_ring_below(alpha_s, beta_s_per_byte, world_size) -> float: the "
         "message size in bytes below which the tree all-reduce is faster than the ring in the "
         "alpha-beta model of this notebook (0 when the tree never wins).",
    signature="fn(alpha_s: float, beta_s_per_byte: float, world_size: int) -> float (bytes)",
    reference=S.tree_beats_ring_below, run_local=_run_03_3,
    checked="R = 2, 3, 4, 5, 8, 16, 64, then 12 draws of alpha, beta and R (fixed seed); "
            "answers within 1%"))


# ===================================================================== 03.6 ring all-reduce

# (dtype, shape): an integer tensor has a digit per rank, so a wrong element says which
# ranks it summed; sizes below, at and above the world size.
_CASES_03_6 = [("int64", (10,)), ("int64", (1,)), ("int64", (3,)), ("int64", (4,)),
               ("int64", (3, 7)), ("int64", (1001,)), ("float32", (1000,))]


def _input_03_6(dtype, shape, rank):
    numel = math.prod(shape)
    if dtype == "int64":
        return ((torch.arange(numel, dtype=torch.int64) + 1) * 10 ** rank).reshape(shape)
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(numel, generator=g).reshape(shape)


#: torch's own collectives, off limits while a learner's ring runs: the exercise is to build
#: the all-reduce from point-to-point messages.
_BUILT_IN_03_6 = ("all_reduce", "reduce_scatter", "reduce_scatter_tensor", "all_gather",
                  "all_gather_into_tensor", "all_gather_object", "reduce", "broadcast",
                  "all_to_all", "all_to_all_single", "gather", "scatter")


class BuiltInCollectiveUsed(RuntimeError):
    pass


def _peer(args, kwargs, which: str):
    """The peer rank of an isend/irecv/send/recv call, however it was passed."""
    if len(args) > 1:
        return args[1]
    for key in (which, f"group_{which}"):
        if kwargs.get(key) is not None:
            return kwargs[key]
    return None


def _call_recording_p2p(fn, tensor):
    """``fn(tensor)`` with torch's collectives refused and every point-to-point message
    recorded: returns (what fn returned, [("send"|"recv", peer, numel), ...])."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    messages = []

    def refuse(name):
        def refused(*args, **kwargs):
            raise BuiltInCollectiveUsed(
                f"your ring called dist.{name}; build it from dist.isend / dist.irecv "
                "(or send / recv) only: that is the exercise")
        return refused

    def record(name, f):
        kind, which = ("send", "dst") if "send" in name else ("recv", "src")

        def recorded(*args, **kwargs):
            t = args[0] if args else kwargs.get("tensor")
            peer, world = _peer(args, kwargs, which), dist.get_world_size()
            if isinstance(peer, int) and not 0 <= peer < world:
                # gloo would wait for a rank that does not exist until the timeout
                raise ValueError(f"dist.{name} with rank {peer}, but there are {world} ranks "
                                 f"(0 to {world - 1}): take R from dist.get_world_size(), "
                                 "not a constant")
            messages.append((kind, peer, int(t.numel()) if hasattr(t, "numel") else -1))
            return f(*args, **kwargs)
        recorded.__name__ = name
        return recorded

    patches = {name: refuse(name) for name in _BUILT_IN_03_6 if hasattr(dist, name)}
    patches.update({name: record(name, getattr(c10d, name))
                    for name in ("isend", "irecv", "send", "recv")})
    saved = [(mod, name, getattr(mod, name)) for mod in (dist, c10d) for name in patches
             if hasattr(mod, name)]
    try:
        for mod, name, _ in saved:
            setattr(mod, name, patches[name])
        return fn(tensor), messages
    finally:
        for mod, name, f in saved:
            setattr(mod, name, f)


def _rank_03_6(fn, rank, world_size):
    out = []
    for dtype, shape in _CASES_03_6:
        t = _input_03_6(dtype, shape, rank)
        back, messages = _call_recording_p2p(fn, t)
        ret = None
        if isinstance(back, torch.Tensor):
            ret = back.reshape(-1).tolist()
        out.append({"tensor": t.reshape(-1).tolist(), "returned": ret, "shape": list(t.shape),
                    "messages": messages})
    return out


def _judge_03_6_method(results) -> list[str]:
    """The values are right; is it a ring? Neighbours only, at most 2(R-1) messages to each,
    and at most 2(R-1) chunks of ceil(n/R) elements sent in all."""
    R = len(results)
    for i, (dtype, shape) in enumerate(_CASES_03_6):
        n = math.prod(shape)
        case = f"an {dtype} tensor of shape {tuple(shape)}"
        for r in range(R):
            messages = results[r][i]["messages"]
            neighbours = {(r + 1) % R, (r - 1) % R}
            far = sorted({peer for _, peer, _ in messages if peer not in neighbours},
                         key=lambda p: (p is None, p if p is not None else 0))
            if far:
                return [f"{case}: the values are right, but rank {r} exchanged messages with "
                        f"rank(s) {', '.join(map(str, far))}, which are not its neighbours "
                        f"{(r - 1) % R} and {(r + 1) % R}. A ring talks only to (rank + 1) % R "
                        "and (rank - 1) % R, in 2(R-1) steps; sending to every rank is an "
                        "all-to-all, what the ring avoids."]
            for peer in sorted(neighbours):
                sends = sum(1 for kind, p, _ in messages if kind == "send" and p == peer)
                if sends > 2 * (R - 1):
                    return [f"{case}: the values are right, but rank {r} sent {sends} messages "
                            f"to rank {peer}; a ring all-reduce takes 2(R-1) = {2 * (R - 1)} "
                            "steps, one chunk to the next rank per step."]
            sent = sum(k for kind, _, k in messages if kind == "send")
            bound = 2 * (R - 1) * math.ceil(n / R)
            if sent > bound:
                return [f"{case}: the values are right, but rank {r} sent {sent} elements for a "
                        f"tensor of {n}; a ring all-reduce sends 2(R-1) chunks of about n/R "
                        f"elements (at most {bound} here). Pass chunks round the ring, not "
                        "whole tensors."]
            if not any(kind == "send" for kind, _, _ in messages) and n >= R:
                return [f"{case}: the values are right, but rank {r} sent no message with "
                        "isend/send: build the ring from point-to-point messages."]
    return []


def _contributors(value: int, element: int, world_size: int) -> list[int]:
    q, rem = divmod(int(value), element + 1)
    digits = [(q // 10 ** r) % 10 for r in range(world_size)]
    if rem or q >= 10 ** world_size:
        return []
    return [r for r, d in enumerate(digits) if d == 1] if all(d in (0, 1) for d in digits) else []


def _judge_03_6(results) -> list[str]:
    R = len(results)
    for i, (dtype, shape) in enumerate(_CASES_03_6):
        ins = [_input_03_6(dtype, shape, r) for r in range(R)]
        want = sum(t.double() for t in ins).reshape(-1).tolist()
        case = f"an {dtype} tensor of shape {tuple(shape)}"
        for r in range(R):
            rec = results[r][i]
            got = rec["tensor"]
            ok = (
                (got == [int(v) for v in want])
                if dtype == "int64"
                else close(got, want, 1e-5, 1e-5)
            )
            if ok:
                continue
            if rec["returned"] is not None and close(rec["returned"], want, 1e-5, 1e-5):
                return [f"{case}: the returned tensor holds the sum but rank {r}'s input tensor "
                        "does not: like dist.all_reduce, work in place (write into tensor)."]
            if close(got, ins[r].reshape(-1).tolist(), 0, 0):
                return [f"{case}: rank {r}'s tensor is unchanged after your call."]
            if (close(got, [v / R for v in want], 1e-5, 1e-5)
                    or (dtype == "int64" and got == [int(v) // R for v in want])):
                return [f"{case}: rank {r} holds the sum divided by {R} (the mean); "
                        "all_reduce's default op is SUM."]
            msg = f"{case}: rank {r} got {fmt_list(got)}, dist.all_reduce gives {fmt_list(want)}"
            if dtype == "int64":
                full = [e for e in range(len(got)) if got[e] == want[e]]
                partial = [e for e in range(len(got)) if got[e] != want[e]]
                e = partial[0]
                who = _contributors(got[e], e, R)
                if who:
                    msg += (f". Element {e} holds the values of rank(s) {_ranks(who)} only "
                            f"(each rank's input carries its own digit: rank k adds "
                            f"(i+1)*10**k)")
                if full and who and len(full) <= math.ceil(len(got) / R) + 1:
                    msg += (f"; the full sum is only in elements {full[0]}-{full[-1]}. That is "
                            "what a reduce-scatter leaves: the all-gather phase (R-1 more steps "
                            "passing the finished chunks round the ring) is missing")
            return [msg + "."]
    return _judge_03_6_method(results)


register(Exercise(
    "03.6", "ring all-reduce from isend/irecv",
    task="Write ring_all_reduce(tensor) -> tensor: an in-place SUM all-reduce on a ring, "
         "reduce-scatter then all-gather, built from dist.isend / dist.irecv to the neighbours "
         "(rank + 1) % R and (rank - 1) % R. It must work for any shape, for fewer elements "
         "than ranks, and give exactly dist.all_reduce's result on integers.",
    signature="fn(tensor: Tensor) -> Tensor   # in place; a collective",
    reference=S.ring_all_reduce, kind="distributed", world_sizes=(4, 3),
    run_rank=_rank_03_6, judge=_judge_03_6,
    checked="4 and 3 processes (torchrun, gloo), int64 sizes 1, 3, 4, 10, 21 (3x7), 1001 "
            "exactly, float32 1000 within 1e-5; messages to neighbours only, 2(R-1) chunks"))


# ===================================================================== 04.2 fp16 comm hook

_BUCKET_MB_04_2 = 40 / 2 ** 20  # a few parameters per bucket: several buckets after the rebuild


def _describe_value_04_2(v) -> str:
    if isinstance(v, (list, tuple)):
        inner = type(v[0]).__name__ if v else "nothing"
        return f"a {type(v).__name__} of {len(v)} ({inner})"
    if isinstance(v, torch.Tensor):
        return f"a tensor of shape {tuple(v.shape)}"
    return f"a {type(v).__name__}"


def _checked_hook_04_2(fn, log: dict):
    """Wrap the learner's hook: note what it all-reduces and returns, keep DDP running."""
    import torch.distributed as dist

    def hook(state, bucket):  # the parameter must be named `bucket`: torch checks it by name
        orig = dist.all_reduce

        def recording(tensor, *args, **kwargs):
            log["dtypes"].add(str(tensor.dtype).replace("torch.", ""))
            return orig(tensor, *args, **kwargs)

        dist.all_reduce = recording
        try:
            result = fn(state, bucket)
        finally:
            dist.all_reduce = orig
        buffer = bucket.buffer()
        if not isinstance(result, torch._C.Future):  # torch.futures.Future and the raw one
            log["returned"].add(type(result).__name__)
            if hasattr(result, "wait"):
                result.wait()
            done = torch.futures.Future()
            done.set_result(buffer)
            return done

        def check_value(fut):
            value = fut.value()
            if not isinstance(value, torch.Tensor) or value.shape != buffer.shape:
                log["values"].add(_describe_value_04_2(value) + f" for a bucket of shape "
                                  f"{tuple(buffer.shape)}")
                return buffer
            return value

        return result.then(check_value)

    return hook


def _grads_04_2(fn, rank, world_size, process_group, log) -> list[float]:
    """Two backward passes of the toy MLP under torch's DDP with the hook; the second's grads."""
    from torch.nn.parallel import DistributedDataParallel

    from ..gradients import make_toy_batch, make_toy_model, split_batch

    model = make_toy_model(0)
    x, y = make_toy_batch(8)
    xs, ys = split_batch(x, y, world_size)[rank]
    ddp = DistributedDataParallel(model, process_group=process_group,
                                  bucket_cap_mb=_BUCKET_MB_04_2)
    ddp.register_comm_hook(process_group, _checked_hook_04_2(fn, log))
    for _ in range(2):  # torch rebuilds its buckets after the first pass: several buckets
        model.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(ddp(xs), ys).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()]).tolist()


def _rank_04_2(fn, rank, world_size):
    import torch.distributed as dist

    log = {"dtypes": set(), "returned": set(), "values": set()}
    world = _grads_04_2(fn, rank, world_size, None, log)
    alone, _ = dist.new_subgroups(group_size=1)  # every rank in a process group of its own
    one = _grads_04_2(fn, rank, world_size, alone, log)
    return {"world": world, "one": one, **{k: sorted(v) for k, v in log.items()}}


def _judge_04_2(results) -> list[str]:
    from ..gradients import batch_gradient, make_toy_batch, make_toy_model, shard_gradients

    R = len(results)
    x, y = make_toy_batch(8)
    want = batch_gradient(make_toy_model(0), x, y).tolist()
    local = [g.tolist() for g in shard_gradients(make_toy_model(0), x, y, R)]
    tol = {"rtol": 2e-3, "atol": 1e-4}  # float16 rounding
    for r in range(R):
        res = results[r]
        if res["returned"]:
            what = " and ".join(res["returned"])
            return [f"your hook returned a {what} on rank {r}; torch's DDP needs a "
                    "torch.futures.Future that completes with the averaged bucket: "
                    "fut = dist.all_reduce(t, group=..., async_op=True).get_future(), then "
                    "return fut.then(decompress). (The Reducer waits on that future at the end "
                    "of backward; a handle with .wait() is our BucketedDDP's contract, not "
                    "torch's.)"]
        if res["values"]:
            return [f"your hook's future completed with {res['values'][0]} on rank {r}; it "
                    "must complete with one tensor shaped like bucket.buffer(). "
                    "dist.all_reduce(...).get_future() completes with a list of tensors: "
                    "chain .then(lambda fut: fut.value()[0]) (and cast back to float32 "
                    "there)."]
    if any(results[r]["world"] != results[0]["world"] for r in range(R)):
        q = next(r for r in range(R) if results[r]["world"] != results[0]["world"])
        return [f"at world size {R}, rank 0 and rank {q} hold different gradients after "
                "backward: the all-reduced bucket never reached the gradients. Return a future "
                "whose value is the reduced (decompressed) bucket."]
    got = results[0]["world"]
    if close(got, [R * v for v in want], **tol):
        return [f"at world size {R} the gradients are {R}x the average (gradients {R}x too "
                "large): with a hook registered, torch's DDP does not divide by the world size "
                "-- the hook must. Divide by the process group's size before the SUM, like "
                "torch's own hooks: group = state if state is not None else dist.group.WORLD; "
                "half.div_(group.size())."]
    if close(got, [v / R for v in want], **tol):
        return [f"at world size {R} the gradients are 1/{R} of the average: they were divided "
                "twice. torch's DDP leaves the division to the hook; divide once."]
    if not close(got, want, **tol):
        return [f"at world size {R} the gradients {fmt_list(got)} are not the global-batch "
                f"gradient {fmt_list(want)} within float16 rounding (rtol 2e-3)."]
    for r in range(R):
        got1 = results[r]["one"]
        if close(got1, local[r], **tol):
            continue
        where = f"in a process group of 1 rank (state = that group; rank {r} alone), "
        if close(got1, [v / R for v in local[r]], **tol):
            return [where + f"your gradients are 1/{R} of the right ones: the hook divided by "
                    f"{R} whatever the group. Divide by the size of the group the hook serves, "
                    "state.size() (dist.group.WORLD when state is None), not by a constant or "
                    "dist.get_world_size()."]
        total = [sum(vs) for vs in zip(*local)]
        if any(close(got1, [v / k for v in total], **tol) for k in (1, R)):
            return [where + "your gradients mix every rank's: the hook all-reduced over the "
                    "default group. Pass group=state (dist.group.WORLD when state is None) to "
                    "dist.all_reduce."]
        return [where + f"rank {r}'s gradients {fmt_list(got1)} are not its own gradient "
                f"{fmt_list(local[r])}."]
    dtypes = set().union(*(results[r]["dtypes"] for r in range(R)))
    if dtypes and "float16" not in dtypes:
        return [f"the gradients are right but not compressed: your hook all-reduced "
                f"{', '.join(sorted(dtypes))} (4 bytes a number). Cast the bucket to "
                "torch.float16 before the all_reduce (half the bytes) and back afterwards."]
    if not dtypes:  # all_reduce reached by another name: judge by the values
        sums = torch.tensor(got, dtype=torch.float32)
        if not torch.equal(sums.half().float(), sums):
            return ["the gradients are right but are not float16 numbers, so the bucket "
                    "travelled as float32. Cast it to torch.float16 before the all_reduce."]
    return []


register(Exercise(
    "04.2", "a float16-compressing comm hook for torch's DDP",
    task="Write hook(state, bucket) -> torch.futures.Future[Tensor] for torch's "
         "ddp.register_comm_hook(state, hook), where state is the process group (None: the "
         "default group) and bucket a dist.GradBucket: send bucket.buffer() as float16 (half "
         "the bytes), divided by the group's size (torch's DDP does not divide when a hook is "
         "registered; dividing first keeps the float16 sum from overflowing), SUM-all-reduce "
         "it asynchronously, and return a future that completes with the float32 average "
         "shaped like bucket.buffer(). Name the second parameter `bucket`: torch checks it.",
    signature="fn(state: ProcessGroup | None, bucket: dist.GradBucket) -> "
              "torch.futures.Future[Tensor]",
    reference=S.fp16_compress_hook, kind="distributed", world_size=2,
    run_rank=_rank_04_2, judge=_judge_04_2,
    checked="2 processes (torchrun, gloo), torch's DistributedDataParallel on the toy MLP "
            "with several buckets, over the 2-rank group and over a group of 1 rank each, "
            "against one process on the global batch within float16 rounding"))


# ===================================================================== 05.4 effective LR

_CASES_05_4 = [(0.1, 256, 128, 4, 1, "linear"), (0.1, 16, 8, 4, 1, "linear"),
               (0.1, 8, 2, 2, 4, "linear"), (0.4, 64, 4, 4, 2, "sqrt"),
               (0.05, 32, 8, 8, 1, "none"), (0.2, 16, 16, 4, 1, "sqrt"),
               (0.3, 64, 8, 2, 1, "none")]
# Then draws from a fixed seed: a table of the answers above, or a constant world size or
# accumulation count, fails them.
_RNG_05_4 = random.Random(54)
_CASES_05_4 += [(round(_RNG_05_4.uniform(0.001, 1.0), 4), _RNG_05_4.choice([16, 32, 64, 256, 1024]),
                 _RNG_05_4.choice([1, 2, 3, 8, 24]), _RNG_05_4.randint(1, 16),
                 _RNG_05_4.randint(1, 6), _RNG_05_4.choice(["linear", "sqrt", "none"]))
                for _ in range(12)]


def _run_05_4(fn) -> list[str]:
    from ..train import scaled_lr

    for base_lr, base_batch, b, R, k, rule in _CASES_05_4:
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
                    f"{rule!r} rule's. {_RULES_05_4[rule]}")
        elif k > 1 and same(scaled_lr(base_lr, base_batch, b * R, rule)):
            msg += ": the accumulation steps are part of the global batch too"
        elif same(scaled_lr(base_lr, base_batch, b, rule)):
            msg += ": yours follows the per-rank batch; the rule uses the global batch"
        return [msg + "."]
    return []


_RULES_05_4 = {"linear": "linear: base_lr x global batch / base_batch",
               "sqrt": "sqrt: base_lr x sqrt(global batch / base_batch)",
               "none": "none: base_lr unchanged"}


register(
    Exercise(
        "05.4",
        "the learning rate for a global batch",
        task="Write effective_lr(base_lr, base_batch, per_rank_batch, world_size, "
        "grad_accum_steps, rule) -> float: the learning rate the trainer uses "
        "(--lr-scaling linear, sqrt or none) "
        "when base_lr was tuned at base_batch.",
        signature="fn(base_lr, base_batch, per_rank_batch, world_size, grad_accum_steps, rule)"
        " -> float",
        reference=S.effective_lr,
        run_local=_run_05_4,
        checked="7 settings (linear, sqrt, none; with and without accumulation), then 12 drawn "
        "from a fixed seed",
    )
)


# ===================================================================== 06.5 global rank

#: (nodes, processes per node): the stored ones, then layouts where nproc_per_node is not 2
#: or 4 and nnodes is not 2 (a constant standing in for either fails), and draws from a seed.
_LAYOUTS_06_5 = [(2, 2), (2, 4), (3, 2), (4, 3), (1, 5), (5, 1), (3, 7)]
_RNG_06_5 = random.Random(65)
_LAYOUTS_06_5 += [(_RNG_06_5.randint(1, 8), _RNG_06_5.randint(1, 16)) for _ in range(6)]


def _run_06_5(fn) -> list[str]:
    for nnodes, nproc in _LAYOUTS_06_5:
        got = {}
        for node in range(nnodes):
            for local in range(nproc):
                raw = call_case(fn, (node, local, nproc),
                                f"(node_rank={node}, local_rank={local}, nproc_per_node={nproc})")
                got[node, local] = returned(raw, "a whole number (the global RANK)", as_whole)
        seen = {}
        for (node, local), rank in got.items():
            if rank in seen:
                (n0, l0) = seen[rank]
                return [f"{nnodes} nodes x {nproc} processes: node {n0}, local rank {l0} and node "
                        f"{node}, local rank {local} would share RANK {rank}; every process "
                        "needs its own."]
            seen[rank] = (node, local)
        for (node, local), rank in got.items():
            want = node * nproc + local
            if rank == want:
                continue
            msg = (f"{nnodes} nodes x {nproc} processes: node {node}, local rank {local} got "
                   f"RANK {rank}, torchrun gives {want}")
            if rank == local * nnodes + node:
                msg += ": torchrun numbers the ranks node by node, not round-robin"
            return [msg + "."]
    return []


register(Exercise(
    "06.5", "global rank from node rank and local rank",
    task="Write global_rank(node_rank, local_rank, nproc_per_node) -> int: the RANK torchrun "
         "gives the process with LOCAL_RANK local_rank on node node_rank (GROUP_RANK).",
    signature="fn(node_rank: int, local_rank: int, nproc_per_node: int) -> int",
    reference=S.global_rank, run_local=_run_06_5,
    checked="every process of 13 layouts, 1 to 8 nodes x 1 to 16 processes"))


# ===================================================================== 07.1 ZeRO-3 ranks

_CASES_07_1 = [(70e9, 80e9), (7.5e9, 80e9), (1e9, 80e9), (70e9, 40e9), (175e9, 80e9),
               (13e9, 24e9)]
# Then sizes drawn from a fixed seed (0.1B to 500B parameters, 16 to 192 GB), some exactly at
# a whole number of ranks: a table of the answers above, or round() instead of ceil, fails.
_RNG_07_1 = random.Random(71)
_CASES_07_1 += [(round(_RNG_07_1.uniform(0.1, 500), 1) * 1e9, _RNG_07_1.choice([16, 24, 40, 48, 80,
                                                                               141, 192]) * 1e9)
                for _ in range(10)]
_CASES_07_1 += [(30e9, 48e9), (0.5e9, 8e9)]  # 10 and 1 ranks exactly


def _run_07_1(fn) -> list[str]:
    from ..memory import memory_per_rank

    for psi, gpu in _CASES_07_1:
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
    "07.1", "fewest ranks for ZeRO-3",
    task="Write min_ranks_zero3(num_params, gpu_bytes) -> int: the fewest ranks on which the "
         "model states of mixed-precision Adam (16 bytes per parameter, ZeRO paper) fit under "
         "ZeRO-3 in gpu_bytes per rank (activations ignored).",
    signature="fn(num_params: float, gpu_bytes: float) -> int",
    reference=S.min_ranks_zero3, run_local=_run_07_1,
    checked="6 models from 1B to 175B parameters on 24, 40 and 80 GB ranks, then 12 more "
            "(0.1B to 500B, 8 to 192 GB; 10 drawn from a fixed seed)"))


# ===================================================================== 07.4 gather shards

_CASES_07_4 = [10, 9, 2, 1, 17]

#: What torch.distributed offers to move data; a call of any of them is recorded (the outermost
#: only: all_gather_object calls all_gather itself) while a candidate runs.
_CALLS_07_4 = ("all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast",
               "broadcast_object_list", "all_reduce", "reduce", "gather", "gather_object",
               "scatter", "scatter_object_list", "reduce_scatter", "reduce_scatter_tensor",
               "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv",
               "batch_isend_irecv")
_ONE_GATHER_07_4 = ("all_gather", "all_gather_into_tensor")


def _call_recording(fn, args, names):
    """``fn(*args)`` with every call of ``torch.distributed.<name>`` recorded by name;
    returns (what fn returned, [names in call order])."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    calls, depth = [], [0]

    def record(name, f):
        def recorded(*a, **k):
            if depth[0] == 0:
                calls.append(name)
            depth[0] += 1
            try:
                return f(*a, **k)
            finally:
                depth[0] -= 1
        return recorded

    patches = {name: record(name, getattr(c10d, name)) for name in names if hasattr(c10d, name)}
    saved = [(mod, name, getattr(mod, name)) for mod in (dist, c10d) for name in patches
             if hasattr(mod, name)]
    try:
        for mod, name, _ in saved:
            setattr(mod, name, patches[name])
        return fn(*args), calls
    finally:
        for mod, name, f in saved:
            setattr(mod, name, f)


def _full_07_4(total):
    return (torch.arange(total, dtype=torch.int64) + 1) * 7


def _rank_07_4(fn, rank, world_size):
    out = []
    for total in _CASES_07_4:
        shard = torch.tensor_split(_full_07_4(total), world_size)[rank].clone()
        got, calls = _call_recording(fn, (shard, total), _CALLS_07_4)
        out.append({"got": returned(got, f"a tensor of {total} elements",
                                    lambda v: torch.as_tensor(v).reshape(-1).tolist()),
                    "calls": calls})
    return out


def _judge_07_4(results) -> list[str]:
    R = len(results)
    for i, total in enumerate(_CASES_07_4):
        want = _full_07_4(total).tolist()
        sizes = [t.numel() for t in torch.tensor_split(torch.empty(total), R)]
        for r in range(R):
            got = [int(v) for v in results[r][i]["got"]]
            if got == want:
                continue
            msg = (f"{total} elements in shards of {', '.join(map(str, sizes))}: rank {r} got "
                   f"{fmt_list(got, limit=12)}, expected {fmt_list(want, limit=12)}")
            if len(got) != len(want):
                msg += (f" ({len(got)} elements instead of {total}). all_gather needs equal "
                        "sizes: pad every shard to the longest, gather, then trim each piece to "
                        "its rank's size")
            elif sorted(got) == sorted(want):
                msg += (
                    ": the right elements in the wrong order; concatenate the pieces in rank order"
                )
            return [msg + "."]
    return _judge_07_4_method(results)


def _judge_07_4_method(results) -> list[str]:
    """The values are right; was it one all-gather, as asked?"""
    R = len(results)
    for i, total in enumerate(_CASES_07_4):
        for r in range(R):
            calls = results[r][i]["calls"]
            counts = Counter(calls)
            gathers = sum(counts[n] for n in _ONE_GATHER_07_4)
            others = [n for n in counts if n not in _ONE_GATHER_07_4]
            if gathers == 1 and not others:
                continue
            made = ", ".join(f"{n} x{c}" if c > 1 else n for n, c in counts.items()) or "none"
            msg = (f"{total} elements over {R} ranks: the values are right, but rank {r} made "
                   f"these calls: {made}. The task asks for one all-gather (dist.all_gather or "
                   "all_gather_into_tensor), one message round in which every rank receives "
                   "every piece")
            if counts["broadcast"] >= 2:
                msg += (f"; {counts['broadcast']} broadcasts are {counts['broadcast']} rounds, "
                        "each waiting for the one before")
            return [msg + "."]
    return []


register(
    Exercise(
        "07.4",
        "all_gather uneven flat shards",
        task="Write gather_flat(shard, total_numel) -> Tensor: the ranks hold the pieces of a flat "
        "tensor of total_numel elements split by torch.tensor_split (the first ranks one "
        "element longer); return the whole tensor on every rank with one all-gather "
        "(dist.all_gather, or all_gather_into_tensor).",
        signature="fn(shard: Tensor (n_r,), total_numel: int) -> Tensor (total_numel,)"
        "   # a collective",
        reference=S.gather_flat,
        kind="distributed",
        world_sizes=(3, 2),
        run_rank=_rank_07_4,
        judge=_judge_07_4,
        checked="3 and 2 processes (torchrun, gloo), 10, 9, 2, 1 and 17 elements; one "
        "all-gather per call",
    )
)
