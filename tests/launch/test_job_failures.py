"""Plain torchrun's failure output (ddp_lesson.labs.job_failures, deep dive 07 · debugging a real
job): each fact the deep dive prints, read back from its stored output (nbval's strict replay of
the deep dive in CI launches the same jobs live), plus the parser and masker on torchrun's own
summary format."""
import pytest
from notebook_cells import stream_text

from ddp_lesson.labs.job_failures import failures, mask, run_plain, summary

NB = "deep/07_debugging_a_real_job.ipynb"

#: torchrun's summary as torch 2.13 formats it (errors/__init__.py, _FAILURE_FORMAT_TEMPLATE),
#: for a SIGKILLed rank 1 and a rank 0 that raised (its error file written first).
SUMMARY = """torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
prog FAILED
------------------------------------------------------------
Failures:
[0]:
  time      : 2026-12-06_10:04:49
  host      : node7.cluster
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 7047)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 7047
------------------------------------------------------------
Root Cause (first observed failure):
[1]:
  time      : 2026-12-06_10:04:48
  host      : node7.cluster
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 7046)
  error_file: /tmp/torchelastic_c6/e0b1_xd/attempt_0/0/error.json
  traceback : Traceback (most recent call last):
    File "/home/u/.venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py", line 83
      return func(*args, **kwargs)
  RuntimeError: Read error [127.0.0.1]:2255: Connection reset by peer.
   Original exception:
  more
============================================================
"""


def test_mask_and_failures_read_torchruns_summary():
    text = mask(SUMMARY)
    for volatile in ("7047", "7046", "node7", "10:04", "/tmp/", "/home/", "2255"):
        assert volatile not in text
    assert 'File "torch/distributed/c10d_logger.py"' in text
    assert summary(text)[1] == "prog FAILED"
    table = failures(text)
    assert table["root"] == 0
    assert table[1] == {"exitcode": "-9 (SIGKILL)", "error_file": "<N/A>",
                        "says": "Signal 9 (SIGKILL) received by PID PID"}
    assert table[0] == {"exitcode": "1", "error_file": "LOG_DIR/.../attempt_0/0/error.json",
                        "says": "RuntimeError: Read error [127.0.0.1]:PORT: Connection reset by "
                                "peer."}
    assert summary("no failure here") == [] and failures("") == {}


def test_an_unknown_mode_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match="unknown mode 'crash'; known: raise, "):
        run_plain("crash")


def test_the_deep_dive_prints_what_torchrun_says():
    """The facts the deep dive's cells print, read from its stored outputs. Each cell launches
    plain torchrun (no output ignored, no sanitizing beyond the lab's own masks), so nbval's
    strict replay of the notebook in CI is the live check of every line asserted here: the
    suite does not launch the same jobs a second time. torch 2.13.0+cpu (and 2.14.1): DDP's
    constructor crashes under DETAIL on gloo; when a torch fixes it the replay fails, and the
    deep dive should show DETAIL's own message instead."""
    text = stream_text(NB, 'run_plain("raise")')
    assert "ValueError: rank 1: batch 3 has 7 samples, expected 8" in text
    assert "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html" in text
    assert "-9 (SIGKILL)" in stream_text(NB, 'run_plain("kill")')
    hang = stream_text(NB, 'run_plain("hang")')
    assert "root cause: rank 0" in hang
    assert "Rank 1 failed to pass monitoredBarrier in 2000 ms" in hang
    assert "-15 (SIGTERM)" in hang
    logs = stream_text(NB, '"--redirects", "3"')
    assert "console lines from the workers with --redirects 3: 0" in logs
    assert "[default1]:rank 1 of 2: started" in logs
    assert "rank 1's files: ['error.json', 'stderr.log', 'stdout.log']" in logs
    assert ("Detected mismatch between collectives on ranks.\n"
            "shapes named: ['TensorShape=[2]', 'TensorShape=[3]']") in stream_text(NB, '"shape"')
    unused = stream_text(NB, '"unused"')
    assert "OFF:\n  Parameter indices which did not receive grad for rank 1: 2 3\nINFO:" in unused
    assert "skipped.bias, skipped.weight" in unused
    assert "DETAIL:\n  a rank ended with -11 (SIGSEGV): True" in unused
