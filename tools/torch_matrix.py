"""The suite under other versions of torch: one throwaway environment per version.

    python tools/torch_matrix.py --torch 2.13.0 --torch 2.15.0
    python tools/torch_matrix.py --torch 2.15.0 --slow-args "tests/seedfix tests/collectives"
    python tools/torch_matrix.py --torch 2.13.0+cpu --index-url https://download.pytorch.org/whl/cpu

For each version: a fresh virtual environment in a temporary folder; ``pip install torch==V``,
then ``pip install -e ".[dev]"`` of a copy of the repository at ``--ref`` (``git archive``,
default HEAD, resolved once: the results belong to a commit, not to a working tree being
edited); torch stays at the version asked for (a constraint during the project's install: a
version outside ``pyproject.toml``'s range fails there unless ``--ignore-range``, which drops
the copy's bounds, so that ``tests/project/test_packaging.py``'s range tests fail there); then the
quick tier (``pytest -m "not slow" -n 0``) and the multi-process tests that do not replay stored
outputs (``pytest -m "slow and not notebook" -n 2``; ``--slow-args`` narrows them to the paths
or ``-k`` given, ``--no-slow`` skips them). Each run's counts come from pytest's JUnit XML.
Results: one row per version and tier in ``benchmarks/torch_matrix.csv`` (rows of the same
version, tier and commit are replaced), the failed tests' names in ``benchmarks/torch_matrix.json``,
and a Markdown table on stdout. The environment is deleted afterwards (``--keep`` keeps it).

pip: torch comes from the indexes pip is configured with. A CPU build is wanted on a CPU machine;
PyPI's Linux wheels are CUDA builds (several GB with their ``nvidia-*`` packages), and a CPU
build comes from ``--index-url https://download.pytorch.org/whl/cpu`` where that is reachable.
A machine-wide pip constraint file (``pip config list``: ``global.constraint``) would cap the
versions that can be installed; the throwaway environments ignore it (``PIP_CONSTRAINT`` set
to an empty file: an empty value does not override the configuration; ``--keep-constraint``
keeps it). Nothing here runs in CI (CONTRIBUTING.md, "Other versions of torch").
"""
from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIELDS = ["version", "build", "tier", "passed", "failed", "errors", "skipped", "seconds",
          "commit", "date", "selection"]
QUICK = ["-m", "not slow", "-n", "0"]
SLOW = ["-m", "slow and not notebook", "-n", "2"]


def _run(cmd: list[str], env: dict, log, cwd: Path | None = None, check: bool = True) -> int:
    log.write(f"$ {shlex.join(cmd)}\n")
    log.flush()
    rc = subprocess.call(cmd, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT)
    if check and rc != 0:
        raise RuntimeError(f"exit status {rc}: {shlex.join(cmd)} (log: {log.name})")
    return rc


def junit_counts(path: Path) -> dict:
    """``passed``, ``failed``, ``errors``, ``skipped`` and the failed tests' ids from a JUnit XML
    file that pytest wrote (``--junitxml``)."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for s in suites:
        for k in counts:
            counts[k] += int(s.get(k, 0))
    failed = [f"{c.get('classname')}::{c.get('name')}" for c in root.iter("testcase")
              if c.find("failure") is not None or c.find("error") is not None]
    return {"passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
            "failed": counts["failures"], "errors": counts["errors"],
            "skipped": counts["skipped"], "failed_ids": failed}


def _environment(folder: Path, version: str, args, log) -> tuple[Path, str]:
    """A venv under ``folder`` with torch ``version`` and the project; its python and build."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONDONTWRITEBYTECODE", "VIRTUAL_ENV", "PYTHONPATH")}
    if not args.keep_constraint:
        empty = folder / "no-constraints.txt"
        empty.write_text("")
        env["PIP_CONSTRAINT"] = str(empty)
    _run([sys.executable, "-m", "venv", str(folder / "venv")], env, log)
    py = folder / "venv" / "bin" / "python"
    index = ["--index-url", args.index_url] if args.index_url else []
    pip = [str(py), "-m", "pip", "install", "--no-compile", "--disable-pip-version-check"]
    _run([*pip, f"torch=={version}", *index], env, log)
    src = folder / "src"
    src.mkdir()
    archive = subprocess.run(["git", "archive", args.commit], cwd=ROOT, capture_output=True,
                             check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    if args.ignore_range:  # a version outside the range, on purpose: drop the bounds
        toml = src / "pyproject.toml"
        toml.write_text(re.sub(r'"torch[<>=!~][^"]*"', '"torch"', toml.read_text()))
    # the torch just installed stays: a version outside the range fails here, never replaced
    pin = folder / "torch-pin.txt"
    pin.write_text(f"torch=={version}\n")
    _run([*pip, "-e", f"{src}[dev]", "--constraint", str(pin)], env, log)
    build = subprocess.run([str(py), "-c", "import torch; print(torch.__version__, "
                            "'cuda ' + torch.version.cuda if torch.version.cuda else 'cpu')"],
                           env=env, capture_output=True, text=True, check=True).stdout.strip()
    if build.split()[0].split("+")[0] != version.split("+")[0]:
        raise RuntimeError(f"asked for torch {version}, the environment has {build}")
    return py, build


def run_version(version: str, args, commit: str) -> list[dict]:
    """Install ``version`` and run the tiers; one result row per tier."""
    base = Path(tempfile.mkdtemp(prefix=f"torch-{version}-"))
    rows = []
    log_path = Path(args.logs) / f"torch_matrix_{version}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(log_path, "w") as log:
            py, build = _environment(base, version, args, log)
            print(f"torch {version}: installed {build}", flush=True)
            tiers = [("quick", QUICK, [])]
            if not args.no_slow:
                tiers.append(("slow", SLOW, shlex.split(args.slow_args)))
            env = {k: v for k, v in os.environ.items()
                   if k not in ("PYTHONDONTWRITEBYTECODE", "VIRTUAL_ENV", "PYTHONPATH")}
            env["PATH"] = f"{py.parent}{os.pathsep}{env.get('PATH', '')}"
            for tier, marks, selection in tiers:
                xml = base / f"{tier}.xml"
                start = time.monotonic()
                _run([str(py), "-m", "pytest", *marks, "-p", "no:cacheprovider", "-q",
                      f"--junitxml={xml}", *selection], env, log, cwd=base / "src", check=False)
                seconds = round(time.monotonic() - start, 1)
                counts = junit_counts(xml)
                rows.append({"version": version, "build": build, "tier": tier,
                             **{k: counts[k] for k in ("passed", "failed", "errors", "skipped")},
                             "seconds": seconds, "commit": commit,
                             "date": datetime.date.today().isoformat(),
                             "selection": " ".join(selection) or "all",
                             "failed_ids": counts["failed_ids"]})
                print(f"torch {version} {tier}: {counts['passed']} passed, {counts['failed']} "
                      f"failed, {counts['errors']} errors, {counts['skipped']} skipped, "
                      f"{seconds} s", flush=True)
    finally:
        if args.keep:
            print(f"kept {base}")
        else:
            shutil.rmtree(base, ignore_errors=True)
    return rows


def write_results(rows: list[dict], csv_path: Path, json_path: Path) -> list[dict]:
    """Merge ``rows`` into the CSV (a row of the same version, tier and commit is replaced) and
    the JSON of failed ids; return the CSV's rows as read back (strings)."""
    old = list(csv.DictReader(open(csv_path))) if csv_path.exists() else []
    keys = {(r["version"], r["tier"], r["commit"]) for r in rows}
    kept = [r for r in old if (r["version"], r["tier"], r["commit"]) not in keys]
    merged = kept + [{k: r[k] for k in FIELDS} for r in rows]
    csv_path.parent.mkdir(parents=True, exist_ok=True)
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        w.writerows(merged)
    failed = json.loads(json_path.read_text()) if json_path.exists() else {}
    for r in rows:
        failed[f"{r['version']} {r['tier']} {r['commit']}"] = r["failed_ids"]
    json_path.write_text(json.dumps(failed, indent=1, sort_keys=True) + "\n")
    with open(csv_path, newline="") as f:
        return list(csv.DictReader(f))


def markdown(rows: list[dict]) -> str:
    lines = ["| torch | build | tier | passed | failed | errors | skipped | s | commit |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['version']} | {r['build']} | {r['tier']}"
                     f"{'' if r['selection'] == 'all' else ' (' + r['selection'] + ')'} | "
                     f"{r['passed']} | {r['failed']} | {r['errors']} | {r['skipped']} | "
                     f"{r['seconds']} | {r['commit']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--torch", action="append", required=True, metavar="VERSION",
                   help="a torch version to install (repeat for several)")
    p.add_argument("--ref", default="HEAD", help="the commit to test (git archive)")
    p.add_argument("--slow-args", default="",
                   help="paths or -k for the multi-process tier (default: all of it)")
    p.add_argument("--no-slow", action="store_true", help="the quick tier only")
    p.add_argument("--index-url", default=None, help="pip's index for torch (e.g. the CPU one)")
    p.add_argument("--keep-constraint", action="store_true",
                   help="keep pip's configured constraint file (default: ignore it)")
    p.add_argument("--ignore-range", action="store_true",
                   help="install a torch outside pyproject's range (to see what fails there)")
    p.add_argument("--keep", action="store_true", help="keep the temporary environments")
    p.add_argument("--csv", default=str(ROOT / "benchmarks" / "torch_matrix.csv"))
    p.add_argument("--json", default=str(ROOT / "benchmarks" / "torch_matrix.json"))
    p.add_argument("--logs", default=str(ROOT / "runs" / "torch_matrix"),
                   help="folder for each version's install and pytest log")
    args = p.parse_args(argv)
    # resolved once: every version tests the same commit, whatever is committed meanwhile
    args.commit = subprocess.run(["git", "rev-parse", "--short", args.ref], cwd=ROOT,
                                 capture_output=True, text=True, check=True).stdout.strip()
    commit = args.commit
    rows = []
    for version in args.torch:
        try:
            rows += run_version(version, args, commit)
        except RuntimeError as exc:
            print(f"torch {version}: not run: {exc}", file=sys.stderr)
    if not rows:
        return 1
    write_results(rows, Path(args.csv), Path(args.json))
    print(markdown([{k: r[k] for k in FIELDS} for r in rows]))
    return 0 if all(r["failed"] == 0 and r["errors"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
