"""Exercise 07.6: find the stuck rank in the flight-recorder records of a hung job.

Hangs in the format torch 2.13's flight recorder dumps on gloo (as
:func:`ddp_lesson.flight.load_dumps` returns them): seven built by hand, each with a trap a
shortcut falls into, then :data:`DRAWN` drawn anew each check (:func:`drawn_hangs`), so a table
of answers does not pass; ``DDP_LESSON_CHECK_SEED`` fixes the seed, which a verdict names.
"""
from __future__ import annotations

import copy
import json
import os
import random

from .. import solutions as S
from ..registry import Exercise, register
from ..values import call_case, returned


def _entry(seq, op="all_reduce", size=(4,), group="0", p2p=0, line=40, dtype="Float"):
    return {"collective_seq_id": 0 if p2p else seq, "p2p_seq_id": p2p,
            "profiling_name": f"gloo:{op}", "input_sizes": [list(size)],
            "input_dtypes": [dtype], "process_group": (group, ""), "is_p2p": bool(p2p),
            "frames": [{"filename": "/job/train.py", "line": line, "name": "train_step"}]}


def _dump(world, entries, done, last=None):
    """One rank's record: ``done`` maps a group to its last completed sequence id, ``last``
    (default: ``done``) to its last enqueued and started one."""
    last = done if last is None else last
    return {"version": "2.10",
            "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": json.dumps(
                list(range(world)))}},
            "pg_status": {g: {"last_enqueued_collective": last.get(g, n),
                              "last_started_collective": last.get(g, n),
                              "last_completed_collective": n} for g, n in done.items()},
            "entries": entries}


def _run(first, last, **kw):
    return [_entry(s, **kw) for s in range(first, last + 1)]


def _hangs():
    """name -> (dumps, (rank, seq, op) expected, what the trap is)."""
    h = {}
    h["rank 2 never calls #4"] = ({
        0: _dump(3, _run(1, 4), {"0": 3}), 1: _dump(3, _run(1, 4), {"0": 3}),
        2: _dump(3, _run(1, 3), {"0": 3})}, (2, 4, "all_reduce"),
        "every rank completed #3, so the completion states tie; the rank that never issued #4 "
        "is the one that diverged (the others wait in it)")
    odd = _run(1, 2) + [_entry(3, op="broadcast")]
    h["rank 1 broadcasts where the others all-reduce"] = ({
        r: _dump(4, odd if r == 1 else _run(1, 3), {"0": 2}) for r in range(4)},
        (1, 3, "broadcast"), "every rank issued #3 and has as many entries; rank 1's #3 is "
        "another op than the majority's")
    big = _run(1, 5, size=(10,))
    h["rank 0 all-reduces a larger tensor"] = ({
        0: _dump(3, big + [_entry(6, size=(1000,))], {"0": 5}),
        1: _dump(3, big + [_entry(6, size=(999,))], {"0": 5}),
        2: _dump(3, big + [_entry(6, size=(999,))], {"0": 5})}, (0, 6, "all_reduce"),
        "same op everywhere: the shapes ([1000] against [999]) differ")
    h["ring buffers dropped different old entries"] = ({
        0: _dump(3, _run(5, 10), {"0": 9}), 1: _dump(3, _run(4, 9), {"0": 9}),
        2: _dump(3, _run(5, 10), {"0": 9})}, (1, 10, "all_reduce"),
        "each buffer keeps its last 6 entries, so rank 1 still holds #4 and the others do "
        "not; compare from the latest first id of any rank on")
    def grouped(sub: str, subs: int, gather: bool):
        """The default group's #1-#3 (and #4 all_gather), each followed by one of subgroup
        ``sub``'s first ``subs`` collectives (ids of its own, from 1)."""
        out = []
        for s in range(1, 4):
            out.append(_entry(s, size=(8,)))
            if s <= subs:
                out.append(_entry(s, size=(3,), group=sub))
        return out + ([_entry(4, op="all_gather", size=(2,))] if gather else [])

    h["subgroups with sequence ids of their own"] = ({
        0: _dump(4, grouped("1", 2, True), {"0": 3, "1": 2}),
        1: _dump(4, grouped("1", 2, True), {"0": 3, "1": 2}),
        2: _dump(4, grouped("2", 3, True), {"0": 3, "2": 3}),
        3: _dump(4, grouped("2", 3, False), {"0": 3, "2": 3})}, (3, 4, "all_gather"),
        "subgroups number their collectives from 1 too (process_group[0] is '1', '2'): "
        "compare the default group's ('0') entries only")
    p2p0 = [_entry(0, op="send", p2p=1), _entry(0, op="send", p2p=2)]
    p2p1 = [_entry(0, op="recv", p2p=1), _entry(0, op="recv", p2p=2)]
    h["point-to-point entries between the collectives"] = ({
        0: _dump(2, _run(1, 1) + p2p0 + [_entry(2), _entry(3, op="all_gather")], {"0": 2}),
        1: _dump(2, _run(1, 1) + p2p1 + [_entry(2)], {"0": 2})}, (1, 3, "all_gather"),
        "sends and recvs (is_p2p: True) have no collective sequence id (0) and differ "
        "between the ranks by nature: leave them out")
    h["a failed collective retired as completed"] = ({
        0: _dump(3, _run(1, 5), {"0": 5}), 1: _dump(3, _run(1, 4), {"0": 4}),
        2: _dump(3, _run(1, 5), {"0": 5})}, (1, 5, "all_reduce"),
        "ranks 0 and 2 timed out in #5 and torch retired it as completed, so no rank has an "
        "unfinished collective; rank 1 never issued #5")
    return h


#: How many hangs each check draws from the family, after the seven built by hand.
DRAWN = 16
_KINDS = ("missing", "op", "shape", "dtype")
_TRAPS = ("lagging status", "ring buffers", "subgroups", "point-to-point", "retired failure")
_OPS = ("all_reduce", "broadcast", "all_gather", "reduce_scatter")
_DTYPES = ("Float", "BFloat16", "Half", "Long")


def check_seed() -> int:
    """The seed of this check's drawn hangs: ``DDP_LESSON_CHECK_SEED`` when set, else a new
    one each call (a verdict names it)."""
    env = os.environ.get("DDP_LESSON_CHECK_SEED", "").strip()
    return int(env) if env else random.SystemRandom().randrange(1, 10 ** 6)


def drawn_hangs(seed: int, count: int = DRAWN) -> dict:
    """``count`` hangs drawn from the family with ``seed``: name -> (dumps, (rank, seq, op),
    what the trap is), like the hand-built ones. Hang j diverges by ``_KINDS[j % 4]`` and has
    trap ``_TRAPS[j % 5]`` (others at random), so every kind meets every trap within 20."""
    rng = random.Random(seed)
    out = {}
    for j in range(count):
        name, hang = _draw(rng, _KINDS[j % len(_KINDS)], _TRAPS[j % len(_TRAPS)])
        out[f"{j + 1} of seed {seed}: {name}"] = hang
    return out


def _draw(rng: random.Random, kind: str, trap: str):
    """One hang of ``kind`` with ``trap`` (and maybe other traps): (name, (dumps, want, why))."""
    R = rng.randint(2 if kind == "missing" else 3, 6)  # a minority needs 3 ranks
    s = rng.randint(4, 14)  # the sequence id that diverges
    guilty = rng.randrange(R)
    traps = {trap} | {t for t in _TRAPS if rng.random() < 0.25}
    # the collectives every rank issued alike, #1 .. #s (the last one may diverge)
    sig = {q: (rng.choice(_OPS), (rng.choice((4, 8, 16, 1000)),), rng.choice(_DTYPES))
           for q in range(1, s + 1)}
    op, size, dtype = sig[s]
    odd = {"op": (rng.choice([o for o in _OPS if o != op]), size, dtype),
           "shape": (op, (size[0] + rng.choice((-1, 1, 8)),), dtype),
           "dtype": (op, size, rng.choice([d for d in _DTYPES if d != dtype]))}.get(kind)
    entries, done = {}, {}
    for r in range(R):
        last = s - 1 if kind == "missing" and r == guilty else s
        mine = [_entry(q, *sig[q][:2], dtype=sig[q][2], line=30 + q) for q in range(1, last + 1)]
        if odd and r == guilty:
            mine[-1] = _entry(s, odd[0], odd[1], dtype=odd[2], line=30 + s)
        entries[r], done[r] = mine, s - 1
    why = []
    if "ring buffers" in traps:  # each buffer kept a different number of the latest entries
        drops = [rng.randint(0, s - 3) for _ in range(R)]
        if len(set(drops)) == 1:
            drops[rng.randrange(R)] = (drops[0] + 1) % (s - 2)
        for r in range(R):
            entries[r] = entries[r][drops[r]:]
        why.append("the ring buffers dropped different old entries (compare from the latest "
                   "first id of any rank on)")
    if "retired failure" in traps:  # the ranks that waited in #s timed out: retired, completed
        for r in range(R):
            if r != guilty:
                done[r] = s
        why.append(f"the ranks that waited in #{s} timed out and it was retired as completed")
    if "lagging status" in traps:  # a status written before the rank saw its last completions
        innocent = [r for r in range(R) if r != guilty]
        for r in rng.sample(innocent, rng.randint(1, len(innocent))):
            done[r] = max(0, s - 1 - rng.randint(1, 3))
        why.append("last_completed_collective lags on some ranks (it is written after the "
                   "fact; ddp_lesson.flight.completed_through)")
    subs = {"1": rng.randint(1, 3), "2": rng.randint(4, 6)}  # subgroup collectives per group
    dumps = {}
    for r in range(R):
        mine, status = entries[r], {"0": done[r]}
        if "subgroups" in traps:  # two subgroups numbering from 1, interleaved with group 0's
            sub = "1" if r % 2 == 0 else "2"
            mixed = []
            for k, e in enumerate(mine):
                mixed.append(e)
                if k < subs[sub]:
                    mixed.append(_entry(k + 1, "all_reduce", (3 + int(sub),), group=sub,
                                        line=90))
            mine, status[sub] = mixed, min(subs[sub], len(entries[r]))
        if "point-to-point" in traps and len(mine) > 1:
            at = rng.randint(1, len(mine) - 1)
            p2p = [_entry(0, "send" if r % 2 == 0 else "recv", p2p=k + 1)
                   for k in range(1 + r % 2)]
            mine = mine[:at] + p2p + mine[at:]
        issued = entries[r][-1]["collective_seq_id"]
        dumps[r] = _dump(R, mine, status, {"0": max(done[r], issued)})
    if "subgroups" in traps:
        why.append("subgroups ('1', '2') number their collectives from 1 too: compare the "
                   "default group's ('0') entries only")
    if "point-to-point" in traps:
        why.append("send/recv entries (is_p2p) differ between the ranks by nature: leave them "
                   "out")
    odd = odd or sig[s]  # for "missing": what the others issued
    what = {"missing": f"rank {guilty} never issues #{s}",
            "op": f"rank {guilty} issues #{s} as another op",
            "shape": f"rank {guilty} issues #{s} with another shape",
            "dtype": f"rank {guilty} issues #{s} with another dtype"}[kind]
    why.insert(0, {"dtype": f"same op and shape everywhere: the dtypes ({odd[2]} against "
                            f"{dtype}) differ",
                   "shape": f"same op everywhere: the shapes ({list(odd[1])} against "
                            f"{list(size)}) differ",
                   "op": f"rank {guilty}'s #{s} is {odd[0]}, the others' {op}",
                   "missing": f"rank {guilty} never issued #{s}; the others wait in it"}[kind])
    return what, (dumps, (guilty, s, odd[0]), "; ".join(why))


def _answer(value):
    rank, seq, op = value
    if isinstance(rank, bool) or isinstance(seq, bool):
        raise TypeError("a bool")
    return int(rank), int(seq), str(op).split(":", 1)[-1]


def _run_local(fn, seed: int | None = None) -> list[str]:
    """The seven hand-built hangs, then :data:`DRAWN` drawn with ``seed`` (default:
    :func:`check_seed`); the first wrong answer's verdict names the hang (and the seed)."""
    seed = check_seed() if seed is None else seed
    for name, (dumps, want, trap) in {**_hangs(), **drawn_hangs(seed)}.items():
        got = returned(call_case(fn, (copy.deepcopy(dumps),), f"'{name}'"),
                       "(rank, sequence id, op), e.g. (2, 4, 'all_reduce')", _answer)
        if got != want:
            again = (f" (to draw these hangs again: DDP_LESSON_CHECK_SEED={seed})"
                     if " of seed " in name else "")
            return [f"hang '{name}' ({len(dumps)} ranks): you named rank {got[0]}, "
                    f"#{got[1]} {got[2]}; the records say rank {want[0]}, #{want[1]} "
                    f"{want[2]}: {trap}{again}."]
    return []


register(Exercise(
    "07.6", "find the stuck rank",
    task="Write fn(dumps) -> (rank, seq, op): dumps is {rank: record} for every rank of a hung "
         "job, each record what torch's flight recorder dumps (as ddp_lesson.flight.load_dumps "
         "returns it: 'entries', each with 'collective_seq_id', 'profiling_name' like "
         "'gloo:all_reduce', 'input_sizes', 'input_dtypes', 'process_group' (name, desc), "
         "'is_p2p'; 'pg_status'[group]['last_completed_collective']). Return the rank that "
         "diverged in the default process group ('0') and the collective: the first sequence "
         "id some rank never issued (that rank) or issued with another op, shape or dtype "
         "than the majority (that rank), and the op of that collective ('all_reduce').",
    signature="fn(dumps: dict[int, dict]) -> tuple[int, int, str]",
    reference=S.stuck_rank, kind="local",
    run_local=_run_local,
    checked=f"7 recorded hangs of 2 to 4 ranks (ties in completion, dropped ring-buffer "
            f"entries, shapes, subgroups, point-to-point entries, a retired failure), then "
            f"{DRAWN} drawn anew each check (2 to 6 ranks; a missing collective, another op, "
            "shape or dtype; a lagging last_completed_collective)"))
