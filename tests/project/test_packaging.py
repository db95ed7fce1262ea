"""The two install routes (pip's pyproject.toml, conda's environment.yml) must agree."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import ddp_lesson

ROOT = Path(__file__).resolve().parents[2]

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

# conda-forge names the PyTorch package "pytorch"; PyPI names it "torch".
CONDA_TO_PYPI = {"pytorch": "torch"}


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _pyproject_packages() -> dict[str, str]:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = meta["dependencies"] + meta["optional-dependencies"]["dev"]
    return {_name(r): r.replace(" ", "") for r in reqs}


def _environment_packages() -> dict[str, str]:
    """Package -> requirement from environment.yml (a tiny reader for its two list levels)."""
    pkgs = {}
    for line in (ROOT / "environment.yml").read_text().splitlines():
        m = re.match(r"^\s+-\s+([A-Za-z0-9_.\-]+)(.*)$", line.split("#")[0].rstrip())
        if not m or m.group(1) in ("pip", "conda-forge", "-e"):
            continue
        name = CONDA_TO_PYPI.get(m.group(1).lower(), m.group(1).lower())
        if name in ("python", "."):
            continue
        pkgs[name] = name + m.group(2).replace(" ", "")
    return pkgs


def test_environment_yml_and_pyproject_list_the_same_packages():
    pip_side, conda_side = _pyproject_packages(), _environment_packages()
    assert sorted(pip_side) == sorted(conda_side)
    # and the same version bounds
    for name, req in pip_side.items():
        assert req.split(name, 1)[1] == conda_side[name].split(name, 1)[1], name


def test_environment_installs_the_checkout_itself():
    assert re.search(r"^\s+-\s+-e\s+\.\s*$", (ROOT / "environment.yml").read_text(), re.M)


def test_package_is_imported_from_this_checkout():
    # nbval replays the notebooks with the test environment's own kernel; make sure that
    # kernel sees this checkout, not an old installed copy (docs/pitfalls.md D3)
    assert Path(ddp_lesson.__file__).resolve().parent == ROOT / "ddp_lesson"


def test_pytest_configuration_replays_notebooks_strictly():
    opts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert "notebooks" in opts["testpaths"]
    addopts = opts["addopts"].split()
    assert "--nbval" in addopts and "--nbval-lax" not in addopts
    assert "--nbval-current-env" in addopts
    sanitize = addopts[addopts.index("--nbval-sanitize-with") + 1]
    assert (ROOT / sanitize).is_file()


def test_console_script_points_at_the_cli():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert meta["scripts"]["ddp-lesson"] == "ddp_lesson.cli:main"
    from ddp_lesson.cli import main

    assert callable(main)


# ----------------------------------------------------------------------------- torch's range

def _torch_range() -> str:
    return _pyproject_packages()["torch"].removeprefix("torch")


def test_installed_torch_is_in_the_range():
    """The suite runs on a torch the package allows (whatever build pip or CI gave it)."""
    import torch
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    assert Version(torch.__version__) in SpecifierSet(_torch_range()), torch.__version__


def test_the_range_is_stated_the_same_everywhere():
    """README and docs/gpus.md quote the range; each quote is pyproject's (and environment.yml's,
    test above)."""
    rng = _torch_range()
    for doc in ("README.md", "docs/gpus.md"):
        quoted = re.findall(r"`torch(>=[\d.]+,<[\d.]+)`", (ROOT / doc).read_text())
        assert quoted and set(quoted) == {rng}, (doc, quoted, rng)


def test_the_range_is_what_the_matrix_passed():
    """``tools/torch_matrix.py``'s results (benchmarks/torch_matrix.csv): the range's floor and
    the newest version it allows passed the quick tier with no failure, and the range allows
    no minor version above the newest one run."""
    import csv

    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    spec = SpecifierSet(_torch_range())
    floor = next(Version(s.version) for s in spec if s.operator == ">=")
    ceiling = next(Version(s.version) for s in spec if s.operator == "<")
    rows = list(csv.DictReader(open(ROOT / "benchmarks" / "torch_matrix.csv")))
    clean = {Version(r["version"]) for r in rows
             if r["tier"] == "quick" and r["failed"] == "0" and r["errors"] == "0"}
    assert any(v.release[:2] == floor.release[:2] for v in clean), (floor, clean)
    newest = max(v for v in clean if v in spec)
    assert ceiling.release[:2] == (newest.major, newest.minor + 1), (ceiling, newest)
