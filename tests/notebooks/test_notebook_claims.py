"""Notebooks 00, 01 and 08 (and their deep dives): numbers in prose bound to stored outputs,
sentences about torch bound to torch's source (torch 2.13)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from ddp_lesson.gpt import TinyGPT
from ddp_lesson.memory import memory_per_rank

ROOT = Path(__file__).resolve().parents[2]
TORCH_DIST = Path(torch.__file__).parent / "distributed"


def _nb(name):
    cells = json.loads((ROOT / "notebooks" / name).read_text())["cells"]
    prose = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    out = "\n".join("".join(o.get("text", "")) for c in cells if c["cell_type"] == "code"
                    for o in c.get("outputs", []) if o.get("output_type") == "stream")
    return prose, out


def test_07_fp32_adamw_memory_line():
    m = TinyGPT(vocab_size=103)
    n, tensors = m.num_params(), len(list(m.parameters()))
    mem = memory_per_rank(n, 1, 0, param_bytes=4, grad_bytes=4, optimizer_bytes=8)
    assert (mem.params_bytes, mem.grads_bytes, mem.optimizer_bytes) == (461_312, 461_312, 922_624)
    assert mem.optimizer_bytes + 4 * tensors == 922_740
    # the formula's row and the measured one in the deep dive's lab (fp32 AdamW, step counters)
    _, out = _nb("deep/08_when_to_shard.ipynb")
    for row in ("DDP measured", "DDP formula"):
        assert re.search(rf"{row} +461,312 +461,312 +922,740 +1,845,364", out), row
    # the ZeRO lab's measured unsharded state is the same number
    _, out = _nb("08_beyond_ddp_zero_fsdp.ipynb")
    assert "unsharded optimizer state per rank: 922,740 bytes" in out
    # AdamW keeps exactly these two moments (and `step`) per parameter
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([p])
    p.grad = torch.ones(3)
    opt.step()
    assert sorted(opt.state[p]) == ["exp_avg", "exp_avg_sq", "step"]
    assert torch.is_tensor(opt.state[p]["step"]) and opt.state[p]["step"].element_size() == 4


def test_07_zero_redundancy_optimizer_broadcasts_after_step():
    src = (TORCH_DIST / "optim" / "zero_redundancy_optimizer.py").read_text()
    step = src[src.index("    def step(\n"):]
    step = step[:step.index("\n    def ", 10)]
    assert "self._sync_params()" in step
    sync = src[src.index("    def _sync_params(self):"):]
    sync = sync[:sync.index("\n    def ", 10)]
    assert "self._broadcast_params_from_rank(rank)" in sync
    bcast = src[src.index("    def _broadcast_params_from_rank"):src.index("    def _sync_params")]
    assert "dist.broadcast(" in bcast


def test_07_fsdp_sentences_match_torch_source():
    coll = (TORCH_DIST / "fsdp" / "_fully_shard" / "_fsdp_collectives.py").read_text()
    assert "return dist.all_gather_single(" in coll          # what the lab wraps
    assert "return dist.reduce_scatter_single(" in coll
    state = (TORCH_DIST / "fsdp" / "_fully_shard" / "_fsdp_state.py").read_text()
    assert "For the root, do not reshard after forward" in state
    assert "all_gather_stream" in state                       # a separate stream on GPUs


def test_07_prose_numbers_are_the_stored_run():
    prose, out = _nb("deep/08_fsdp2_and_model_parallelism.ipynb")
    ratio = re.search(r"FSDP / DDP bytes sent per rank: ([\d.]+)", out).group(1)
    peak = re.search(r"while a block runs: [\d,]+ = ([\d.]+) of full", out).group(1)
    assert ratio == "1.43" and peak == "0.567"
    assert f"FSDP sent {ratio} times DDP's bytes" in prose
    assert f"{peak} of the full parameters" in prose
    assert "5 x all_gather_single" in out and "3 x reduce_scatter_single" in out
    assert "1 x all_reduce" in out
    assert "5 all-gathers" in prose and "3 reduce-scatters" in prose


def test_00_prose_matches_run_and_source():
    prose, out = _nb("deep/00_torchrun_internals.ipynb")
    assert "`TORCHELASTIC_USE_AGENT_STORE=True`, printed below" in prose
    assert "[rank 0] TORCHELASTIC_RESTART_COUNT=0 MASTER_ADDR=127.0.0.1 " \
           "TORCHELASTIC_USE_AGENT_STORE=True" in out
    assert "[rank 2] raw setup on gloo: all_reduce(sum of ranks) = 3" in out
    run = (TORCH_DIST / "run.py").read_text()
    assert "args.rdzv_id = str(uuid.uuid4())" in run          # --standalone: a random run id
    assert 'args.rdzv_endpoint = "localhost:0"' in run        # ... and a free local port
    agent = (TORCH_DIST / "elastic" / "agent" / "server" / "local_elastic_agent.py").read_text()
    for name in ("ROLE_NAME", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "TORCHELASTIC_MAX_RESTARTS",
                 "TORCHELASTIC_USE_AGENT_STORE"):
        assert f'"{name}":' in agent
        assert f"`{name}`" in prose
    # env:// reads RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT when they are not passed
    rdzv = (TORCH_DIST / "rendezvous.py").read_text()
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        assert f'_get_env_or_raise("{name}")' in rdzv
    # the agent restarts the workers while restarts remain, else stops them all
    api = (TORCH_DIST / "elastic" / "agent" / "server" / "api.py").read_text()
    run_loop = api[api.index("if self._remaining_restarts > 0:"):][:800]
    assert "self._restart_workers(self._worker_group)" in run_loop
    assert "self._stop_workers(self._worker_group)" in run_loop


def test_00_agent_sets_nccl_error_handling_and_error_file():
    """torchrun's agent gives every worker TORCH_NCCL_ASYNC_ERROR_HANDLING=1 unless it is set
    (torch's own default, outside torchrun, is 3) and TORCHELASTIC_ERROR_FILE; the deep dive's
    variable list names both and its run shows them."""
    agent = (TORCH_DIST / "elastic" / "agent" / "server" / "local_elastic_agent.py").read_text()
    assert ('"TORCH_NCCL_ASYNC_ERROR_HANDLING": os.getenv(\n'
            '                    "TORCH_NCCL_ASYNC_ERROR_HANDLING", str(1)') in agent
    mp_api = (TORCH_DIST / "elastic" / "multiprocessing" / "api.py").read_text()
    assert 'envs[local_rank]["TORCHELASTIC_ERROR_FILE"] = error_file' in mp_api
    header = Path(torch.__file__).parent / "include" / "torch" / "csrc" / "distributed" / "c10d"
    pg_nccl = (header / "ProcessGroupNCCL.hpp").read_text()
    assert "the default value (3 - SkipCleanUp)" in pg_nccl
    assert "TearDown = 1," in pg_nccl and "SkipCleanUp = 3" in pg_nccl
    prose, out = _nb("deep/00_torchrun_internals.ipynb")
    assert "| `TORCH_NCCL_ASYNC_ERROR_HANDLING` | 1 (TearDown) unless you set it" in prose
    assert "outside torchrun torch's default is 3 (SkipCleanUp)" in prose
    assert "| `TORCHELASTIC_ERROR_FILE` |" in prose
    for rank in range(2):
        assert f"[rank {rank}] TORCH_NCCL_ASYNC_ERROR_HANDLING = 1" in out
        assert f"[rank {rank}] TORCHELASTIC_ERROR_FILE set: True" in out


def test_00_legacy_launcher_passes_local_rank_flag_torchrun_does_not():
    """torch.distributed.launch (use_env False by default) appends --local-rank=N; torchrun
    (no use_env attribute) passes nothing, so a parser with only --local_rank is silent under
    torchrun and refuses the legacy launcher's flag."""
    run = (TORCH_DIST / "run.py").read_text()
    assert 'if not hasattr(args, "use_env"):\n        return True' in run
    assert ('    if not use_env:\n'
            '        cmd_args.append(f"--local-rank={macros.local_rank}")') in run
    launch = (TORCH_DIST / "launch.py").read_text()
    use_env = launch[launch.index('"--use-env",'):][:400]
    assert "default=False," in use_env and 'action="store_true",' in use_env, use_env
    import argparse
    seed = argparse.ArgumentParser()
    seed.add_argument("--local_rank", type=int, default=0)
    assert seed.parse_known_args([]) == (argparse.Namespace(local_rank=0), [])
    assert seed.parse_known_args(["--local-rank=1"]) == (argparse.Namespace(local_rank=0),
                                                          ["--local-rank=1"])
    prose, out = _nb("deep/00_torchrun_internals.ipynb")   # notebook 00's section 4 moved there
    assert "under torchrun that parser is\nsilent" in prose
    assert "since PyTorch 2.0 that launcher passes `--local-rank=N`" in prose
    assert "argv=['--local-rank=1']: local_rank=0, not understood: ['--local-rank=1']" in out
    assert "argv=[]: local_rank=0, not understood: []" in out


def test_00_launcher_box_default_timeout():
    """The launcher box's torch default for init_process_group's timeout (torch 2.13)."""
    import datetime

    from torch.distributed.constants import default_pg_timeout
    assert default_pg_timeout == datetime.timedelta(minutes=30)
    prose, _ = _nb("deep/00_torchrun_internals.ipynb")   # the box, moved from notebook 00
    assert "(torch 2.13's default: 30 min, NCCL 10)" in prose
    assert "`ddp-lesson doctor --nproc-per-node N`" in prose
    header = Path(torch.__file__).parent / "include" / "torch" / "csrc" / "distributed" / "c10d"
    pg_nccl = (header / "ProcessGroupNCCL.hpp").read_text()
    assert "std::chrono::milliseconds(10 * 60 * 1000);" in pg_nccl   # NCCL's own default


def test_01_join_shadows_only_its_joinables():
    """Join calls the hooks of the Joinables it is given only; DDP's join() warns that it is not
    aware of other collectives. The deep dive's run: Join with uneven batches, then a MIN flag
    that stops both ranks together."""
    join = (TORCH_DIST / "algorithms" / "join.py").read_text()
    assert "joinable.join_hook(**kwargs) for joinable in self._joinables" in join
    ddp = (Path(torch.__file__).parent / "nn" / "parallel" / "distributed.py").read_text()
    assert "context manager is not aware of non-DDP collective communication." in ddp
    assert "``throw_on_early_termination`` must be enabled" in ddp
    core, _ = _nb("01_data_parallelism.ipynb")
    assert "shadows only the collectives of the\nJoinables passed to it" in core
    assert "SyncBatchNorm still\nhangs" in core
    prose, out = _nb("deep/01_loss_scaling_and_lr_rules.ipynb")
    assert "is not aware of non-DDP collective\ncommunication" in prose
    assert "throw_on_early_termination=True" in prose
    assert "[rank 0] Join: ran my 3 batches" in out and "[rank 1] Join: ran my 2 batches" in out
    for rank in range(2):
        assert f"[rank {rank}] MIN flag: both stopped after 2 steps" in out


def test_01_deep_loss_scalings():
    """The deep dive's two scalings: R × sum loss gives the global sum gradient (60), R × sum
    loss / N the global mean (15)."""
    _, out = _nb("deep/01_loss_scaling_and_lr_rules.ipynb")
    assert out.splitlines()[:3] == ["R × sum loss, averaged by DDP: 60.0",
                                     "R × sum loss / N, averaged by DDP: 15.0",
                                     "single process, sum and mean loss: 60.0 15.0"]
