"""nbval replays compare what a notebook prints to stdout and shows, never its stderr.

A cell's stderr carries text that varies between runs and machines: a Python warning names the
kernel's temporary file for the cell (``/tmp/ipykernel_1234/567.py:3: UserWarning``), and the
kernel flushes stdout and stderr on separate timers, so their interleaving varies too (issue 15,
item 9: a cell that prints, warns and prints failed 3 of 3 replays). Errors still fail a replay
(they are ``error`` outputs, not stderr), and stored stderr stays in the notebook for readers.
"""
from __future__ import annotations

import atexit
import copy
import shutil
import tempfile

import jupyter_client
import nbval.kernel

# one folder for this process's kernels' sockets, removed when it exits
_IPC_ROOT = tempfile.mkdtemp(prefix="nbval-kernels-")
atexit.register(shutil.rmtree, _IPC_ROOT, True)


class _IpcKernelManager(jupyter_client.KernelManager):
    """nbval's kernels talk over Unix sockets (``transport="ipc"``), not TCP ports.

    Over TCP, jupyter_client picks five free ports, closes them and writes them to the
    connection file; the kernel binds them once it has started, and on a loaded machine another
    process can take one in between: the kernel dies at start (``Address already in use``; nbval
    reports "Kernel died before replying to kernel_info": every cell of notebooks/deep/03 errored
    in 1 of 2 runs of a loaded pair). An IPC socket is a file in a folder made for this kernel
    alone: nothing another process can take.
    """

    def __init__(self, **kwargs):
        kwargs.setdefault("transport", "ipc")
        # an absolute path of this kernel's own (the default, "kernel-ipc", is relative to each
        # process's working directory, and the kernel runs in the notebook's folder)
        kwargs.setdefault("ip", tempfile.mkdtemp(prefix="kernel-", dir=_IPC_ROOT) + "/k")
        super().__init__(**kwargs)


nbval.kernel.KernelManager = _IpcKernelManager  # what nbval.kernel.start_new_kernel constructs


def _without_stderr(outputs):
    from nbval.plugin import coalesce_streams

    kept = [copy.deepcopy(o) for o in outputs
            if not (o.get("output_type") == "stream" and o.get("name") == "stderr")]
    return coalesce_streams(kept)


def pytest_collection_modifyitems(items):
    for item in items:
        if type(item).__name__ == "IPyNbCell":
            # a replay runs the notebook's cells in a kernel: not the quick tier (tests/tiers.py)
            item.add_marker("slow")
            item.add_marker("notebook")
        if type(item).__name__ == "IPyNbCell" and hasattr(item, "compare_outputs"):
            compare = item.compare_outputs

            def compare_without_stderr(test, ref, skip_compare=None, _compare=compare):
                return _compare(_without_stderr(test), _without_stderr(ref), skip_compare)

            item.compare_outputs = compare_without_stderr
