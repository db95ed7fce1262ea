"""The process table from /proc (Linux), shared by the tests that find or end processes they
started (``from procfs import proc_table, descends_from``).

A suite beside this one runs the same programs at the same time, so a test that signals "the
worker running X" must pick only its own descendants: matching on the command line alone once
signalled the other suite's rank 0.
"""
from __future__ import annotations

import os


def proc_table() -> dict[int, tuple[int, str, str]]:
    """pid -> (ppid, start time in clock ticks since boot, state letter) for every process,
    from /proc/PID/stat; empty where /proc cannot be listed. A pid with its start time names
    one process even after the pid is reused."""
    table = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return table
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # the command name (field 2) is in parentheses and may hold spaces: split after it
        fields = stat[stat.rindex(")") + 2:].split()  # state, ppid, ..., starttime (22nd)
        table[int(entry)] = (int(fields[1]), fields[19], fields[0])
    return table


def descends_from(pid: int, ancestor: int | None = None) -> bool:
    """Whether ``pid`` is a child, grandchild, ... of ``ancestor`` (default: this process),
    walking parent pids in one snapshot of the table. False for a pid that is gone."""
    ancestor = os.getpid() if ancestor is None else ancestor
    table = proc_table()
    seen = set()
    while pid in table and pid not in seen and pid > 1:
        seen.add(pid)
        pid = table[pid][0]
        if pid == ancestor:
            return True
    return False
