"""Which rank, which collective? A reader of torch's flight-recorder dumps, for gloo and NCCL.

    python -m ddp_lesson.flight DIR [--prefix trace_]

torch's flight recorder keeps, in every rank, a ring buffer of the collectives it issued
(sequence id, op, tensor sizes and dtypes, the calling Python stack, completed or not); torch
2.13 records on gloo as well as NCCL (``TORCH_FR_BUFFER_SIZE`` unset), and
``torch._C._distributed_c10d._dump_fr_trace()`` returns the pickled record (``{"version",
"pg_config", "pg_status", "entries", ...}``). Each rank writes it to ``DIR/<prefix><rank>``
(:func:`write_trace`; NCCL's watchdog itself under ``TORCH_NCCL_DUMP_ON_TIMEOUT=1``, to the
prefix ``TORCH_FR_DUMP_TEMP_FILE``, older name ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``, both in
torch 2.13's and 2.14.1's ``libtorch_cpu.so``); this module prints each rank's last completed
and first unfinished collective, then one verdict line naming the rank and collective that
diverged. torch's own ``python -m torch.distributed.flight_recorder.fr_trace DIR`` stops on
torch 2.13's gloo dumps with ``KeyError: ('0', 0)`` (``pg_config`` keyed by the group's
description ``''``, entries by its name ``'0'``: ``tests/collectives/test_flight.py``).
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import re
import sys
from dataclasses import dataclass
from pathlib import Path

#: A frame inside torch itself (its wrappers around the call), skipped when naming the caller.
_TORCH_FRAME = re.compile(r"[/\\]torch[/\\]")
_RANK_FILE = re.compile(r"^(?P<prefix>.*?)(?P<rank>\d+)$")


@dataclass(frozen=True)
class Collective:
    """One recorded collective of one rank: ``seq`` its sequence id in the group (1, 2, ...,
    the same on every rank), ``op`` (``"all_reduce"``: torch's ``profiling_name`` without
    ``gloo:``), input ``sizes`` and ``dtypes`` (``"Float"``), ``caller`` the first frame outside
    torch as ``file:line`` (``"?"``: recorded without stacks)."""

    seq: int
    op: str
    sizes: tuple
    dtypes: tuple
    caller: str

    def text(self) -> str:
        """``#3 all_reduce [3] Float (job.py:9)``."""
        sizes = ", ".join(str(list(s)) for s in self.sizes) or "[]"
        parts = [f"#{self.seq}", self.op, sizes, "/".join(self.dtypes), self.at()]
        return " ".join(p for p in parts if p)  # a barrier has no dtype

    def at(self) -> str:
        """``(job.py:9)``, or nothing when the record has no stack (dumped without one)."""
        return "" if self.caller == "?" else f"({self.caller})"

    def signature(self) -> tuple:
        """What must be equal on every rank for the collective to match."""
        return self.op, self.sizes, self.dtypes


@dataclass(frozen=True)
class RankLedger:
    """One rank's place in process group ``group`` (``"0"``: the default), from its dump:
    the last collective completed and the first issued and not completed (or None)."""

    rank: int
    group: str
    last_completed: Collective | None
    first_unfinished: Collective | None

    def lines(self) -> list[str]:
        """Two short lines, one fact each."""
        done = self.last_completed.text() if self.last_completed else "none"
        todo = self.first_unfinished.text() if self.first_unfinished else "none"
        return [f"rank {self.rank} last completed: {done}",
                f"rank {self.rank} first unfinished: {todo}"]


def write_trace(directory: str | os.PathLike, rank: int, prefix: str = "trace_",
                stacks: bool = True) -> Path:
    """Write this rank's flight record to ``directory/<prefix><rank>``; returns the path.

    Local, no communication: safe while a collective hangs or after it failed (then it reads
    as completed: :func:`verdict`). ``stacks=False`` leaves the callers' stacks out: a process's
    first dump with stacks imports ``torch._dynamo``, a few CPU-seconds (torch 2.13).
    """
    from torch._C._distributed_c10d import _dump_fr_trace

    path = Path(directory) / f"{prefix}{rank}"
    path.parent.mkdir(parents=True, exist_ok=True)
    data = _dump_fr_trace(includeStackTraces=stacks)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)  # a reader never sees half a dump
    return path


def dump_when_stuck(directory: str | os.PathLike, rank: int, after_s: float,
                    prefix: str = "trace_", stacks: bool = True):
    """A thread that writes this rank's record after ``after_s`` seconds (the hang, its
    collective unfinished) unless the ``threading.Event`` returned first is set. Returns
    ``(ok, thread)``; join ``thread`` before the process exits, or the dump is cut short."""
    import threading

    ok = threading.Event()

    def watch():
        if not ok.wait(after_s):
            write_trace(directory, rank, prefix, stacks)

    thread = threading.Thread(target=watch, name="flight-dump", daemon=True)
    thread.start()
    return ok, thread


class HangWatch:
    """A thread that writes this rank's flight record *during* a hang, the stuck collective
    still unfinished.

    Every ``poll_s`` seconds it reads the record without stacks (local, cheap); once one
    collective of the default group has stayed issued and not completed for ``stuck_s``
    seconds (keep it under the group's timeout), it writes the record (:func:`write_trace`)
    before the timeout fails the collective and torch retires it as completed. A collective
    that was only slow makes that record stale once a later one is issued (the thread writes
    again on a later hang), and :meth:`finish` writes the final state of a rank that ended
    without error or whose record is stale or missing: what a record shows depends on where
    the rank stopped, not on the machine's speed.

    The job's own race: a rank that fails outside a collective and exits closes its
    connections, and a peer entering a collective with it then fails at once (gloo's
    "Connection closed by peer") before being recorded stuck, or is stopped by torchrun with no
    record. So :meth:`finish` marks the record final (``<prefix><rank>.final``, holding the
    launch's id), and ``finish(failed=True, world_size=...)`` waits (:meth:`wait_for_peers`)
    until every rank's record is final before the failed rank exits (the clinic's
    ``model_mismatch`` on a loaded machine had both outcomes before).

    ``stacks``: record the callers' ``file:line``; the slow first dump with stacks (it imports
    ``torch._dynamo``) is done at construction, so the hang's dump is quick.
    """

    def __init__(self, directory: str | os.PathLike, rank: int, stuck_s: float,
                 prefix: str = "trace_", stacks: bool = False, poll_s: float = 0.1):
        import threading

        from torch._C._distributed_c10d import _dump_fr_trace

        if stacks:
            _dump_fr_trace(includeStackTraces=True)  # the slow first one, off the clock
        self.args = (directory, rank, prefix, stacks)
        self.stuck_s, self.poll_s = stuck_s, poll_s
        self.written: Path | None = None
        self._stuck_in = None  # the sequence id the written record shows stuck; None: stale
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="flight-watch", daemon=True)
        self._thread.start()

    def _status(self) -> tuple[int, int]:
        """``(last issued, last completed)`` sequence ids of the default group, now; marks a
        record written while stuck stale once a later collective was issued."""
        from torch._C._distributed_c10d import _dump_fr_trace

        dump = pickle.loads(_dump_fr_trace(includeStackTraces=False))
        status = dump.get("pg_status", {}).get("0", {})
        issued = int(status.get("last_enqueued_collective", -1))
        if self._stuck_in is not None and issued > self._stuck_in:
            self._stuck_in = None
        return issued, completed_through(dump, "0")

    def _watch(self) -> None:
        import time

        pending, since = None, 0.0
        while not self._done.wait(self.poll_s):
            issued, completed = self._status()
            if issued <= completed:
                pending = None
            elif issued != pending:
                pending, since = issued, time.monotonic()
            elif time.monotonic() - since >= self.stuck_s and self._stuck_in != issued:
                self.written = write_trace(*self.args)
                self._stuck_in = issued

    def finish(self, failed: bool = False, world_size: int | None = None,
               timeout_s: float = 60.0) -> Path:
        """Stop watching, write the record unless ``failed`` with a current stuck record (a
        write now would show the failed collective completed), mark it final, and return its
        file. Call it before the process group is destroyed.

        ``failed`` with ``world_size``: then wait (:meth:`wait_for_peers`, at most
        ``timeout_s`` s) until every rank's record is final (the class docstring); without
        ``world_size`` (the join failed: no peer to wait for) nothing waits."""
        self._done.set()
        self._thread.join()
        self._status()  # the rank's final count: did it go on after the record was written?
        if not failed or self._stuck_in is None:
            self.settle()
            self.written = write_trace(*self.args)
        final = self._final_path(self.args[1])
        tmp = final.with_name(final.name + ".tmp")
        tmp.write_text(_launch_id())
        os.replace(tmp, final)  # a peer never reads half a mark
        if failed and world_size is not None:
            self.wait_for_peers(world_size, timeout_s)
        return self.written

    def settle(self, timeout_s: float = 3.0, poll_s: float = 0.02) -> bool:
        """Wait (at most ``timeout_s`` s) until every collective this rank issued is marked
        completed; returns whether they all were. torch marks one completed a moment after the
        call returned, from the work's thread (a failed rank's record showed its barrier
        unfinished, 1 of 2 loaded runs); only a really pending ``async_op`` waits it out.
        """
        import time

        deadline = time.monotonic() + timeout_s
        while True:
            issued, completed = self._status()
            if issued <= completed:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(poll_s)

    def _final_path(self, rank: int) -> Path:
        directory, _, prefix, _ = self.args
        return Path(directory) / f"{prefix}{rank}.final"

    def wait_for_peers(self, world_size: int, timeout_s: float, poll_s: float = 0.05) -> list[int]:
        """Wait until every rank ``0 .. world_size - 1`` of this launch (an earlier launch's
        mark does not count) has marked its record final, at most ``timeout_s`` s. Synchronises
        the ranks through the folder, no collective, so it cannot hang on the failure.

        Returns:
            the ranks whose record was still not final (sorted; empty when all are).
        """
        import time

        me, deadline = _launch_id(), time.monotonic() + timeout_s
        while True:
            missing = []
            for rank in range(world_size):
                try:
                    if self._final_path(rank).read_text() == me:
                        continue
                except OSError:
                    pass
                missing.append(rank)
            if not missing or time.monotonic() >= deadline:
                return missing
            time.sleep(poll_s)


def _launch_id() -> str:
    """This launch's id, the same on all its ranks: torchrun's run id (a fresh uuid per
    ``--standalone`` launch) and restart count, else the rendezvous address."""
    env = os.environ
    return ":".join((env.get("TORCHELASTIC_RUN_ID", ""), env.get("TORCHELASTIC_RESTART_COUNT", ""),
                     env.get("MASTER_ADDR", ""), env.get("MASTER_PORT", "")))


def _caller(frames) -> str:
    for frame in frames or ():
        name = frame.get("filename", "")
        if name and not _TORCH_FRAME.search(name):
            return f"{os.path.basename(name)}:{frame.get('line', '?')}"
    return "?"


def _collective(entry: dict) -> Collective:
    op = str(entry.get("profiling_name", "?")).split(":", 1)[-1]
    return Collective(int(entry["collective_seq_id"]), op,
                      tuple(tuple(s) for s in entry.get("input_sizes") or ()),
                      tuple(entry.get("input_dtypes") or ()), _caller(entry.get("frames")))


def load_dumps(directory: str | os.PathLike, prefix: str | None = None) -> dict[int, dict]:
    """``{rank: dump}`` for every ``<prefix><rank>`` file in ``directory`` (pickle or JSON).

    Raises:
        FileNotFoundError: no dump file there.
        ValueError: files with different prefixes and no ``prefix`` given.
    """
    files = {}
    for path in sorted(Path(directory).iterdir()):
        m = _RANK_FILE.match(path.name)  # "trace_0.tmp" (a dump being written) does not match
        if path.is_file() and m and (prefix is None or m["prefix"] == prefix):
            files.setdefault(m["prefix"], {})[int(m["rank"])] = path
    if not files:
        raise FileNotFoundError(f"no flight-recorder dump (<prefix><rank>) in {directory}")
    if len(files) > 1:
        raise ValueError(f"dumps with several prefixes in {directory}: {sorted(files)}; "
                         "pass --prefix")
    dumps = {}
    for rank, path in next(iter(files.values())).items():
        raw = path.read_bytes()
        dumps[rank] = json.loads(raw) if raw[:1] == b"{" else pickle.loads(raw)
    return dumps


def _group_entries(dump: dict, group: str) -> list[dict]:
    """The raw entries of ``group``'s collectives in one rank's record (point-to-point left out)."""
    return [e for e in dump.get("entries", ())
            if str(e.get("process_group", ("0",))[0]) == group and not e.get("is_p2p")]


def _issued(dump: dict, group: str) -> list[Collective]:
    return [_collective(e) for e in _group_entries(dump, group)]


def completed_through(dump: dict, group: str = "0") -> int:
    """The sequence id through which ``group``'s collectives completed in one rank's record
    (-1: none): the larger of ``last_completed_collective`` and the last ``retired`` entry's
    id (the status alone lags: a gloo record held 2 with all three entries retired, torch 2.13).
    """
    status = dump.get("pg_status", {}).get(group, {})
    retired = [int(e["collective_seq_id"]) for e in _group_entries(dump, group)
               if e.get("retired") is True]
    return max([int(status.get("last_completed_collective", -1)), *retired])


def ledgers(dumps: dict[int, dict], group: str = "0") -> list[RankLedger]:
    """Every rank's :class:`RankLedger` in process group ``group`` (``"0"``: the default);
    completed means through :func:`completed_through`."""
    out = []
    for rank in sorted(dumps):
        done = completed_through(dumps[rank], group)
        seen = _issued(dumps[rank], group)
        last = next((c for c in reversed(seen) if c.seq <= done), None)
        first = next((c for c in seen if c.seq > done), None)
        out.append(RankLedger(rank, group, last, first))
    return out


def _group_ranks(dumps: dict[int, dict]) -> list[int]:
    for dump in dumps.values():
        for config in dump.get("pg_config", {}).values():
            ranks = config.get("ranks")
            if isinstance(ranks, str):
                return json.loads(ranks)
    return sorted(dumps)


def first_divergence(dumps: dict[int, dict], group: str = "0"):
    """The first collective the ranks' records disagree on, or None when they all match.

    Sequence ids are compared from the latest first id of any rank on (a ring buffer drops a
    rank's oldest entries), point-to-point entries left out.

    Returns:
        ``(seq, have, missing)``: the sequence id, ``{rank: Collective}`` for the ranks that
        issued it, and the sorted ranks (among ``dumps``) that never did; when ``missing`` is
        empty the ranks issued it with different ops, shapes or dtypes.
    """
    issued = {r: {c.seq: c for c in _issued(dumps[r], group)} for r in dumps}
    start = max((min(s) for s in issued.values() if s), default=1)  # older ids may be dropped
    for seq in sorted({s for seqs in issued.values() for s in seqs if s >= start}):
        have = {r: seqs[seq] for r, seqs in issued.items() if seq in seqs}
        missing = sorted(r for r in issued if r not in have)
        if missing or len({c.signature() for c in have.values()}) > 1:
            return seq, have, missing
    return None


def verdict(dumps: dict[int, dict], group: str = "0") -> str:
    """One line: which rank and which collective diverged, from every rank's record.

    The divergence is the first sequence id some rank never issued, or issued with other ops,
    shapes or dtypes: ids, not completion, which is recorded after the fact (a failed
    collective reads as completed, one that returned reads unfinished for a moment: gloo, torch
    2.13). "Every rank waits" means something only in a dump taken during a hang.
    """
    rows = ledgers(dumps, group)
    if not any(group in d.get("pg_status", {}) for d in dumps.values()):
        return f"no rank recorded process group {group}: the group never formed"
    silent = [r for r in _group_ranks(dumps) if r not in dumps]
    if silent:
        return f"rank {', '.join(map(str, silent))} wrote no trace: it died or never got there"
    found = first_divergence(dumps, group)
    if found is not None:
        seq, have, missing = found
        some = next(iter(have.values()))
        if missing:
            return (f"rank {', '.join(map(str, missing))} never called "
                    + " ".join(filter(None, [f"#{seq}", some.op, some.at()]))
                    + f", rank {', '.join(map(str, sorted(have)))} did")
        parts = "; ".join(" ".join(filter(None, [f"rank {r}", c.op, str([list(x) for x in c.sizes]),
                                                 c.at()])) for r, c in sorted(have.items()))
        return f"#{seq} differs: {parts}"
    waiting = [r.first_unfinished for r in rows if r.first_unfinished]
    if waiting:
        c = min(waiting, key=lambda c: c.seq)
        return f"every rank waits in {' '.join(filter(None, [f'#{c.seq}', c.op, c.at()]))}: " \
               "the records match"
    last = max((r.last_completed.seq for r in rows if r.last_completed), default=0)
    return f"nothing unfinished: every rank completed collective #{last}"


def report(directory: str | os.PathLike, prefix: str | None = None) -> list[str]:
    """The ledger lines of every rank, then the verdict line."""
    dumps = load_dumps(directory, prefix)
    lines = [line for row in ledgers(dumps) for line in row.lines()]
    return lines + ["verdict: " + verdict(dumps)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ddp_lesson.flight",
                                description="Per-rank ledger of flight-recorder dumps.")
    p.add_argument("directory", help="folder holding one dump per rank, <prefix><rank>")
    p.add_argument("--prefix", default=None, help="file name before the rank (inferred)")
    opts = p.parse_args(argv)
    try:
        lines = report(opts.directory, opts.prefix)
    except (FileNotFoundError, ValueError) as exc:
        print(f"ddp_lesson.flight: {exc}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
