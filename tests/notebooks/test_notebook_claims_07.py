"""Notebook 07 and its deep dive say what torch 2.13 does: each sentence about torch is checked
here against torch's own source (or binary, for text compiled into it) or against the stored
run that shows it (nbval replays that run, so the stored output is what a fresh run prints).

The claims: a collective is not a synchronisation point (only ``barrier``/``monitored_barrier``
promise one); ``Join`` shadows only its Joinables' collectives; the agent's
``TORCH_NCCL_ASYNC_ERROR_HANDLING``; gloo's network-interface warning and its loopback fallback;
the flight recorder on gloo.
"""
from __future__ import annotations

import mmap
import os
import re

import nbformat
import torch
from notebook_cells import NOTEBOOKS, stream_text

CORE = "07_failures_and_multinode.ipynb"
DEEP = "deep/07_restart_trap_and_stores.ipynb"
TORCH = os.path.dirname(torch.__file__)


def _prose(notebook: str) -> str:
    """The notebook's markdown, its line breaks folded into spaces."""
    nb = nbformat.read(NOTEBOOKS / notebook, as_version=4)
    text = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    return re.sub(r"\s+", " ", text)


def _torch_src(rel: str) -> str:
    with open(os.path.join(TORCH, rel)) as f:
        return f.read()


def test_a_collective_is_not_a_synchronisation_point():
    prose = _prose(CORE)
    assert ("only `barrier` and `monitored_barrier` promise that no rank leaves before all "
            "have entered") in prose
    assert "waits until **every** rank" not in prose  # the old, wrong model
    c10d = _torch_src("distributed/distributed_c10d.py")
    assert "This collective blocks processes until the whole group enters this function" in c10d
    # the run that shows it: rank 0's all_reduce of 2 elements completed while rank 1's of 3
    # never did, and rank 0 went on to the next collective
    out = stream_text(CORE, "clinic = run_all(")
    assert "rank 0 last completed: #2 all_reduce [2] Float\n" in out
    assert "rank 1 first unfinished: #2 all_reduce [3] Float\n" in out
    assert "rank 0 first unfinished: #3 barrier []\n" in out


def test_join_shadows_only_its_joinables():
    prose = _prose(CORE)
    assert "A rank out of data shadows the collectives of the *Joinables* given to Join" in prose
    assert 'Join "is not aware of non-DDP collective communication" (DDP\'s docstring)' in prose
    assert "`ddp_lesson.train`'s per-step all-reduce of the pixel count" in prose
    assert "still hangs under Join" in prose
    ddp = re.sub(r"\s+", " ", _torch_src("nn/parallel/distributed.py"))
    assert "context manager is not aware of non-DDP collective communication" in ddp
    # the trainer's own collective each step, outside DDP: the global pixel count
    from ddp_lesson import train

    src = open(train.__file__).read()
    assert "all_reduce_sum(t.to(reduce_device()))" in src


def test_torchrun_sets_nccl_async_error_handling_to_teardown():
    prose = _prose(DEEP)
    assert ("under torchrun the agent sets it to 1 (TearDown: abort the communicators, end the "
            "process) unless you set it; 3 (SkipCleanUp: end the process without cleanup) is "
            "torch's default only outside torchrun") in prose
    agent = re.sub(r"\s+", "", _torch_src("distributed/elastic/agent/server/"
                                          "local_elastic_agent.py"))
    assert ('"TORCH_NCCL_ASYNC_ERROR_HANDLING":os.getenv("TORCH_NCCL_ASYNC_ERROR_HANDLING",'
            'str(1))') in agent
    header = _torch_src("include/torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp")
    assert "the default value (3 - SkipCleanUp)" in header
    assert re.search(r"TearDown = 1", header)


def test_gloo_interface_message_is_a_warning_with_loopback_fallback():
    prose = _prose(DEEP)
    assert ("gloo only *warns* (\"Unable to resolve hostname to a (local) address. Using the "
            "loopback address as fallback. Manually set the network interface to bind to with "
            "GLOO_SOCKET_IFNAME.\") and binds to loopback") in prose
    assert "a multi-machine job fails later, when the other machines cannot connect" in prose
    # the message is compiled into libtorch_cpu (ProcessGroupGloo.cpp): its three sentences
    # are stored next to each other, the fallback between the cause and the advice
    with open(os.path.join(TORCH, "lib", "libtorch_cpu.so"), "rb") as f, \
            mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as lib:
        at = lib.find(b"Unable to resolve hostname to a (local) address.")
        assert at >= 0
        near = lib[at:at + 300]
    assert b"Using the loopback address as fallback." in near
    assert b"Manually set the network interface to bind to with GLOO_SOCKET_IFNAME." in near


def test_the_flight_recorder_dump_names_are_the_ones_torch_reads():
    """The dump's path prefix has a new name and an old one; the switch has one name (issue 40)."""
    prose = _prose(DEEP)
    assert ("the path prefix is `TORCH_FR_DUMP_TEMP_FILE`, older name "
            "`TORCH_NCCL_DEBUG_INFO_TEMP_FILE`") in prose
    with open(os.path.join(TORCH, "lib", "libtorch_cpu.so"), "rb") as f, \
            mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as lib:
        assert lib.find(b"TORCH_FR_DUMP_TEMP_FILE\x00") >= 0
        assert lib.find(b"TORCH_NCCL_DEBUG_INFO_TEMP_FILE\x00") >= 0
    header = _torch_src("include/torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp")
    assert re.search(r'TORCH_NCCL_DUMP_ON_TIMEOUT = \{\s*"TORCH_NCCL_DUMP_ON_TIMEOUT"\};', header)
    pitfalls = re.sub(r"\s+", " ", (NOTEBOOKS.parent / "docs" / "pitfalls.md").read_text())
    assert "path prefix `TORCH_FR_DUMP_TEMP_FILE` (older name `TORCH_NCCL_DEBUG_INFO_TEMP_FILE`" \
        in pitfalls


def test_the_flight_recorder_records_on_gloo():
    prose = _prose(DEEP)
    assert "| the flight recorder, gloo and NCCL |" in prose
    assert "2000 when unset in 2.13, so gloo records by default" in prose
    assert "kept on gloo too in torch 2.13" in _prose(CORE)
    row = prose[prose.index("| `TORCH_FR_BUFFER_SIZE=N`"):]
    row = row[:row.index("| `TORCH_NCCL_DUMP_ON_TIMEOUT=1`")]
    assert "NCCL only" not in row  # the old table's last column
    fr = _torch_src("include/torch/csrc/distributed/c10d/FlightRecorder.hpp")
    assert '{"TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"}, 2000);' in fr
    # the run: the clinic's gloo ranks, recorder variables unset, recorded their collectives
    out = stream_text(CORE, "clinic = run_all(")
    assert "verdict: rank 1 never called #2 all_reduce (partial_collective.py:" in out
