"""tools/suite_census.py: the records a run leaves are read, sorted into kinds and summed as
they were written (CONTRIBUTING.md, "The suite's time")."""
from __future__ import annotations

import atexit
import csv
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import suite_census  # noqa: E402

AGENT = ["/r/ddp_lesson/launch/agent.py", "--nproc-per-node", "2"]


def _put(folder: Path, pid: int, ppid: int, argv, test: str, cpu: float | None,
         dynamo=False) -> None:
    rec = {"pid": pid, "ppid": ppid, "argv": argv, "test": test, "cpu_s": 0.01,
           "wall_s": 0.1, "dynamo": dynamo}
    (folder / f"{pid}.100.start.json").write_text(json.dumps(rec))
    if cpu is not None:
        (folder / f"{pid}.100.exit.json").write_text(json.dumps({**rec, "cpu_s": cpu}))


def _run_of_one_launch(folder: Path) -> None:
    test = "demo/launch_x.py::test_a (call)"
    _put(folder, 10, 1, ["-c"], "", 30.0)                                  # an xdist worker
    _put(folder, 11, 10, AGENT, test, 1.75)                                # torchrun's agent
    _put(folder, 12, 11, ["/tmp/run/torchrun_cell.py"], test, 4.0, dynamo=True)
    _put(folder, 13, 11, ["/tmp/run/torchrun_cell.py"], test, None)        # killed
    _put(folder, 14, 10, ["/r/ddp_lesson/procs.py", "--watch", "/tmp/w"], test, 0.03)
    _put(folder, 15, 10, ["/v/ipykernel_launcher.py", "-f", "k.json"],
         "notebooks/01.ipynb::Cell 0 (setup)", 1.0)
    _put(folder, 16, 10, ["-c"], test, 0.5)                                # a test's python -c


def test_records_are_read_sorted_into_kinds_and_summed(tmp_path):
    _run_of_one_launch(tmp_path)
    records = suite_census.load(tmp_path)
    assert len(records) == 7
    assert [r["pid"] for r in records if r["killed"]] == [13]
    by_kind, by_file = suite_census.summarise(records)
    assert {k: (e["n"], e["killed"], round(e["cpu_s"], 2), e["dynamo"])
            for k, e in by_kind.items()} == {
        "pytest": (1, 0, 30.0, 0), "agent": (1, 0, 1.75, 0), "worker": (2, 1, 4.0, 1),
        "watchdog": (1, 0, 0.03, 0), "kernel": (1, 0, 1.0, 0), "other": (1, 0, 0.5, 0)}
    launch = by_file["demo/launch_x.py"]
    assert (launch["n"], round(launch["cpu_s"], 2)) == (5, 6.28)
    assert dict(launch["kinds"]) == {"agent": 1, "worker": 2, "watchdog": 1, "other": 1}
    assert by_file["(none)"]["n"] == 1 and by_file["notebooks/01.ipynb"]["n"] == 1


def test_the_csv_has_a_row_per_file_and_kind(tmp_path):
    records_dir = tmp_path / "records"
    records_dir.mkdir()
    _run_of_one_launch(records_dir)
    suite_census.write_csv(suite_census.load(records_dir), tmp_path / "c.csv")
    rows = list(csv.DictReader(open(tmp_path / "c.csv")))
    worker = [r for r in rows if r["kind"] == "worker"]
    assert worker == [{"file": "demo/launch_x.py", "kind": "worker", "processes": "2",
                       "killed": "1", "cpu_s": "4.00", "dynamo": "1"}]
    assert len(rows) == 6


def test_the_recorder_writes_its_start_and_registers_its_exit(tmp_path, monkeypatch):
    registered = []
    monkeypatch.setattr(atexit, "register", lambda fn, *a: registered.append((fn, a)))
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "demo/a.py::t (call)")
    exec(compile(suite_census.RECORDER.format(folder=str(tmp_path)), "recorder", "exec"), {})
    (start,) = tmp_path.glob("*.start.json")
    rec = json.loads(start.read_text())
    assert rec["test"] == "demo/a.py::t (call)" and rec["cpu_s"] > 0
    assert sorted(rec) == ["argv", "cpu_s", "dynamo", "pid", "ppid", "test", "wall_s"]
    fn, args = registered[0]
    fn(*args)
    assert len(list(tmp_path.glob("*.exit.json"))) == 1


def test_an_optimizers_first_step_imports_dynamo_as_contributing_says():
    """CONTRIBUTING.md, "Where the CPU goes": every rank that trains imports torch._dynamo."""
    import inspect

    import torch
    import torch.optim.optimizer as optimizer

    assert "import torch._dynamo" in inspect.getsource(optimizer._use_grad_for_differentiable)
    for opt in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW):
        # The first instance wraps its class's step once more (Optimizer._patch_step_function,
        # a profiler hook), so whether one exists yet in this process does not matter here.
        opt([torch.zeros(1, requires_grad=True)], lr=0.1)
        step, wrappers = opt.step, []
        while step is not None:
            wrappers.append(step.__code__.co_name)
            step = getattr(step, "__wrapped__", None)
        assert wrappers == ["wrapper", "_use_grad", "step"], (opt, wrappers)
    # the constructor too: add_param_group is wrapped by torch._disable_dynamo, whose wrapper
    # imports torch._dynamo on its first call, with no switch to turn that off
    import torch._compile

    assert torch.optim.Optimizer.add_param_group.__code__.co_name == "inner"
    assert "import torch._dynamo" in inspect.getsource(torch._compile._disable_dynamo)
    text = (ROOT / "CONTRIBUTING.md").read_text()
    assert "`_use_grad_for_differentiable` in\n  `torch/optim/optimizer.py`" in text
    assert "`add_param_group` (`@torch._disable_dynamo`, `torch/_compile.py`)" in " ".join(
        text.split())


def test_a_fork_server_and_its_forked_agents_have_kinds_of_their_own(tmp_path):
    test = "demo/launch_y.py::test_b (call)"
    _put(tmp_path, 20, 1, ["-c"], "", 10.0)
    _put(tmp_path, 21, 20, ["-c", "from multiprocessing.forkserver import main"], test, 1.3)
    # a forked agent writes no start record (it is not a new Python), only its exit
    rec = {"pid": 22, "ppid": 21, "argv": AGENT, "test": test, "cpu_s": 0.2, "wall_s": 1.0,
           "dynamo": False}
    (tmp_path / "22.100.exit.json").write_text(json.dumps(rec))
    _put(tmp_path, 23, 22, ["/tmp/run/torchrun_cell.py"], test, 2.0)
    by_kind, by_file = suite_census.summarise(suite_census.load(tmp_path))
    assert {k: (e["n"], round(e["cpu_s"], 2)) for k, e in by_kind.items()} == {
        "pytest": (1, 10.0), "forkserver": (1, 1.3), "agent": (1, 0.2), "worker": (1, 2.0)}
    assert dict(by_file["demo/launch_y.py"]["kinds"]) == {"forkserver": 1, "agent": 1,
                                                          "worker": 1}
