"""The quick tier: which tests are ``slow``, and the guard that keeps the list true.

``pytest -m "not slow"`` runs every single-process test (CONTRIBUTING.md, "Tests"). A test is
``slow`` when it starts a process: a torchrun launch, a process group in a subprocess, a
JupyterLab server or a browser, a script run with ``sys.executable``. nbval's notebook replays
are ``slow`` too (``notebooks/conftest.py`` marks them).

:data:`SLOW` names the slow tests, file by file (a path below ``tests/``): :data:`ALL` for a file
whose every test is slow, else the names of its slow test functions (parametrized ids share
their function's name). ``tests/conftest.py`` adds the ``slow`` marker from it at collection.

The list cannot drift silently, in either direction:

* a test not marked slow that starts a process fails, naming itself and the command
  (:func:`no_process_starts`, active during the setup and call of every test not marked slow,
  so a module-scoped fixture that launches torchrun counts against the first test that needs
  it);
* ``tests/project/test_tiers.py`` fails for an entry naming a file or a test function that does
  not exist (a renamed or moved test).
"""

from __future__ import annotations

import ast
import contextlib
import functools
import multiprocessing.process
import os
import re
import subprocess
from pathlib import Path

TESTS = Path(__file__).resolve().parent
_POPEN = subprocess.Popen  # the real class, whatever a test later puts in its place

#: Every test of the file is slow.
ALL = "*"

#: Short-lived system tools that libraries call on their own (``platform`` runs ``uname``,
#: ``ctypes.util.find_library`` runs ``ldconfig``, matplotlib runs ``fc-list``): starting one of
#: these is not a test starting a process.
TOOLS = frozenset({"uname", "ldconfig", "fc-list", "gcc", "cc", "ld", "objdump", "git"})

#: The slow tests, by file below ``tests/``. Keep each file's entry next to its folder-mates.
SLOW: dict[str, str | frozenset[str]] = {
    "collectives/test_collectives.py": frozenset({
        "test_against_all_reduce_world_sizes_one_to_four",
        "test_core_and_hardened_ring_equal_torch_all_reduce",
        "test_odd_world_dtypes_and_reduce_scatter",
        "test_world_of_one_and_argument_errors",
    }),
    "collectives/test_flight.py": frozenset({
        "test_ranks_that_called_different_collectives",
        "test_an_all_reduce_of_different_sizes_returns_on_one_rank",
        "test_a_rank_that_never_called_the_collective",
        "test_a_rank_that_died_without_a_record",
        "test_a_job_that_went_well",
        "test_the_command_line_prints_the_ledger_and_exits_2_without_dumps",
        "test_torchs_own_analyzer_stops_on_gloo_dumps",
        "test_a_peer_behind_a_failed_rank_is_recorded_stuck",
    }),
    "collectives/test_cost_model.py": frozenset({
        "test_bench_cli_runs_a_tiny_sweep",
    }),
    "convert/test_compare.py": frozenset({
        "test_the_package_pair_trains_the_same_weights",
        "test_broken_conversions_are_flagged",
    }),
    "convert/test_convert.py": frozenset({
        "test_the_ddp_run_ends_where_the_single_process_run_ends",
        "test_the_single_script_is_deterministic_and_saves_a_loadable_checkpoint",
        "test_on_two_gpus_the_ddp_script_ends_where_one_gpu_ends",
        "test_05_1_accepts_two_correct_answers_written_differently",
        "test_05_1_names_the_missing_piece",
        "test_05_1_a_collective_only_rank_0_reaches_is_named_not_hung",
    }),
    "ddp/test_compile_ddp.py": frozenset({
        "test_three_ranks_parts_predicted_gradients_within_tolerance",
    }),
    "ddp/test_ddp_profile.py": frozenset({"test_a_profiled_step_on_two_ranks"}),
    "ddp/test_ddp_buckets.py": frozenset({
        "test_bucketed_ddp_builds_torchs_buckets",
        "test_torch_rebuilds_other_buckets_when_forward_runs_out_of_registration_order",
    }),
    "ddp/test_ddp_core.py": frozenset({
        "test_bucketed_core_launches_from_the_hooks_while_backward_runs",
    }),
    "ddp/test_ddp_dropin.py": ALL,
    "ddp/test_torch_claims_04.py": frozenset({
        "test_claim3_buckets_rebuilt_only_without_find_unused_parameters",
        "test_claim5_broadcast_buffers_deprecated_forward_sync_buffers_still_syncs_at_init",
    }),
    "ddp/test_ddp_equality.py": ALL,
    "ddp/test_ddp_labs.py": frozenset({
        "test_overlap_lab_records_timelines_and_sweep",
    }),
    "ddp/test_ddp_pitfalls.py": ALL,
    "ddp/test_ddp_where_torch_works.py": ALL,
    "ddp/test_gradients.py": frozenset({
        "test_real_all_reduce_and_ddp_on_two_processes",
    }),
    "ddp/test_torch_reducer.py": frozenset({
        "test_bf16_compress_hook_refused_by_the_build",
        "test_comm_hooks_bytes_error_and_loss",
        "test_fp16_sum_overflows_where_pre_division_stays_finite",
        "test_real_buckets_one_then_four_in_reverse_order",
        "test_static_graph_and_gradient_as_bucket_view",
    }),
    "evaluation/test_evaluation.py": frozenset({
        "test_a10_per_batch_collective_over_uneven_shards_times_out_not_hangs",
        "test_a3_eval_lab_as_notebook_02_shows_it",
        "test_exact_classification_accuracy_at_world_sizes_1_2_3",
        "test_exact_evaluation_is_identical_to_one_process_at_world_sizes_1_2_3",
    }),
    "evaluation/test_metrics.py": frozenset({
        "test_all_reduced_confusion_equals_single_process",
    }),
    "exercises/test_exercises_build_ddp.py": frozenset({
        "test_correct_answers_written_differently_pass",
        "test_04_3_naive_ddp_refuses_the_plausible_wrong_answers",
        "test_04_4_bucketed_ddp_checks_weights_buckets_overlap_and_no_sync",
        "test_06_5_global_count_loss_names_the_normalisation",
        "test_08_5_zero1_checks_the_update_and_the_sharded_state",
    }),
    "exercises/test_exercises.py": frozenset({
        "test_01_4_weighted_average",
        "test_01_5_average_gradients",
        "test_02_1_hint_names_the_case_that_differs_and_guesses_no_cause",
        "test_02_1_reference_passes_through_the_public_check",
        "test_02_1_sampler_rejects_the_typical_mistakes",
        "test_02_3_seed_epoch_check",
        "test_02_4_empty_shard_crash_is_reported_not_hung",
        "test_02_4_exact_accuracy",
        "test_03_6_a_ring_may_not_call_torchs_all_reduce",
        "test_03_6_chunking_that_breaks_below_world_size_is_reported",
        "test_03_6_names_a_recv_from_anyone_and_a_send_to_itself",
        "test_03_6_ring_all_reduce",
        "test_04_2_fp16_comm_hook_under_torch_ddp",
        "test_08_4_gather_flat",
        "test_a_collective_only_one_rank_calls_ends_in_a_verdict_not_a_hang",
        "test_a_deadlocked_exchange_ends_in_a_verdict",
        "test_a_rank_that_exits_is_named",
        "test_a_size_mismatch_on_the_wire_is_named_as_such",
        "test_what_a_function_returns_is_checked_before_it_is_judged",
    }),
    "gpu/test_gpu.py": frozenset({
        "test_bucketed_ddp_equals_torch_ddp_on_cuda",
        "test_doctor_finds_another_process_holding_gpu_0",
        "test_checkpoint_loads_onto_each_ranks_own_gpu",
        "test_nccl_all_reduce_at_world_size_min_2_gpus",
        "test_torch_sync_batchnorm_on_cuda_uses_the_global_batch_statistics",
        "test_torchrun_cell_on_cuda_picks_nccl_and_one_gpu_per_rank",
        "test_trainer_one_epoch_on_cuda_with_amp_bf16",
        "test_trainer_one_epoch_on_cuda_with_amp_fp16_saves_the_scaler",
    }),
    "gpu/test_gpucheck.py": frozenset({
        "test_on_cpu_the_command_skips_every_gpu_step_and_writes_the_json",
        "test_a_notebook_is_executed_into_the_scratch_folder_and_its_errors_named",
        "test_the_gpu_test_step_runs_pytests_gpu_group_and_counts_it",
        "test_the_ddp_step_times_bucketed_against_torch_without_the_link_on_gloo",
        "test_a_command_past_its_timeout_is_ended_with_its_children",
        "test_the_training_steps_command_runs_the_trainer_and_its_judge_reads_the_summary",
        "test_the_bandwidth_steps_command_reaches_the_bench_which_wants_nccl",
    }),
    "launch/test_clinic.py": frozenset({
        "test_stack_dump_on_sigusr1_shows_where_a_rank_waits",
    }),
    "launch/test_cluster.py": frozenset({
        "test_a_rank_that_raises_while_its_peer_waits_is_shown_at_once",
        "test_error_on_one_rank_named_and_ranks_usable_afterwards",
        "test_hang_ended_by_timeout_names_waiting_rank_and_restarts_cleanly",
        "test_interrupt_reaches_the_ranks_and_keeps_the_cluster",
        "test_kernel_restart_and_sigkill_leave_no_process_or_file",
        "test_notebook_01_ranks_cells_replay_their_stored_output_three_times",
        "test_notebook_04_ranks_cells_replay_their_stored_output",
        "test_a_process_left_running_neither_holds_its_cell_nor_shows_in_the_next",
        "test_rank_ordered_deterministic_output",
        "test_rank_selection",
        "test_start_line_names_ranks_backend_and_why",
        "test_state_kept_across_cells",
        "test_stop_is_clean_and_leaves_no_process_or_file",
        "test_writes_that_bypass_python_come_in_program_order_20_times",
    }),
    "launch/test_doctor.py": frozenset({
        "test_a_missing_gloo_interface_is_what_makes_gloo_fail",
        "test_a_docker_sized_shm_is_a_problem",
        "test_a_leftover_torchrun_is_found",
        "test_own_torchrun_agent_is_not_a_leftover",
        "test_ddp_lesson_doctor_command_exits_1_on_a_problem",
    }),
    "launch/test_job_failures.py": frozenset({
        "test_a_raising_rank_with_and_without_record",
        "test_a_killed_rank_has_a_signal_and_no_error_file",
        "test_monitored_barrier_names_the_hanging_rank",
        "test_log_dir_redirects_and_tee",
        "test_torch_distributed_debug_levels",
    }),
    "launch/test_elastic.py": frozenset({
        "test_kill_mid_epoch_between_checkpoints_recovers_bit_identical",
        "test_kill_right_after_a_checkpoint_recovers_bit_identical",
        "test_two_nodes_of_one_process_train_the_same_weights",
    }),
    "launch/test_env.py": frozenset({
        "test_init_distributed_and_cleanup_on_three_ranks",
    }),
    "launch/test_forkserver.py": ALL,
    "launch/test_launch.py": frozenset({
        "test_a_ranks_sigterm_handler_gets_torchruns_grace",
        "test_check_false_returns_the_failure_instead",
        "test_error_message_carries_the_cause_and_args_may_be_a_string",
        "test_failing_rank_raises_with_its_traceback",
        "test_interrupt_leaves_no_process",
        "test_killing_the_launcher_outright_leaves_no_orphans",
        "test_launches_at_once_get_different_ports_and_come_back_in_job_order",
        "test_magic_prints_backend_once_then_ranks_in_order",
        "test_module_and_script_targets_get_their_arguments",
        "test_omp_banner_silenced_and_threads_set_when_unset",
        "test_outputs_come_back_in_rank_order_whatever_the_finishing_order",
        "test_raw_torchrun_omp_banner",
        "test_timeout_ends_every_process",
        "test_two_simulated_nodes_form_one_job",
        "test_workers_get_backend_threads_and_a_real_process_group",
    }),
    "launch/test_launcher_contract.py": frozenset({
        "test_a_cell_that_prints_warns_and_prints_replays_five_times",
        "test_cell_program_ends_as_under_plain_torchrun",
        "test_in_a_kernel_busy_throughout_text_status_and_one_line_interrupt",
        "test_progress_bars_stderr_names_temp_folder_and_sockets",
        "test_a_peer_waiting_in_a_collective_is_a_consequence_not_the_cause",
        "test_the_first_failing_rank_is_named_and_later_ones_listed_as_consequences",
    }),
    "launch/test_preemption.py": ALL,
    "launch/test_procs.py": ALL,
    "launch/test_torchrun_env.py": frozenset({
        "test_plain_torchrun_defaults",
        "test_shared_store_follows_restarts",
    }),
    "models/test_data.py": frozenset({
        "test_dataloader_workers_see_the_same_samples",
    }),
    "models/test_models.py": frozenset({
        "test_ddp_without_find_unused_parameters",
    }),
    "notebooks/test_browser.py": ALL,
    "notebooks/test_notebook_claims_02.py": frozenset({
        "test_02_eval_under_no_grad_one_buffer_broadcast_and_no_per_batch_collective",
        "test_02_numpy_in_a_worker_is_not_seeded_base_seed_plus_worker_id",
    }),
    "sampler/test_sampler_multiproc.py": frozenset({
        "test_a2_same_seed_and_epoch_partition_on_every_rank",
        "test_core_and_hardened_equal_torch_on_two_and_three_ranks",
        "test_every_rank_gets_torchs_shard_through_a_real_dataloader",
        "test_one_epoch_touches_each_index_once_or_exactly_the_padding",
        "test_shards_lab_report_as_the_notebook_shows_it",
    }),
    "sampler/test_sampler_weighted.py": frozenset({
        "test_issue_case_103_items_two_ranks_two_real_workers_each_item_once",
    }),
    "seedfix/test_seedfix.py": frozenset({
        "test_the_seed_fails_on_its_own_with_the_traceback",
        "test_the_repaired_program_runs_on_its_own_without_a_warning",
        "test_on_gpus_the_repaired_program_takes_a_gpu_per_rank",
    }),
    "train/test_bad_input.py": frozenset({
        "test_a_failed_summary_write_on_rank_0_raises_on_every_rank",
        "test_every_rank_exits_and_only_rank_0_reports",
        "test_static_graph_with_no_sync_fails_in_torch_as_the_refusal_says",
    }),
    "train/test_checkpoint.py": frozenset({
        "test_a_good_save_sweeps_a_killed_writers_file_but_not_a_live_ones",
        "test_any_failure_on_rank0_raises_on_every_rank_at_once",
        "test_b12_ddp_keys_carry_the_prefix_and_the_helper_strips_it",
        "test_b14_save_then_load_on_every_rank",
        "test_cli_kill_during_save_recovers_and_leaves_no_temporary",
        "test_sweep_removes_only_dead_writers_files_of_this_checkpoint",
        "test_the_run_names_rank_0_not_the_rank_it_told",
    }),
    "train/test_step_host_reads.py": frozenset({
        "test_the_trainers_steps_read_nothing_to_the_host",  # world_of_one
    }),
    "train/test_syncbn.py": frozenset({
        "test_a_rank_with_an_empty_batch",
        "test_bf16_input_keeps_torchs_dtype",
        "test_b11_exact_values",
        "test_converted_model_under_ddp_equals_one_process_on_the_global_batch",
        "test_unequal_batches_match_batchnorm_on_the_concatenated_batch",
        "test_when_to_synchronise_is_torchs_rule",
        "test_eval_with_one_more_batch_on_one_rank_does_not_communicate",
    }),
    "train/test_token_loss.py": frozenset({
        "test_the_batch_has_unequal_token_counts",
        "test_only_the_global_token_count_matches_one_process",
        "test_fp16_divide_before_the_sum",
        "test_printed_lines",
    }),
    "train/test_train.py": frozenset({
        "TestMultiProcess",
        "test_single_process_run",
        "test_trainer_wraps_torchs_ddp_with_torchs_default_buckets",
    }),
    "train/test_train_accum.py": frozenset({
        "test_accumulation_equals_one_step_on_the_larger_batch",
        "test_b4_sync_on_the_last_micro_batch",
        "test_b5_mean_matches_one_process_and_sum_is_off_by_r",
    }),
    "train/test_train_amp.py": ALL,
    "train/test_train_resize.py": ALL,
    "train/test_train_resume.py": frozenset({
        "test_three_ranks_resume_is_bit_identical_with_torch_ddp",
        "test_two_ranks_interrupted_and_resumed_are_bit_identical",
    }),
    "zero/test_fsdp.py": ALL,
    "zero/test_zero_dcp.py": ALL,
    "zero/test_zero.py": frozenset({
        "test_core_and_hardened_equal_adamw_and_torch_zero",
        "test_equal_to_ddp_adamw_and_torch_zero",
        "test_losses_match_a_single_process_run",
        "test_optimizer_state_is_one_over_world_size",
        "test_single_rank_equals_adamw_and_errors",
    }),
}


def slow_entry(path: Path) -> str | frozenset[str] | None:
    """``SLOW``'s entry for the test file at ``path`` (absolute), or None."""
    try:
        rel = path.resolve().relative_to(TESTS).as_posix()
    except ValueError:
        return None
    return SLOW.get(rel)


def is_listed_slow(path: Path, names) -> bool:
    """Whether the test at ``path`` named ``names`` (its function and, for a method, its
    class: either may be listed) is in :data:`SLOW`."""
    entry = slow_entry(path)
    return entry == ALL or (entry is not None and any(n in entry for n in names))


@functools.cache
def reads_notebooks(path: Path) -> bool:
    """Whether the test file at ``path`` reads the notebooks' stored files: it imports
    ``notebook_cells`` or ``nbformat``, or names an ``.ipynb`` (the ``notebook`` marker)."""
    if path.suffix != ".py" or TESTS not in path.resolve().parents:
        return False
    return re.search(r"notebook_cells|nbformat|\.ipynb", path.read_text()) is not None


def test_functions(path: Path) -> set[str]:
    """Names of the module-level ``test*`` functions and ``Test*`` classes in ``path``."""
    tree = ast.parse(path.read_text())
    return {node.name for node in tree.body
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.name.startswith("test")
            or isinstance(node, ast.ClassDef) and node.name.startswith("Test")}


def stale_entries() -> list[str]:
    """Entries of :data:`SLOW` naming a file or a test function that does not exist."""
    stale = []
    for rel, entry in sorted(SLOW.items()):
        path = TESTS / rel
        if not path.is_file():
            stale.append(f"{rel}: no such test file")
            continue
        if entry == ALL:
            continue
        missing = sorted(set(entry) - test_functions(path))
        stale.extend(f"{rel}::{name}: no such test function" for name in missing)
    return stale


def _command_name(args) -> str:
    first = args if isinstance(args, (str, bytes, os.PathLike)) else next(iter(args), "")
    first = os.fsdecode(first)
    return os.path.basename(first.split()[0]) if first.strip() else ""


class _Guard:
    """What :func:`no_process_starts` patches, and the test it reports against."""

    def __init__(self, test: str, fail):
        self.test, self.fail, self.started = test, fail, []

    def refuse(self, what: str):
        self.started.append(what)
        self.fail(f"{self.test} starts a process ({what}) but is not marked slow: add it to "
                  "SLOW in tests/tiers.py (the quick tier, pytest -m 'not slow', runs no "
                  "process)")


@contextlib.contextmanager
def no_process_starts(test: str, fail):
    """Within the block, starting a process calls ``fail(message)`` (``pytest.fail``) instead.

    Covers ``subprocess`` (so ``asyncio`` subprocesses and Playwright's driver too),
    ``multiprocessing`` and ``torch.multiprocessing`` processes, ``os.fork``, ``os.forkpty``,
    ``os.posix_spawn[p]`` and ``os.system``, from any thread. :data:`TOOLS` are let through.
    Yields the guard; ``guard.started`` lists what was refused (a test that swallowed the
    failure still fails on it).
    """
    guard = _Guard(test, fail)
    # The class itself, as imported: a test may replace ``subprocess.Popen`` (monkeypatch) while
    # the guard is active, and restoring ``_execute_child`` on the replacement instead of the
    # class would leave the guard installed for every later test.
    popen = _POPEN
    original_child = popen._execute_child
    original_start = multiprocessing.process.BaseProcess.start
    originals = {name: getattr(os, name) for name in
                 ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system") if hasattr(os, name)}

    def execute_child(self, args, *rest, **kwargs):
        if _command_name(args) not in TOOLS:
            guard.refuse(f"subprocess {_shown(args)}")
        return original_child(self, args, *rest, **kwargs)

    def start(self):
        guard.refuse(f"multiprocessing {type(self).__name__}")

    def refusing(name):
        def refused(*args, **kwargs):
            guard.refuse(f"os.{name}({repr(args[0])[:120] if args else ''})")
        return refused

    popen._execute_child = execute_child
    multiprocessing.process.BaseProcess.start = start
    for name in originals:
        setattr(os, name, refusing(name))
    try:
        yield guard
    finally:
        popen._execute_child = original_child
        multiprocessing.process.BaseProcess.start = original_start
        for name, fn in originals.items():
            setattr(os, name, fn)


def _shown(args) -> str:
    text = repr(args if isinstance(args, (str, bytes)) else list(args))
    return text if len(text) <= 120 else text[:117] + "..."
