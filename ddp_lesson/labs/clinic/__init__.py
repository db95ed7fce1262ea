"""The hang clinic: small broken data-parallel programs that end in a clear error, not a hang.

Each module runs under torchrun (``-m ddp_lesson.labs.clinic.<name>``), joins the group with
a 5 s timeout (``init_distributed(timeout=5)``: gloo raises after the process group's timeout
instead of waiting the default 10 minutes), registers a faulthandler stack dump on SIGUSR1,
and takes ``--fixed`` to run the repaired program:

* :mod:`.partial_collective`: a collective only some ranks call;
* :mod:`.shape_mismatch`: ``all_reduce`` with different shapes on different ranks;
* :mod:`.uneven_batches`: ranks with different numbers of batches under DDP, fixed with
  ``torch.distributed.algorithms.Join``;
* :mod:`.model_mismatch`: a model that differs between ranks (DDP's constructor refuses it);
* :mod:`.missing_rank`: a world size that does not match the launch, so one rank never joins.

Notebook 06 runs them and reads the errors; tests/test_clinic.py asserts each error.
"""
CASES = ("partial_collective", "shape_mismatch", "uneven_batches", "model_mismatch",
         "missing_rank")

#: What :func:`diagnose` looks for in the ranks' stderr, most specific first.
SIGNATURES = (
    ("model differs between ranks", "appears not to match sizes of the same param"),
    ("mismatched collectives", "Detected mismatch between collectives on ranks"),
    ("a rank never joined", "DistStoreError: wait timeout"),
    ("timeout", "Timed out waiting"),
    ("a peer crashed", "Connection closed by peer"),
)


def diagnose(result) -> str:
    """Name what ended a clinic run, from the ranks' stderr: the first of :data:`SIGNATURES`
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
