"""Exercise 02.1: a DistributedSampler index-for-index equal to torch's, at 3 and 2 processes.

Each rank records what its sampler (and its neighbour's) yields on 10 settings in epochs 0
and 1, its ``len``, a second pass, a fresh sampler at a later epoch, and samplers for other
``num_replicas``; the judge compares with :func:`ddp_lesson.sampler.shard_indices`.
"""
from __future__ import annotations

import contextlib
from collections import Counter

from ...sampler import contiguous_shard_indices, num_samples_per_rank, padded_order, shard_indices
from .. import solutions as S
from ..registry import Exercise, register
from ..values import error_record, format_error, ranks_text, shown

# (N, shuffle, drop_last, seed): simple settings first, so the first problem reported is the
# most basic one.
_SETTINGS = [(9, False, False, 0), (10, False, False, 0), (10, True, False, 0),
             (7, True, False, 5), (2, False, False, 0), (1, True, False, 0),
             (0, False, False, 0), (12, True, False, 1), (10, False, True, 0),
             (11, True, True, 3)]
_EPOCHS = (0, 1)
#: A fresh sampler is given set_epoch(_FRESH_EPOCH) before its first pass: an order that
#: follows the number of passes, not the epoch, fails it.
_FRESH_EPOCH = 5
#: Samplers for other world sizes, built in one process for every rank (a sampler needs no
#: process group): a constant 3 standing in for num_replicas fails at these.
_OTHER_R = (2, 5)


class _Items:
    """The dataset a sampler is built over: ``N`` items that are not their indices (item i is
    ``("sample", i)``), so a sampler that yields ``dataset[i]`` rather than ``i`` is seen."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        if not 0 <= int(i) < self.n:
            raise IndexError(f"index {i} out of range for a dataset of {self.n}")
        return ("sample", int(i))


class NotAnIndex(Exception):
    """A sampler yielded something other than a whole number (its text: what it yielded)."""


def _indices(sampler) -> list[int]:
    """What one pass over ``sampler`` yields, as ints; :class:`NotAnIndex` for an item that is
    not a whole number (a bool, a string, a dataset item, a float)."""
    import numbers

    out = []
    for i in iter(sampler):
        if hasattr(i, "dtype") and getattr(i, "ndim", 1) == 0 and "int" in str(i.dtype):
            i = i.item()  # a 0-d integer tensor or numpy integer is an index
        if isinstance(i, bool) or not isinstance(i, numbers.Integral):
            raise NotAnIndex(f"{shown(i)} ({type(i).__name__})")
        out.append(int(i))
    return out


def _rank(cls, rank, world_size):
    out = []
    for n, shuffle, drop_last, seed in _SETTINGS:
        def make(R, r, n=n, shuffle=shuffle, drop_last=drop_last, seed=seed):
            return cls(_Items(n), num_replicas=R, rank=r, shuffle=shuffle, seed=seed,
                       drop_last=drop_last)

        rec = {}
        try:
            sampler = make(world_size, rank)
        except Exception as exc:
            out.append({"construct": error_record(exc)})
            continue
        # the sampler this process builds for its neighbour must match the neighbour's
        with contextlib.suppress(Exception):
            rec["next"] = _indices(make(world_size, (rank + 1) % world_size))
        for epoch in _EPOCHS:
            if epoch:
                if not hasattr(sampler, "set_epoch"):
                    rec["no_set_epoch"] = True
                    break
                sampler.set_epoch(epoch)
            try:
                rec[epoch] = _indices(sampler)
            except NotAnIndex as exc:
                rec["not_index"] = exc.args[0]
                break
            except Exception as exc:
                rec[f"iter{epoch}"] = error_record(exc)
                break
        try:
            rec["len"] = len(sampler)
        except Exception as exc:
            rec["len_error"] = error_record(exc)
        rec["extra"] = _extra(make, sampler, rank, world_size)
        out.append(rec)
    return out


def _extra(make, sampler, rank, world_size) -> dict:
    """What the shortcuts a fixed sequence of calls would miss give: a second pass in the
    same epoch, a fresh sampler given a later epoch first, other world sizes (``make(R, r)``
    builds a sampler). On an error, ``"error"`` is its record, ``"error_in"`` what raised."""
    def orders(R, r, epoch):
        s = make(R, r)
        s.set_epoch(epoch)
        return _indices(s), len(s)

    extra = {}
    try:
        extra["error_in"] = "a second pass in epoch 1 (no set_epoch between)"
        extra["again"] = _indices(sampler)
        extra["error_in"] = f"a fresh sampler given set_epoch({_FRESH_EPOCH})"
        extra["fresh"] = orders(world_size, rank, _FRESH_EPOCH)[0]
        for R in _OTHER_R:
            for r in range(R):
                extra["error_in"] = (f"the sampler built with num_replicas={R}, rank={r} "
                                     "(given set_epoch(2))")
                extra[R, r] = orders(R, r, 2)
        del extra["error_in"]
    except Exception as exc:
        extra["error"] = error_record(exc)
    return extra


def _judge_extra(recs, n, shuffle, drop_last, seed) -> str | None:
    """The checks behind the basic ones: the order depends on seed + epoch only (not on how
    many passes were made), and on the num_replicas and rank arguments (not on constants)."""
    R = len(recs)
    setting = _describe(n, R, shuffle, drop_last, seed)
    for r, rec in enumerate(recs):
        extra = rec["extra"]
        if "error" in extra:
            return (f"{setting}: on rank {r}, {extra['error_in']} raised "
                    f"{format_error(extra['error'])}")
        want = shard_indices(n, R, r, shuffle, seed, _FRESH_EPOCH, drop_last)
        if extra["fresh"] != want:
            msg = (f"{setting}: on rank {r}, a fresh sampler given set_epoch("
                   f"{_FRESH_EPOCH}) yields {extra['fresh']}, torch's yields {want} (the "
                   f"order of epoch {_FRESH_EPOCH})")
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
    return _judge_other_sizes(recs, n, shuffle, drop_last, seed)


def _judge_other_sizes(recs, n, shuffle, drop_last, seed) -> str | None:
    """Samplers built in process 0 for ``num_replicas`` 2 and 5 (every rank, epoch 2) against
    torch's: the first size that differs is named with every rank's list, and a cause only
    where the lists show it (those of num_replicas=3, the checker's own size)."""
    for R2 in _OTHER_R:
        got = [recs[0]["extra"][R2, r][0] for r in range(R2)]
        want = [shard_indices(n, R2, r, shuffle, seed, 2, drop_last) for r in range(R2)]
        per = num_samples_per_rank(n, R2, drop_last)
        where = _describe(n, R2, shuffle, drop_last, seed, 2)
        if got != want:
            r = next(r for r in range(R2) if got[r] != want[r])
            msg = (f"{where}: the sampler built with num_replicas={R2}, rank={r} yields "
                   f"{got[r]}, torch's yields {want[r]} (ranks 0 to {R2 - 1}: yours "
                   f"{', '.join(map(str, got))}; torch's {', '.join(map(str, want))})")
            as_three = [shard_indices(n, 3, q, shuffle, seed, 2, drop_last) for q in range(3)]
            if all(got[q] == as_three[q] for q in range(min(R2, 3))):
                return msg + (". These are the lists of num_replicas=3: use the num_replicas "
                              "argument everywhere (no constant 3: the checker runs 3 processes, "
                              "your training may not).")
            if any(len(g) != per for g in got):
                return (msg + f". Ranks got {', '.join(str(len(g)) for g in got)} indices; "
                        + _padding_sentence(n, R2, shuffle, drop_last, seed, 2) + ".")
            return msg + "."
        for r in range(R2):
            length = recs[0]["extra"][R2, r][1]
            if length != per:
                return (f"{where}: the sampler built with num_replicas={R2}, rank={r} yields "
                        f"{per} indices but len(sampler) says {length}.")
    return None


def _describe(n, R, shuffle, drop_last, seed, epoch=None) -> str:
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
    if drop_last and n % R == 0:
        return (f"with drop_last=True every rank gets {per}: {n} divides by {R}, so no index "
                "is dropped")
    if drop_last:
        return (f"with drop_last=True every rank gets {per} (the order is cut to {per * R}, "
                f"dropping {n - per * R})")
    pad = padded_order(n, R, shuffle, seed, epoch)[n:]
    if not pad:
        return f"every rank gets {per} and no index repeats ({n} divides by {R})"
    which = " and ".join(map(str, pad)) if len(pad) <= 2 else ", ".join(map(str, pad))
    return (f"every rank needs ceil({n}/{R}) = {per}, so the order is padded by wrapping round: "
            f"the padded {'index is' if len(pad) == 1 else 'indices are'} {which}")


def _basic_problem(recs, n, R, shuffle, drop_last, seed) -> str | None:
    """The first problem of one setting short of the checks in :func:`_judge_extra`."""
    setting = _describe(n, R, shuffle, drop_last, seed)
    for r, rec in enumerate(recs):
        if "construct" in rec:
            return (f"{setting}: cls(dataset, num_replicas={R}, rank={r}, shuffle={shuffle}, "
                    f"seed={seed}, drop_last={drop_last}) raised "
                    f"{format_error(rec['construct'])}. Keep torch's signature.")
        if "not_index" in rec:
            return (f"{setting}: rank {r}'s sampler yielded {rec['not_index']}, not an "
                    "index: a sampler yields indices i into the dataset (whole numbers "
                    "0 to N-1); the DataLoader reads dataset[i] itself. (The checker's "
                    "dataset item i is ('sample', i).)")
        failed = next((rec[f"iter{e}"] for e in _EPOCHS if f"iter{e}" in rec), None)
        if failed is not None:
            problem = f"{setting}: iterating rank {r}'s sampler raised {format_error(failed)}"
            if 0 < n < R and not drop_last:
                per = num_samples_per_rank(n, R, False)
                problem += (f". Here N={n} is below R={R}: to give every rank {per} "
                            f"{'index' if per == 1 else 'indices'}, the order must wrap "
                            "round more than once (case A7)")
            return problem
        if rec.get("no_set_epoch"):
            return ("the sampler has no set_epoch(epoch) method: without it every epoch "
                    "repeats the same order (case A1)")
        if "len_error" in rec:
            problem = (f"len(sampler) raised {format_error(rec['len_error'])}: a DataLoader "
                       "and progress bars need __len__")
            if "has no len()" in rec["len_error"]["message"]:
                problem += (", and this class defines none (the seed's __len__ was "
                            "indented into __iter__, so its class had none either)")
            return problem
    problem = _judge_epochs(recs, n, R, shuffle, drop_last, seed)
    if problem:
        return problem
    per = num_samples_per_rank(n, R, drop_last)
    for r, rec in enumerate(recs):
        if rec["len"] != per:
            return (f"{setting}: rank {r} yields {per} indices but len(sampler) "
                    f"says {rec['len']}; the DataLoader and progress bars trust "
                    "__len__, so it must equal num_samples")
        nxt = (r + 1) % R
        if "next" in rec and rec["next"] != recs[nxt][0]:
            problem = (f"{setting}: the sampler built with rank={nxt} in process {r} "
                       f"gives {rec['next']}, but rank {nxt}'s own gives {recs[nxt][0]}")
            if rec["next"] == recs[r][0]:  # process r's own list: the group's rank
                return problem + (f"; that is process {r}'s own list: use the rank and "
                                  "num_replicas arguments (as torch does), not the process "
                                  "group's")
            return problem + (": the indices must follow the rank and num_replicas "
                              "arguments only, as torch's")
    return None


def _judge(results) -> list[str]:
    R = len(results)
    recs = [[results[r][k] for r in range(R)] for k in range(len(_SETTINGS))]
    problems = [p for k, setting in enumerate(_SETTINGS)
                if (p := _basic_problem(recs[k], setting[0], R, *setting[1:]))]
    if len(problems) > 1:
        problems[0] += f" ({len(problems)} of {len(_SETTINGS)} settings fail)"
    if problems:
        return problems[:1]
    for k, setting in enumerate(_SETTINGS):  # the basic checks pass: the shortcuts they miss
        problem = _judge_extra(recs[k], *setting)
        if problem:
            return [problem]
    return []


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


def _judge_epochs(recs, n, R, shuffle, drop_last, seed):
    per = num_samples_per_rank(n, R, drop_last)
    for epoch in _EPOCHS:
        setting = _describe(n, R, shuffle, drop_last, seed, epoch)
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
        if Counter(i for g in got for i in g) != wanted:
            return _coverage_problem(got, wanted, setting, n, R, shuffle, drop_last, seed, epoch)
        r = next(r for r in range(R) if got[r] != want[r])
        return (f"{setting}: every index is covered, but rank {r} got {got[r]} where torch's "
                f"DistributedSampler gives {want[r]}.")
    return None


def _coverage_problem(got, wanted, setting, n, R, shuffle, drop_last, seed, epoch) -> str:
    """The ranks' lists have the right lengths but not torch's indices (``wanted`` counts
    them): name an index a rank holds twice, one on too many ranks, or one missing; and, for
    a shuffled order, whether the lists interleave to one permutation at all."""
    per = len(got[0])
    have = Counter(i for g in got for i in g)
    msg = f"{setting}: every rank got {per} indices, but they are not torch's"
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
            msg = (f"{setting}: index {i} is on ranks {ranks_text(on)}; "
                   + _padding_sentence(n, R, shuffle, drop_last, seed, epoch))
        if missing:
            i = missing[0]
            where = ("on no rank" if not have[i] else
                     f"there {have[i]} time(s) in all, {wanted[i]} expected")
            msg += (";" if extra else ":") + f" index {i} is {where}"
    order = [g[k] for k in range(per) for g in got]
    shared = (len(set(order)) == len(order) if drop_last
              else sorted(order[:n]) == list(range(n)))
    if shuffle and not shared:
        msg += (". The ranks' lists do not interleave to one permutation of range(N): "
                "every rank must draw the same one, seeded with seed + epoch, never "
                "with the rank (case A2)")
    return msg + "."


register(Exercise(
    "02.1", "a DistributedSampler equal to torch's",
    task="Write a Sampler class with torch's signature, cls(dataset, num_replicas, rank, "
         "shuffle=True, seed=0, drop_last=False), with set_epoch(epoch), __iter__ and __len__, "
         "that yields, on each rank, exactly the indices torch.utils.data.DistributedSampler "
         "yields.",
    signature="cls(dataset, num_replicas=R, rank=r, shuffle=..., seed=..., drop_last=...)",
    reference=S.DistributedSampler, kind="distributed", world_sizes=(3, 2),
    run_rank=_rank, judge=_judge,
    checked="3 and 2 processes (torchrun, gloo), N = 0, 1, 2, 7, 9, 10, 11, 12, shuffle and "
            "drop_last on and off, epochs 0, 1 (twice) and 5 (a fresh sampler); "
            "num_replicas 2 and 5 in one process"))
