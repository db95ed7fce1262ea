"""A ``%%ranks`` cell's output in program order: file descriptors 1 and 2 captured per cell.

On an ipyparallel engine (an ipykernel kernel) ``sys.stdout`` is an ``OutStream`` sending prints
to the client, while ``os.write(1, ...)``, ``os.system``, subprocesses and C code write to fd 1.
ipykernel's ``watchfd`` thread adds fd 1's output to the ``OutStream`` *when it gets to it*:
after later prints, or after the execute reply (the cell's tail lost or shown with the next);
under pytest ``watchfd`` is off and fd 1 goes to the engine's log
(https://github.com/ipython/ipykernel/issues/110,
https://github.com/ipython/ipyparallel/issues/401; pitfall C11).

:func:`capture_cells`: during a cell fd 1 and an unbuffered ``sys.stdout`` (as ``python -u``)
write to one pipe, fd 2 and ``sys.stderr`` to another, each forwarded as it comes by a thread to
the ``OutStream`` it replaced (a rank stuck in a collective still shows its prints); after the
cell both are restored and each pipe drained before the cell's result is sent. Each stream in
order, their interleaving not kept (as under ``%%torchrun``); C stdio is flushed at the cell's
end. A background process the cell left keeps its pipe: its later output is not shown.
"""
from __future__ import annotations

import codecs
import contextvars
import ctypes
import io
import os
import select
import sys
import threading

_CHUNK = 1 << 16
_ATTR = "_ddp_lesson_fd_capture"


def _flush_c_stdio() -> None:
    """``fflush(NULL)``: C stdio's buffered output (``printf``) written to its descriptor now."""
    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):
        pass


class FdStream:
    """File descriptor ``fd`` and ``sys.<name>`` writing to one pipe while started; a thread
    forwards what comes out of it to ``sink`` (the stream ``sys.<name>`` was), in order."""

    def __init__(self, fd: int, name: str):
        self.fd, self.name = fd, name
        self.sink = self.stream = None
        self._saved = self._read = self._wake = None
        self._drained = threading.Event()

    def start(self) -> None:
        self.sink = getattr(sys, self.name)
        try:
            self.sink.flush()
        except (AttributeError, OSError, ValueError):
            pass
        self._read, write = os.pipe()
        wake_read, self._wake = os.pipe()
        self._saved = os.dup(self.fd)
        os.dup2(write, self.fd)
        os.close(write)
        # as python -u makes sys.stdout: text straight to the raw descriptor, no buffer
        self.stream = io.TextIOWrapper(io.FileIO(self.fd, "w", closefd=False), encoding="utf-8",
                                       errors="backslashreplace", write_through=True)
        context = contextvars.copy_context()  # the cell's own (its parent header, in ipykernel)
        threading.Thread(target=context.run, args=(self._pump, wake_read), daemon=True,
                         name=f"ddp_lesson fd {self.fd}").start()
        setattr(sys, self.name, self.stream)

    def restore(self) -> None:
        """Back to the descriptor and stream of before; the pipe's write end is then held only by
        processes the cell left running."""
        if getattr(sys, self.name) is self.stream:
            setattr(sys, self.name, self.sink)
        os.dup2(self._saved, self.fd)
        os.close(self._saved)
        try:
            os.write(self._wake, b"x")  # the reader: empty the pipe as it is now, then stop
        except OSError:  # the reader has ended already (fd 1 closed by the cell: end of file)
            pass
        os.close(self._wake)

    def wait(self) -> None:
        """Until everything written before :meth:`restore` has been forwarded."""
        self._drained.wait()

    def _pump(self, wake_read: int) -> None:
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        try:
            eof = self._until_drained(decoder, wake_read)
        finally:
            self._drained.set()
            os.close(wake_read)
        if not eof:  # late output of a process left running: to the finished cell's stream
            os.set_blocking(self._read, True)
            while data := os.read(self._read, _CHUNK):
                self._forward(decoder.decode(data))
        os.close(self._read)

    def _until_drained(self, decoder, wake_read: int) -> bool:
        """Forward until end of file (True) or, once woken, until the pipe is empty (False)."""
        poller = select.poll()
        poller.register(self._read, select.POLLIN)
        poller.register(wake_read, select.POLLIN)
        stopping = False
        while True:
            if not stopping and wake_read in dict(poller.poll()):
                stopping = True  # every writer of this process is off the pipe: empty it
                os.set_blocking(self._read, False)
            try:
                data = os.read(self._read, _CHUNK)
            except BlockingIOError:  # empty, and a process left running still holds it
                return False
            if not data:
                self._forward(decoder.decode(b"", final=True))
                return True
            self._forward(decoder.decode(data))

    def _forward(self, text: str) -> None:
        if text:
            try:
                self.sink.write(text)
            except (OSError, ValueError):  # the sink was closed (engine shutting down)
                pass


class CellCapture:
    """fds 1 and 2 captured from :meth:`start` to :meth:`stop` (see the module's docstring)."""

    def __init__(self):
        self.streams: list[FdStream] = []

    def start(self, *_info) -> None:
        self.stop()  # one left by a cell whose end never came (an interrupt inside stop)
        _flush_c_stdio()  # C output of before goes where it was going
        for fd, name in ((1, "stdout"), (2, "stderr")):
            stream = FdStream(fd, name)
            stream.start()
            self.streams.append(stream)

    def stop(self, *_result) -> None:
        streams, self.streams = self.streams, []
        if not streams:
            return
        _flush_c_stdio()
        for stream in reversed(streams):
            stream.restore()
        for stream in streams:
            stream.wait()


def capture_cells(shell) -> CellCapture:
    """Capture fds 1 and 2 during every cell ``shell`` (an IPython shell) runs from its next one:
    started by ``pre_run_cell``, drained by ``post_run_cell``, both before the cell's reply.
    Idempotent."""
    capture = getattr(shell, _ATTR, None)
    if capture is None:
        capture = CellCapture()
        shell.events.register("pre_run_cell", capture.start)
        shell.events.register("post_run_cell", capture.stop)
        setattr(shell, _ATTR, capture)
    return capture
