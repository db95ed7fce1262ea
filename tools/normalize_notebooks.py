"""Rewrite the notebooks' metadata to exactly what JupyterLab 4 writes, so that opening a stored
notebook does not mark it unsaved.

    python tools/normalize_notebooks.py            # rewrite notebooks/*.ipynb in place
    python tools/normalize_notebooks.py --check    # list what differs, exit 1 if anything does

What JupyterLab changes (measured with JupyterLab 4.6 and ipykernel 7 in this project's
environment: a copy of every notebook opened in Chromium, saved, and the JSON diffed): when the
notebook's kernel starts, JupyterLab copies the kernelspec's ``display_name`` into
``metadata.kernelspec`` -- "Python 3 (ipykernel)" for ipykernel's ``python3`` kernel, where
nbconvert had stored "Python 3" -- and marks the notebook dirty. Nothing else changed on
save: ``language_info`` (the kernel's own, as nbconvert already stores it), ``nbformat`` 4.5,
the cell ids, the widget state and the JSON layout (indent 1, sorted keys, UTF-8, final newline,
as nbformat writes) were kept byte for byte.

So this sets ``metadata.kernelspec`` to the ``python3`` kernelspec of this environment
(name, display_name, language) and ``metadata.language_info`` to what ipykernel reports, keeps
everything else, and writes with nbformat (cell ids kept). ``--check`` and the test compare
``language_info`` without its ``version`` (the executing Python's, which JupyterLab rewrites on a
reader's other Python whatever is stored). Run it after re-executing notebooks
(``jupyter nbconvert --execute --inplace`` stores "Python 3").
tests/notebooks/test_stored_notebooks.py fails when a stored notebook differs from it.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import nbformat

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
KERNEL_NAME = "python3"


def expected_metadata() -> dict:
    """The ``kernelspec`` and ``language_info`` JupyterLab leaves in a notebook run on this
    environment's ``python3`` kernel (ipykernel)."""
    from ipykernel.ipkernel import IPythonKernel
    from jupyter_client.kernelspec import KernelSpecManager

    spec = KernelSpecManager().get_kernel_spec(KERNEL_NAME)
    return {
        "kernelspec": {"display_name": spec.display_name, "language": spec.language,
                       "name": KERNEL_NAME},
        "language_info": dict(IPythonKernel.language_info),
    }


def as_javascript_writes(value):
    """``value`` with every whole float made an int: JupyterLab saves a notebook through
    ``JSON.stringify``, which writes the widget state's 1.0 (a FloatSlider's value, as Python's
    ``json`` wrote it) as 1."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: as_javascript_writes(v) for k, v in value.items()}
    if isinstance(value, list):
        return [as_javascript_writes(v) for v in value]
    return value


def normalized(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """``nb`` with its metadata set to what JupyterLab writes (a copy; cells untouched)."""
    out = nbformat.from_dict(nb)  # deep copy
    for key, value in expected_metadata().items():
        out.metadata[key] = nbformat.from_dict(value)
    if "widgets" in out.metadata:
        out.metadata["widgets"] = nbformat.from_dict(as_javascript_writes(out.metadata["widgets"]))
    return out


def differences(path: Path) -> list[str]:
    """What ``path``'s stored metadata has that JupyterLab would rewrite ("" list: nothing)."""
    nb = nbformat.read(path, as_version=4)
    problems = []
    for key, want in expected_metadata().items():
        got = nb.metadata.get(key)
        if key == "language_info" and isinstance(got, dict):
            # the Python version is the executing kernel's own (3.11.7 here): JupyterLab
            # rewrites it on a reader's different Python whatever is stored, so a test on
            # another interpreter compares everything but it
            want = dict(want, version=got.get("version"))
        if got != want:
            problems.append(f"{path.name}: metadata.{key} is {got!r}, JupyterLab writes {want!r}")
    if (nb.nbformat, nb.nbformat_minor) < (4, 5):
        problems.append(f"{path.name}: nbformat {nb.nbformat}.{nb.nbformat_minor}; JupyterLab "
                        f"writes 4.5 with cell ids")
    widgets = nb.metadata.get("widgets")
    if widgets is not None and json.dumps(as_javascript_writes(widgets)) != json.dumps(widgets):
        problems.append(f"{path.name}: metadata.widgets holds whole floats (1.0) that JupyterLab "
                        f"writes as ints (1)")
    missing = [i for i, c in enumerate(nb.cells) if not c.get("id")]
    if missing:
        problems.append(f"{path.name}: cells {missing} have no id")
    return problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", type=Path,
                        help="notebooks (default: notebooks/*.ipynb)")
    parser.add_argument("--check", action="store_true", help="only report; exit 1 on any")
    args = parser.parse_args(argv)
    paths = args.paths or sorted(p for p in NOTEBOOKS.rglob("*.ipynb")
                                 if ".ipynb_checkpoints" not in p.parts)
    problems = [p for path in paths for p in differences(path)]
    if args.check:
        print("\n".join(problems) or f"{len(paths)} notebooks: metadata as JupyterLab writes it")
        return 1 if problems else 0
    for path in paths:
        if differences(path):
            nb = nbformat.read(path, as_version=4)
            nbformat.write(normalized(nb), path)
            print(f"rewrote {path.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
