"""Every checkable exercise of notebooks 00-09, one module each, named by id and topic;
importing this package registers them all in :data:`ddp_lesson.exercises.registry.REGISTRY`.

Each module holds its inputs, how a rank runs the candidate (``_rank``) or a local one is
called (``_run``), the judge (comparing with the package, computed here) and its ``register``
call. Inputs are functions of the rank and of fixed seeds, so a verdict is the same anywhere.
"""
from . import (  # noqa: F401  (imported to register)
    ex_00_3_local_rank,
    ex_01_4_weighted_average,
    ex_01_5_average_gradients,
    ex_02_1_sampler,
    ex_02_3_seed_epoch,
    ex_02_4_exact_accuracy,
    ex_03_3_tree_vs_ring,
    ex_03_6_ring_all_reduce,
    ex_04_2_fp16_hook,
    ex_04_3_naive_ddp,
    ex_04_4_bucketed_ddp,
    ex_04_9_exposed_share,
    ex_05_1_convert_loop,
    ex_06_4_effective_lr,
    ex_06_5_global_count_loss,
    ex_07_5_global_rank,
    ex_07_6_stuck_rank,
    ex_08_1_zero3_ranks,
    ex_08_4_gather_shards,
    ex_08_5_zero1,
    ex_08_6_fits_per_rank,
    ex_09_1_compute_bound_batch,
)
