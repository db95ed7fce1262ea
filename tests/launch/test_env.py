"""ddp_lesson.env: torchrun's variables, the backend rule, the legacy --local_rank flag."""
from __future__ import annotations

import textwrap

import pytest

from ddp_lesson.env import DistEnv, choose_backend, print0, read_env, resolve_local_rank
from ddp_lesson.launch import run_torchrun


@pytest.mark.parametrize("nproc, gpus, expected, reason", [
    (1, 0, "gloo", "1 process and no GPU: using gloo on CPU"),
    (2, 0, "gloo", "2 processes and no GPU: using gloo on CPU"),
    (4, 1, "gloo", "4 processes but 1 GPU: using gloo on CPU"),
    (8, 8, "nccl", "8 processes and 8 GPUs: using nccl, one GPU per process"),
    (2, 8, "nccl", "2 processes and 8 GPUs: using nccl, one GPU per process"),
    (3, 2, "gloo", "3 processes but 2 GPUs: using gloo on CPU"),
])
def test_backend_rule(nproc, gpus, expected, reason):
    assert choose_backend(nproc, "auto", cuda_device_count=gpus) == (expected, reason)


def test_backend_overrides(monkeypatch):
    assert choose_backend(2, "gloo", cuda_device_count=8)[0] == "gloo"
    assert choose_backend(2, "nccl", cuda_device_count=2)[0] == "nccl"
    with pytest.raises(ValueError,
                       match="nccl needs one GPU per process: 4 processes but 1 GPU visible"):
        choose_backend(4, "nccl", cuda_device_count=1)
    with pytest.raises(ValueError, match="backend 'mpi' is not one of auto, gloo, nccl"):
        choose_backend(2, "mpi", cuda_device_count=0)
    with pytest.raises(ValueError, match="local_world_size must be >= 1, got 0"):
        choose_backend(0, "auto", cuda_device_count=0)
    # the environment variable is the default override
    monkeypatch.setenv("DDP_LESSON_BACKEND", "gloo")
    assert choose_backend(2, cuda_device_count=8)[0] == "gloo"
    monkeypatch.setenv("DDP_LESSON_BACKEND", "NCCL")
    assert choose_backend(2, cuda_device_count=2)[0] == "nccl"


def test_read_env_outside_torchrun_is_rank_0_of_1():
    env = read_env("gloo", environ={})
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size) == (0, 0, 1, 1)
    assert env.is_main and not env.distributed and env.device == "cpu"


def test_read_env_from_torchrun_variables():
    environ = {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4",
               "TORCHELASTIC_RUN_ID": "x"}
    env = read_env("gloo", environ=environ)
    assert env == DistEnv(5, 1, 8, 4, "gloo", "cpu",
                          "4 processes, gloo requested: using gloo on CPU")
    assert env.distributed and not env.is_main


def test_read_env_uses_the_launchers_choice_unless_asked_otherwise():
    environ = {"RANK": "1", "WORLD_SIZE": "2", "DDP_LESSON_LAUNCHER_BACKEND": "gloo",
               "DDP_LESSON_LAUNCHER_REASON": "2 processes and no GPU: using gloo on CPU"}
    env = read_env(environ=environ)
    assert (env.backend, env.reason) == ("gloo", "2 processes and no GPU: using gloo on CPU")
    # an explicit request in the rank's own code still wins
    assert read_env("gloo", environ=environ).reason == (
        "2 processes, gloo requested: using gloo on CPU")


@pytest.mark.parametrize("environ, message", [
    ({"RANK": "3", "WORLD_SIZE": "2"}, r"rank 3 is outside \[0, 1\]"),
    ({"RANK": "-1", "WORLD_SIZE": "2"}, r"rank -1 is outside \[0, 1\]"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE must be >= 1, got 0"),
    ({"RANK": "1", "LOCAL_RANK": "2", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"},
     r"local_rank 2 is outside \[0, 1\]"),
    ({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "3"}, r"LOCAL_WORLD_SIZE 3 is outside \[1, 2\]"),
    ({"RANK": "one"}, "environment variable RANK='one' is not an integer"),
])
def test_read_env_rejects_inconsistent_variables(environ, message):
    with pytest.raises(ValueError, match=message):
        read_env("gloo", environ=environ)


@pytest.mark.parametrize("argv, environ, expected", [
    (["--local-rank=1"], {}, 1),          # PyTorch >= 2.0 torch.distributed.launch
    (["--local_rank=1"], {}, 1),          # older torch.distributed.launch (the seed)
    (["--local_rank", "2", "--epochs", "3"], {}, 2),
    ([], {"LOCAL_RANK": "3"}, 3),         # torchrun: no flag, the variable
    ([], {}, 0),                          # nothing: a single process
    (["--local_rank=1"], {"LOCAL_RANK": "3"}, 3),  # the variable wins
])
def test_resolve_local_rank_cases_c1(argv, environ, expected):
    assert resolve_local_rank(argv, environ) == expected


def test_print0_prints_on_rank_0_only(capsys, monkeypatch):
    print0("hello", env=DistEnv(0, 0, 2, 2, "gloo", "cpu", ""))
    print0("hidden", env=DistEnv(1, 1, 2, 2, "gloo", "cpu", ""))
    monkeypatch.setenv("RANK", "1")
    print0("also hidden")
    assert capsys.readouterr().out == "hello\n"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_init_distributed_and_cleanup_on_three_ranks():
    """A real gloo group of 3: every rank joins, sums, tears down cleanly; one announcement."""
    code = textwrap.dedent("""
        import torch, torch.distributed as dist
        from ddp_lesson.env import init_distributed, cleanup
        env = init_distributed(timeout=30, announce=True)
        t = torch.tensor([2 ** env.rank])
        dist.all_reduce(t)
        print(f"rank {env.rank}/{env.world_size} local {env.local_rank} sum {int(t)} "
              f"initialized {dist.is_initialized()}")
        cleanup()
        print("after cleanup:", dist.is_initialized())
        cleanup()  # a second call is harmless
    """)
    result = run_torchrun(code=code, nproc_per_node=3, timeout=90, live=False, backend="gloo")
    assert result.rank_lines(0) == [
        "world_size=3: 3 processes, gloo requested: using gloo on CPU",
        "rank 0/3 local 0 sum 7 initialized True", "after cleanup: False"]
    for r in (1, 2):
        assert result.rank_lines(r) == [f"rank {r}/3 local {r} sum 7 initialized True",
                                        "after cleanup: False"]
