"""ddp_lesson.launch.fdcapture in this process (no process started): fds 1 and 2 and Python's
prints as one ordered stream each, drained to the last byte, restored after (pitfall C11). The
same on real engines, with os.system and subprocesses: tests/launch/test_cluster.py."""
from __future__ import annotations

import ctypes
import io
import os
import sys

from IPython.core.events import EventManager, available_events

from ddp_lesson.launch.fdcapture import CellCapture, capture_cells

BIG = 1 << 20  # bytes in one os.write: many times what a Linux pipe holds (64 KiB)


def _files() -> list[tuple[int, int]]:
    """What fds 1 and 2 point at: (device, inode) each."""
    return [(os.fstat(fd).st_dev, os.fstat(fd).st_ino) for fd in (1, 2)]


def _sinks(monkeypatch) -> tuple[io.StringIO, io.StringIO]:
    out, err = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    return out, err


def test_prints_and_descriptor_writes_come_out_in_program_order(monkeypatch):
    out, err = _sinks(monkeypatch)
    before = _files()
    capture = CellCapture()
    capture.start()
    assert _files() != before  # both descriptors point at the capture's pipes
    print("a")
    os.write(1, b"b\n")
    print("c", end="")  # no newline: still written before the os.write that follows
    os.write(1, b" d\n")
    sys.stdout.buffer.write(b"e\n")
    print("w1", file=sys.stderr)
    os.write(2, b"w2\n")
    accent = "é".encode()
    os.write(1, accent[:1])  # one character split over two writes
    os.write(1, accent[1:] + b"\n")
    os.write(1, b"x" * BIG + b"\n")  # no deadlock on a full pipe: a thread empties it
    ctypes.CDLL(None).printf(b"from C\n")
    print("g")
    capture.stop()
    text = out.getvalue()
    # C stdio buffers when fd 1 is no terminal: printf's line is not lost (flushed at the end)
    assert text.count("from C\n") == 1
    assert text.replace("from C\n", "") == "a\nb\nc d\ne\né\n" + "x" * BIG + "\ng\n"
    assert err.getvalue() == "w1\nw2\n"
    assert _files() == before
    assert sys.stdout is out and sys.stderr is err


def test_a_start_without_stop_ends_the_first_capture(monkeypatch):
    out, _ = _sinks(monkeypatch)
    before = _files()
    capture = CellCapture()
    capture.start()
    os.write(1, b"first\n")
    capture.start()  # the first cell's stop never came: its capture ends, its text kept
    os.write(1, b"second\n")
    capture.stop()
    capture.stop()  # twice: nothing left to stop
    assert out.getvalue() == "first\nsecond\n"
    assert _files() == before and sys.stdout is out


def test_capture_cells_runs_on_the_shells_cell_events_once(monkeypatch):
    out, _ = _sinks(monkeypatch)
    before = _files()

    class Shell:
        pass

    shell = Shell()
    shell.events = EventManager(shell, available_events)
    capture = capture_cells(shell)
    assert capture_cells(shell) is capture  # registered once
    assert len(shell.events.callbacks["pre_run_cell"]) == 1
    for n in range(3):
        shell.events.trigger("pre_run_cell", None)
        print("print", n)
        os.write(1, f"os.write {n}\n".encode())
        shell.events.trigger("post_run_cell", None)
        assert _files() == before
    assert out.getvalue() == "".join(f"print {n}\nos.write {n}\n" for n in range(3))
