"""Where the suite's CPU goes: every Python process a test run starts, with its CPU time.

    python tools/suite_census.py run [PYTEST ARGS ...]   # pytest with the census on; the report
    python tools/suite_census.py report FOLDER           # the report of an earlier run
    python tools/suite_census.py run --csv benchmarks/suite_census.csv

``run`` puts a one-line ``.pth`` file into this interpreter's ``site-packages`` (the test
environment's, so every Python process of the run loads it, whatever environment a test gives
its children), runs ``python -m pytest ARGS`` and takes the ``.pth`` file away again, even when
pytest fails or is interrupted. Each process writes one JSON record when it exits (``atexit``):
its pid and parent's pid, its ``argv``, the test that was running when it started
(``PYTEST_CURRENT_TEST``, inherited from the pytest worker; empty where a test gave its child an
environment of its own), its own user + system CPU seconds (``os.times()``, not its children's)
and whether it imported ``torch._dynamo``. A process killed by a signal writes
only the record of its start, and is counted apart ("killed") without CPU.

The report sorts the processes into kinds -- ``agent`` (torchrun's agent,
``ddp_lesson.launch.agent``), ``worker`` (a process whose parent is an agent), ``kernel``,
``pytest`` (a ``python -m pytest``, and the xdist workers: ``python -c``
started before any test), ``watchdog`` (``ddp_lesson.procs --watch``),
``jupyter``, ``other`` -- and prints the CPU of each kind, then of each test file (by the test
its processes started in). ``/usr/bin/time -f "%U %S %e" python tools/suite_census.py run``
gives the whole run's CPU to compare with: what the records miss is Chromium, killed
processes and non-Python tools.

Nothing here runs in CI; it is for whoever trims the suite next (CONTRIBUTING.md, "The suite's
time").
"""
from __future__ import annotations

import collections
import csv
import json
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

PTH = "zz_ddp_lesson_suite_census.pth"
MODULE = "_ddp_lesson_suite_census"
RECORDER = '''\
import atexit, json, os, sys, time
_DIR = {folder!r}
_T0 = time.time()
_TEST = os.environ.get("PYTEST_CURRENT_TEST", "")
_PID = os.getpid()


def _write(kind):
    try:
        t = os.times()
        rec = {{"pid": os.getpid(), "ppid": os.getppid(), "argv": list(sys.argv)[:8],
               # a process forked without exec (an agent of the fork server) has the run's
               # environment by the time it exits
               "test": _TEST if os.getpid() == _PID else os.environ.get("PYTEST_CURRENT_TEST", ""),
               "cpu_s": t.user + t.system, "wall_s": time.time() - _T0,
               "dynamo": "torch._dynamo" in sys.modules}}
        name = f"{{os.getpid()}}.{{int(_T0 * 1e6)}}.{{kind}}.json"
        with open(os.path.join(_DIR, name), "w") as f:
            json.dump(rec, f)
    except Exception:
        pass


_write("start")
atexit.register(_write, "exit")
'''

def load(folder: Path) -> list[dict]:
    """The records of one run: one dict per process, from its exit record, or from its start
    record with ``killed=True`` and ``cpu_s=0.0`` where it wrote none at exit."""
    found: dict[str, dict] = {}
    for path in sorted(folder.glob("*.json")):
        key, kind = path.name.rsplit(".", 2)[0], path.name.rsplit(".", 2)[1]
        rec = json.loads(path.read_text())
        if kind == "exit":
            found[key] = {**rec, "killed": False}
        elif key not in found:
            found[key] = {**rec, "cpu_s": 0.0, "killed": True}
    return list(found.values())


def kind_of(rec: dict, agents: set[int]) -> str:
    """The kind of a record -- ``agent``, ``worker``, ``kernel``, ``forkserver``, ``watchdog``,
    ``pytest``, ``jupyter`` or ``other`` -- where ``agents`` holds the pids of the agent
    processes. A process whose parent's pid had been an earlier agent's (a reused pid) is
    misread as a ``worker``, which is harmless for a census."""
    argv = " ".join(rec["argv"])
    if "ddp_lesson/launch/agent.py" in argv or "torch.distributed.run" in argv:
        return "agent"
    if rec["ppid"] in agents:
        return "worker"
    if "ipykernel" in argv:
        return "kernel"
    if "multiprocessing.forkserver" in argv:
        return "forkserver"
    if "ddp_lesson/procs.py" in argv:
        return "watchdog"
    if (rec["argv"][:1] == ["-c"] and not rec["test"]) or "pytest" in argv:
        return "pytest"  # xdist's workers are ``python -c``, started before any test
    if "jupyter" in argv or "ipengine" in argv or "ipcontroller" in argv:
        return "jupyter"
    return "other"


def _classified(records: list[dict]):
    """``(record, kind, file)`` for each record, in order: its kind (:func:`kind_of`) and the
    test file it started in (``"(none)"`` for a process whose environment named no test)."""
    agents = {r["pid"] for r in records if kind_of(r, set()) == "agent"}
    for rec in records:
        yield rec, kind_of(rec, agents), rec["test"].split("::")[0] if rec["test"] else "(none)"


def _row() -> dict:
    return {"n": 0, "killed": 0, "cpu_s": 0.0, "dynamo": 0, "kinds": collections.Counter()}


def _add(entry: dict, rec: dict, kind: str) -> None:
    entry["n"] += 1
    entry["killed"] += rec["killed"]
    entry["cpu_s"] += rec["cpu_s"]
    entry["dynamo"] += bool(rec.get("dynamo"))
    entry["kinds"][kind] += 1


def summarise(records: list[dict]) -> tuple[dict, dict]:
    """``(by_kind, by_file)``: for each kind, and for each test file (``"(none)"`` for a process
    whose environment named no test), ``{"n": processes, "killed": n, "cpu_s": seconds,
    "dynamo": processes that imported torch._dynamo, "kinds": {kind: n}}``."""
    by_kind: dict = collections.defaultdict(_row)
    by_file: dict = collections.defaultdict(_row)
    for rec, kind, where in _classified(records):
        for table, key in ((by_kind, kind), (by_file, where)):
            _add(table[key], rec, kind)
    return dict(by_kind), dict(by_file)


def report(records: list[dict], top: int = 40, out=sys.stdout) -> None:
    by_kind, by_file = summarise(records)
    total = sum(e["cpu_s"] for e in by_kind.values())
    print(f"{len(records)} processes, {total:.0f} CPU-s recorded "
          f"({sum(e['killed'] for e in by_kind.values())} killed, without CPU)", file=out)
    print(f"{'kind':10s} {'n':>5s} {'killed':>6s} {'CPU-s':>8s} {'per':>5s} {'dynamo':>6s}",
          file=out)
    for kind in sorted(by_kind, key=lambda k: -by_kind[k]["cpu_s"]):
        e = by_kind[kind]
        done = max(e["n"] - e["killed"], 1)
        print(f"{kind:10s} {e['n']:5d} {e['killed']:6d} {e['cpu_s']:8.1f} "
              f"{e['cpu_s'] / done:5.2f} {e['dynamo']:6d}", file=out)
    print(f"\n{'CPU-s':>7s} {'procs':>5s}  test file (processes by kind)", file=out)
    for where in sorted(by_file, key=lambda w: -by_file[w]["cpu_s"])[:top]:
        e = by_file[where]
        kinds = ", ".join(f"{k} {n}" for k, n in e["kinds"].most_common())
        print(f"{e['cpu_s']:7.1f} {e['n']:5d}  {where} ({kinds})", file=out)


def write_csv(records: list[dict], path: Path) -> None:
    """One row per test file and kind: ``file, kind, processes, killed, cpu_s, dynamo``."""
    rows: dict = collections.defaultdict(_row)
    for rec, kind, where in _classified(records):
        _add(rows[(where, kind)], rec, kind)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["file", "kind", "processes", "killed", "cpu_s", "dynamo"])
        for (where, kind), e in sorted(rows.items()):
            writer.writerow([where, kind, e["n"], e["killed"], f"{e['cpu_s']:.2f}", e["dynamo"]])


def run(pytest_args: list[str]) -> tuple[int, Path]:
    """pytest with the recorder loaded in every Python process of this environment; returns
    pytest's exit status and the folder of records."""
    folder = Path(tempfile.mkdtemp(prefix="ddp_lesson_census_"))
    site = Path(sysconfig.get_paths()["purelib"])
    (site / f"{MODULE}.py").write_text(RECORDER.format(folder=str(folder)))
    (site / PTH).write_text(f"import {MODULE}\n")
    try:
        status = subprocess.call([sys.executable, "-m", "pytest", *pytest_args])
    finally:
        (site / PTH).unlink(missing_ok=True)
        (site / f"{MODULE}.py").unlink(missing_ok=True)
        for cached in (site / "__pycache__").glob(f"{MODULE}.*.pyc"):
            cached.unlink(missing_ok=True)
    return status, folder


def main(argv: list[str] | None = None) -> int:
    """``run [--csv FILE] PYTEST ARGS...`` (every argument but ``--csv FILE`` goes to pytest, in
    order) or ``report FOLDER [--csv FILE]``."""
    argv = sys.argv[1:] if argv is None else list(argv)
    csv_path = None
    if "--csv" in argv:
        at = argv.index("--csv")
        if at + 1 >= len(argv):
            sys.exit("suite_census: --csv needs a file name")
        csv_path = Path(argv[at + 1])
        del argv[at:at + 2]
    if argv[:1] == ["run"]:
        status, folder = run([a for a in argv[1:] if a != "--"])
        print(f"records: {folder}")
    elif argv[:1] == ["report"] and len(argv) == 2:
        status, folder = 0, Path(argv[1])
    else:
        sys.exit(__doc__.split("\n\n")[1])
    records = load(folder)
    report(records)
    if csv_path:
        write_csv(records, csv_path)
    return status


if __name__ == "__main__":
    sys.exit(main())
