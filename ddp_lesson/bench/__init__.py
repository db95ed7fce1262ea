"""Benchmarks, dispatched from ``ddp-lesson bench {allreduce,ddp,scaling}`` (``ddp_lesson.cli``).

* :mod:`ddp_lesson.bench.allreduce` — all-reduce bandwidth: gloo, the ring built here, the link;
* :mod:`ddp_lesson.bench.ddp`       — steps/s of torch's DDP, NaiveDDP and BucketedDDP;
* :mod:`ddp_lesson.bench.scaling`   — the trainer at 1, 2 and 4 processes, weak and strong;
* :mod:`ddp_lesson.bench.common`    — their shared flags, the one CSV writer, min/median/max;
* :mod:`ddp_lesson.bench.claims`    — what the prose says about the stored results, each claim
  classified against the CSVs' min..max intervals ("faster" or "within noise");
* :mod:`ddp_lesson.bench.cluster`   — persistent ranks against one-shot torchrun cells, run on
  its own: ``python -m ddp_lesson.bench.cluster`` (it was ``python -m ddp_lesson.cluster --bench``).
* :mod:`ddp_lesson.bench.lr_recipe` — the batch-size and learning-rate recipe on TinyGPT: final
  loss at 1x and 4x a base global batch under each learning-rate rule, over seeds, on one
  process; run on its own: ``python -m ddp_lesson.bench.lr_recipe``.

Layering: ``common`` imports nothing from the package; the three benchmarks import ``common``
(and, inside functions, the lesson modules they time); nothing here imports ``ddp_lesson.cli``.
"""

#: name -> module of every ``ddp-lesson bench`` subcommand (each has ``add_arguments`` and ``run``).
BENCHMARKS = {"allreduce": "ddp_lesson.bench.allreduce", "ddp": "ddp_lesson.bench.ddp",
              "scaling": "ddp_lesson.bench.scaling"}
