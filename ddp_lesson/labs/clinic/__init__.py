"""The hang clinic: small broken data-parallel programs that end in a clear error, not a hang.

Each case runs under torchrun (``-m ddp_lesson.labs.clinic.<name>``), joins a gloo group
(gloo on GPUs too: the cases build CPU tensors, which NCCL refuses) whose collectives time
out after 5 s (gloo's default: 30 minutes; NCCL's: 10), dumps its stacks on SIGUSR1, runs the
repaired program with ``--fixed``, and with ``--flight-dir DIR`` leaves each rank's flight
record in ``DIR`` (written while it hangs, :class:`ddp_lesson.flight.HangWatch`;
``--flight-stacks`` adds the callers' file:line). The cases:

* :mod:`.partial_collective`: a collective only some ranks call;
* :mod:`.shape_mismatch`: ``all_reduce`` with different shapes on different ranks;
* :mod:`.uneven_batches`: ranks with different numbers of batches under DDP (fix: ``Join``);
* :mod:`.model_mismatch`: a model that differs between ranks (DDP's constructor refuses it);
* :mod:`.missing_rank`: a world size that does not match the launch, so one rank never joins.

:mod:`.fixed` runs every repaired program in one job; :func:`run_all` starts several
launches at once. Notebook 07 reads their errors; tests/launch/test_clinic.py asserts them.
"""
from __future__ import annotations

import re

CASES = ("partial_collective", "shape_mismatch", "uneven_batches", "model_mismatch",
         "missing_rank")

#: What :func:`diagnose` looks for in the ranks' stderr, most specific first.
SIGNATURES = (
    ("model differs between ranks", "appears not to match sizes of the same param"),
    ("mismatched collectives", "Detected mismatch between collectives on ranks"),
    ("a rank never joined", "DistStoreError: wait timeout"),
    # rank 0 hosting the workers' store (store sharing off, as in a run that can restart)
    # gave up waiting for the missing client before the others' wait for its key ended
    ("a rank never joined", "waiting for clients"),
    ("timeout", "Timed out waiting"),
    ("a peer crashed", "Connection closed by peer"),
)


def diagnose(result) -> str:
    """What ended a clinic run, from the ranks' stderr: the first of :data:`SIGNATURES`
    found, ``"finished"`` when every rank exited 0, else ``"other error"``.

    Args:
        result: a :class:`ddp_lesson.launch.TorchrunResult` (``run_torchrun(check=False)``).
    """
    if result.returncode == 0:
        return "finished"
    text = "".join(result.errors.values())
    for name, needle in SIGNATURES:
        if needle in text:
            return name
    return "other error"


#: Per broken case: the stable part of the error line that names what went wrong (a regular
#: expression), what notebook 07 prints and tests/launch/test_clinic.py asserts. Which rank raises
#: first, and whether gloo was waiting to send or to receive, can vary with the machine's load,
#: so neither is part of it.
TELLING = {
    "partial_collective": r"RuntimeError: Timed out waiting \d+ms",    # rank 0 waits alone
    "shape_mismatch": r"RuntimeError: Timed out waiting \d+ms",        # the missing element
    "uneven_batches": r"RuntimeError: Timed out waiting \d+ms",        # the 4th backward
    "model_mismatch": r"RuntimeError: \[1\]: params\[0\] in this process with sizes "
                      r"\[\d+, \d+\] appears not to match sizes of the same param in process 0\.",
    "missing_rank": r"DistStoreError: wait timeout after \d+ms",       # the group never fills
}


def telling_line(name: str, result) -> str:
    """The stable part of the error line that names what ended a broken clinic run.

    The ranks' stderr is searched in rank order for :data:`TELLING`'s pattern; torch's
    ``[rankN]:`` prefix, gloo's source location, the awaited operation and what follows are
    left out (no paths, ports or addresses). The timeout in ms is ``--timeout`` (``5000ms``).

    Args:
        name: one of :data:`CASES`.
        result: the case's :class:`ddp_lesson.launch.TorchrunResult` (``check=False``).

    Returns:
        e.g. ``"RuntimeError: Timed out waiting 5000ms"``, or ``"(no line matches ...)"``.

    Raises:
        KeyError: ``name`` is not a clinic case (names the known ones).
    """
    if name not in TELLING:
        raise KeyError(f"{name!r} is not a clinic case; known: {', '.join(TELLING)}")
    pattern = re.compile(TELLING[name])
    for rank in sorted(result.errors):
        for line in result.errors[rank].splitlines():
            line = re.sub(r"\[/[^\]]*:\d+\] ", "", line)  # gloo's source location
            found = pattern.search(line)
            if found:
                return found.group(0)
    return f"(no line matches {TELLING[name]!r})"


def split_cases(lines: list[str]) -> dict[str, list[str]]:
    """One rank's output lines of :mod:`.fixed` as ``{case: [its lines]}``, cut at its
    ``== <case>`` headers, in the order the cases ran (lines before the first header dropped).
    """
    cases: dict[str, list[str]] = {}
    current = None
    for line in lines:
        if line.startswith("== "):
            current = cases.setdefault(line[3:], [])
        elif current is not None:
            current.append(line)
    return cases


def run_all(runs: dict, *, timeout: float = 120.0, nproc_per_node: int = 2) -> dict:
    """Start several clinic launches at once and wait for all: ``{label: TorchrunResult}``.

    Each is a :func:`ddp_lesson.launch.run_torchrun` of a clinic module (gloo, ``check=False``)
    in a thread of its own, with its own store, ports and folder; the broken cases mostly wait
    for their timeout, so together they take about as long as the slowest. In a notebook one
    live line counts the finished runs; results come back in the order of ``runs``, so what a
    cell prints is deterministic. Every rank is a client of torchrun's shared store (no case can
    restart), so ``missing_rank``'s error is the others' wait for its key whatever the load
    (:func:`ddp_lesson.launch.launch_env`).

    Args:
        runs: ``{label: (module, args)}`` or ``{label: (module, args, extra_env)}``, module
            relative to ``ddp_lesson.labs.clinic``, ``extra_env`` variables added for that run.
        timeout: wall-clock seconds for each run.
        nproc_per_node: processes per run.

    Raises:
        ddp_lesson.launch.TorchrunTimeout: a run outlived ``timeout`` (raised once all are done).
        ddp_lesson.launch.TorchrunInterrupted: an interrupt; every process of every run is
            ended first (:func:`ddp_lesson.launch.run_torchrun_many`).
    """
    import os

    from ...launch import run_torchrun_many

    jobs = {}
    for label, (module, args, *extra) in runs.items():
        env = dict(os.environ, **(extra[0] if extra else {}))
        jobs[label] = dict(target=f"{__name__}.{module}", args=list(args), module=True,
                           nproc_per_node=nproc_per_node, timeout=timeout, backend="gloo",
                           check=False, env=env)
    return run_torchrun_many(jobs, label="hang clinic")
