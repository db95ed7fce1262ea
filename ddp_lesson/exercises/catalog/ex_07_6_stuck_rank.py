"""Exercise 07.6: find the stuck rank in the flight-recorder records of a hung job.

Seven recorded hangs, built by hand in the format torch 2.13's flight recorder dumps on gloo
(what :func:`ddp_lesson.flight.load_dumps` returns: ``{rank: dump}``, each dump with
``pg_config``, ``pg_status`` and ``entries``), each with a trap a plausible shortcut falls
into: completion states that tie, ring buffers that dropped different old entries, shapes that
differ where the ops agree, subgroups with sequence ids of their own, point-to-point entries,
and a failed collective retired as completed. The candidate must name the rank and the
collective (sequence id and op) that diverged.
"""
from __future__ import annotations

import copy
import json

from .. import solutions as S
from ..registry import Exercise, register
from ..values import call_case, returned


def _entry(seq, op="all_reduce", size=(4,), group="0", p2p=0, line=40):
    return {"collective_seq_id": 0 if p2p else seq, "p2p_seq_id": p2p,
            "profiling_name": f"gloo:{op}", "input_sizes": [list(size)],
            "input_dtypes": ["Float"], "process_group": (group, ""), "is_p2p": bool(p2p),
            "frames": [{"filename": "/job/train.py", "line": line, "name": "train_step"}]}


def _dump(world, entries, done):
    """One rank's record: ``done`` maps a group to its last completed sequence id."""
    return {"version": "2.10",
            "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": json.dumps(
                list(range(world)))}},
            "pg_status": {g: {"last_enqueued_collective": n, "last_started_collective": n,
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


def _answer(value):
    rank, seq, op = value
    if isinstance(rank, bool) or isinstance(seq, bool):
        raise TypeError("a bool")
    return int(rank), int(seq), str(op).split(":", 1)[-1]


def _run_local(fn) -> list[str]:
    for name, (dumps, want, trap) in _hangs().items():
        got = returned(call_case(fn, (copy.deepcopy(dumps),), f"'{name}'"),
                       "(rank, sequence id, op), e.g. (2, 4, 'all_reduce')", _answer)
        if got != want:
            return [f"hang '{name}' ({len(dumps)} ranks): you named rank {got[0]}, "
                    f"#{got[1]} {got[2]}; the records say rank {want[0]}, #{want[1]} "
                    f"{want[2]}: {trap}."]
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
    checked="7 recorded hangs of 2 to 4 ranks (ties in completion, dropped ring-buffer "
            "entries, shapes, subgroups, point-to-point entries, a retired failure)"))
