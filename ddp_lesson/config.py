"""The training job's configuration: one dataclass, the command line built from it, and the
numbers that follow from it. Parsing and arithmetic only, local to the calling process: no
file, folder, dataset or checkpoint is touched here (``tests/train/test_config_no_io.py``).

:class:`TrainConfig` has one field per flag of ``python -m ddp_lesson.train`` (its note is the
flag's ``--help``); :func:`parse_config` turns a command line into a checked config;
:func:`derived_values` gives the numbers that follow at a world size. Bad input raises
:class:`TrainInputError` naming the values. What reads the disk lives with what it reads:
:func:`ddp_lesson.data.load_datasets`, :func:`ddp_lesson.checkpoint.resume_plan`,
:func:`ddp_lesson.cli.preflight`.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import re
import sys
from dataclasses import dataclass, field

from .env import BACKENDS, print0
from .gradients import LR_RULES, scale_lr
from .layout import DataLayout
from .models import MODELS

#: Rules for ``--lr-scaling``: how the learning rate follows the global batch
#: (:func:`ddp_lesson.gradients.scale_lr`).
LR_SCALINGS = LR_RULES
#: ``--lr-schedule`` choices: constant, or DeepLab's "poly" decay ``(1 - step/total)**0.9``.
LR_SCHEDULES = ("constant", "poly")
#: ``--ddp`` choices: torch's DistributedDataParallel or the cores of ``ddp_lesson/core/``.
DDP_WRAPPERS = ("torch", "naive", "bucketed")
#: ``--amp`` choices: no autocast, autocast to bfloat16, autocast to float16 with a GradScaler.
AMP_MODES = ("off", "bf16", "fp16")


class TrainInputError(Exception):
    """Bad input the user can fix (flags, data folder, checkpoint, output folder).

    ``main`` prints it as one line, ``error: <message>``, on rank 0 and exits with status 2.
    Raised on every rank alike (rank 0's decisions are shared first): no rank waits in a
    collective.
    """

def _note(help_: str, *flags: str, **argparse_kwargs) -> dict:
    """Field metadata: the help text, extra flag spellings, and argparse extras."""
    return {"help": help_, "flags": flags, "argparse": argparse_kwargs}


@dataclass
class TrainConfig:
    """Everything the training job reads. One field = one command-line flag.

    The flag is ``--`` + the field name with ``_`` -> ``-`` (``num_train`` ->
    ``--num-train``), plus the spellings listed in the field's metadata (the seed's
    ``-b``/``-j``). Values are checked on construction; errors show the numbers.
    """

    # Defaults sized for a 2-core CPU: 2 gloo ranks finish in about 25-55 s, and the mIoU
    # climbs every epoch (about 0.21 -> 0.34), so there is something to watch.
    epochs: int = field(default=6, metadata=_note(
        "passes over the training set"))
    batch_size: int = field(default=8, metadata=_note(
        "samples per micro-batch on EACH rank; the global batch is batch_size x world_size "
        "x grad_accum_steps", "-b"))
    workers: int = field(default=0, metadata=_note(
        "DataLoader worker processes per rank; 0 loads in the training process, which keeps "
        "the CPU path light (each worker is another process competing for the cores)", "-j"))
    lr: float = field(default=0.05, metadata=_note(
        "SGD learning rate at the base global batch --base-batch (declared here; the seed "
        "read args.lr without declaring it)"))
    momentum: float = field(default=0.9, metadata=_note("SGD momentum, in [0, 1)"))
    weight_decay: float = field(default=1e-4, metadata=_note("SGD L2 weight decay, >= 0"))
    seed: int = field(default=0, metadata=_note(
        "seeds the model init (same on every rank), the synthetic data and the sampler's "
        "shuffle"))
    num_train: int = field(default=1024, metadata=_note("training samples (synthetic set)"))
    num_val: int = field(default=128, metadata=_note("validation samples (synthetic set)"))
    size: tuple = field(default=(64, 128), metadata=_note(
        "image height and width in pixels", nargs=2, type=int, metavar=("H", "W")))
    model: str = field(default="deeplab", metadata=_note(
        "network (ddp_lesson.models.build_model): deeplab = DeepLabV3Mini, tiny = TinyConvNet",
        choices=tuple(MODELS)))
    width: int = field(default=16, metadata=_note(
        "model width: channels of the first stage (not the image width, see --size)"))
    backend: str = field(default="auto", metadata=_note(
        "collective backend; auto = DDP_LESSON_BACKEND if set, else nccl when every rank "
        "can have its own GPU, gloo on CPU otherwise", choices=BACKENDS))
    data_root: str | None = field(default=None, metadata=_note(
        "Cityscapes root folder (leftImg8bit/, gtFine/); unset = synthetic scenes",
        type=str))
    out: str = field(default="runs/main", metadata=_note(
        "output folder; rank 0 writes checkpoint.pt and summary.json there, and a run finding "
        "a checkpoint there resumes from it"))
    grad_accum_steps: int = field(default=1, metadata=_note(
        "micro-batches per optimizer step (gradient accumulation); gradients are all-reduced "
        "once, on the last one (no_sync on the others)"))
    lr_scaling: str = field(default="none", metadata=_note(
        "how the learning rate follows the global batch G: none = --lr; linear = --lr x "
        "G/--base-batch; sqrt = --lr x sqrt(G/--base-batch)", choices=LR_SCALINGS))
    base_batch: int = field(default=16, metadata=_note(
        "the global batch at which --lr is given (the default lr was tuned at 16 = 8 x 2)"))
    lr_schedule: str = field(default="constant", metadata=_note(
        "learning-rate schedule over the optimizer steps: constant, or poly = "
        "(1 - step/total)^0.9 as in DeepLab", choices=LR_SCHEDULES))
    drop_last: bool = field(default=False, metadata=_note(
        "cut each epoch to equal shards without repeats (sampler) and drop each rank's last "
        "short batch (loader), instead of padding", action="store_true"))
    sync_bn: bool = field(default=False, metadata=_note(
        "BatchNorm statistics over the global batch: this package's SyncBatchNorm on CPU, "
        "torch's nn.SyncBatchNorm on GPUs", action="store_true"))
    ddp: str = field(default="torch", metadata=_note(
        "data-parallel wrapper: torch = DistributedDataParallel, naive / bucketed = "
        "notebook 04's ddp_lesson.core NaiveDDP / BucketedDDP", choices=DDP_WRAPPERS))
    amp: str = field(default="off", metadata=_note(
        "mixed precision: off = float32; bf16 = forward under torch.autocast in bfloat16; "
        "fp16 = autocast in float16 with one torch.amp.GradScaler per process (its state is "
        "checkpointed)", choices=AMP_MODES))
    clip_grad_norm: float | None = field(default=None, metadata=_note(
        "clip the total L2 norm of the all-reduced gradients to MAX once per optimizer step "
        "(after unscaling under fp16); the norm before clipping goes to summary.json "
        "(unset: no clipping)", type=float, metavar="MAX"))
    bucket_cap_mb: float | None = field(default=None, metadata=_note(
        "gradient bucket size in MB (2**20 bytes) for --ddp torch and --ddp bucketed, for "
        "every bucket; unset: torch's default, 1 MB for the first bucket sent (the last "
        "layers') and 25 MB for the others; smaller buckets: more all_reduce calls, started "
        "earlier",
        type=float, metavar="MB"))
    static_graph: bool = field(default=False, metadata=_note(
        "pass static_graph=True to torch's DDP (--ddp torch only)", action="store_true"))
    gradient_as_bucket_view: bool = field(default=False, metadata=_note(
        "pass gradient_as_bucket_view=True to torch's DDP: .grad tensors become views into "
        "the buckets, saving one copy of the gradients (--ddp torch only)",
        action="store_true"))
    checkpoint_every_steps: int = field(default=0, metadata=_note(
        "also write the checkpoint every N optimizer steps (0: only at each epoch end)"))
    no_resume: bool = field(default=False, metadata=_note(
        "start over even if --out holds a checkpoint (it is replaced at the first save)",
        action="store_true"))
    max_steps: int = field(default=0, metadata=_note(
        "stop after this many optimizer steps in all (0: no limit), writing the checkpoint "
        "there: a stand-in for an interrupted run; run again with the same --out to resume"))
    simulate_failure_at_step: int = field(default=0, metadata=_note(
        "fault injector for lessons and tests: --failure-rank kills itself with SIGKILL once, "
        "right after global step K (after that step's checkpoint, if any); a marker file in "
        "--out keeps a restarted job (torchrun --max-restarts) from failing again (0: off)"))
    failure_rank: int = field(default=0, metadata=_note(
        "the rank that --simulate-failure-at-step kills"))
    simulate_failure_during_save: bool = field(default=False, metadata=_note(
        "with --simulate-failure-at-step K: rank 0 dies instead inside the first checkpoint "
        "write at a global step >= K, after the temporary file is written and before the "
        "rename, so the previous checkpoint must survive", action="store_true"))
    simulate_node_loss: bool = field(default=False, metadata=_note(
        "with --simulate-failure-at-step K: --failure-rank first kills its torchrun agent "
        "(SIGKILL), as when its machine is lost; the agent's other workers go with it under "
        "ddp_lesson's launcher. Nothing on that node restarts: the job goes on only where "
        "torchrun's --nnodes MIN:MAX allows fewer nodes", action="store_true"))
    timeout_s: float = field(default=120.0, metadata=_note(
        "seconds a collective may wait for its peers before raising, instead of hanging"))
    local_rank: int | None = field(default=None, metadata=_note(
        "legacy flag of torch.distributed.launch; torchrun sets LOCAL_RANK, which wins; "
        "accepted so old command lines keep working", "--local_rank", type=int))

    def __post_init__(self):
        self.size = tuple(self.size)
        for ok, message in self._checks():
            if not ok:
                raise ValueError(message)

    def _checks(self) -> list[tuple[bool, str]]:
        """(ok, message) pairs, one per rule; a message names the field and the value."""
        def positive(name, minimum=1):
            v = getattr(self, name)
            return v >= minimum, f"{name} must be >= {minimum}, got {v}"

        def one_of(name, choices):
            v = getattr(self, name)
            return v in choices, f"{name} {v!r} is not one of {', '.join(choices)}"

        def finite_positive(name, unset_ok=False):
            v = getattr(self, name)
            ok = (unset_ok and v is None) or (v is not None and math.isfinite(v) and v > 0)
            return ok, f"{name} must be a finite number > 0, got {v}"

        clip_ok, _ = finite_positive("clip_grad_norm", unset_ok=True)
        return [
            positive("epochs"), positive("batch_size"), positive("workers", 0),
            finite_positive("lr"),
            (0 <= self.momentum < 1, f"momentum must be in [0, 1), got {self.momentum}"),
            positive("weight_decay", 0), positive("num_train"), positive("num_val"),
            (len(self.size) == 2 and min(self.size) >= 16,
             f"size must be two numbers H W, each >= 16, got {self.size}"),
            one_of("model", MODELS), positive("width"), one_of("backend", BACKENDS),
            positive("grad_accum_steps"), one_of("lr_scaling", LR_SCALINGS),
            positive("base_batch"), one_of("lr_schedule", LR_SCHEDULES),
            one_of("ddp", DDP_WRAPPERS), one_of("amp", AMP_MODES),
            (clip_ok, f"clip_grad_norm must be a finite number > 0 (leave the flag out for no "
                      f"clipping), got {self.clip_grad_norm}"),
            finite_positive("bucket_cap_mb", unset_ok=True),
            (self.bucket_cap_mb is None or self.bucket_cap_mb * 2**20 < math.inf,
             f"bucket_cap_mb {self.bucket_cap_mb} MiB is more bytes than a float holds"),
            (self.ddp != "naive" or self.bucket_cap_mb is None,
             f"bucket_cap_mb {self.bucket_cap_mb or 0:g} needs --ddp torch or bucketed: "
             "NaiveDDP has no buckets (it all-reduces each gradient on its own)"),
            (self.ddp == "torch" or not self.static_graph,
             f"static_graph needs --ddp torch: ddp_lesson's {self.ddp} wrapper does not "
             "implement it"),
            (not (self.static_graph and self.grad_accum_steps > 1),
             f"static_graph with grad_accum_steps {self.grad_accum_steps}: torch's DDP fails "
             "in its first no_sync() backward (expect_autograd_hooks_ INTERNAL ASSERT, seen "
             "in torch 2.13); drop --static-graph or use --grad-accum-steps 1"),
            (self.ddp == "torch" or not self.gradient_as_bucket_view,
             f"gradient_as_bucket_view needs --ddp torch: ddp_lesson's {self.ddp} wrapper "
             "does not implement it"),
            positive("checkpoint_every_steps", 0), positive("max_steps", 0),
            positive("simulate_failure_at_step", 0), positive("failure_rank", 0),
            (not self.simulate_failure_during_save or self.simulate_failure_at_step >= 1,
             "simulate_failure_during_save needs --simulate-failure-at-step K >= 1"),
            (not self.simulate_node_loss or (self.simulate_failure_at_step >= 1
                                            and not self.simulate_failure_during_save),
             "simulate_node_loss needs --simulate-failure-at-step K >= 1 (and no "
             "--simulate-failure-during-save)"),
            (self.timeout_s > 0, f"timeout_s must be > 0, got {self.timeout_s}"),
            (self.local_rank is None or self.local_rank >= 0,
             f"local_rank must be >= 0, got {self.local_rank}"),
        ]


class _OneLineParser(argparse.ArgumentParser):
    """argparse that reports an error as one line (no usage block): ``prog: error: ...``."""

    def error(self, message):
        # Under torchrun every rank parses the same flags: only rank 0 reports.
        print0(f"{self.prog}: error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def build_parser(prog: str = "python -m ddp_lesson.train") -> argparse.ArgumentParser:
    """The command line, one flag per :class:`TrainConfig` field; error lines name ``prog``."""
    parser = _OneLineParser(
        prog=prog,
        description="Data-parallel DeepLab training (synthetic Cityscapes-like scenes by "
                    "default). Start it with torchrun, one process per rank.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in dataclasses.fields(TrainConfig):
        meta = f.metadata
        kwargs = dict(meta.get("argparse", {}))
        if "action" not in kwargs:  # store_true flags take no type
            kwargs.setdefault("type", type(f.default))
        long_flag = "--" + f.name.replace("_", "-")
        parser.add_argument(*meta.get("flags", ()), long_flag, dest=f.name, default=f.default,
                            help=meta["help"], **kwargs)
    return parser


def parse_config(argv: list[str] | None = None,
                 prog: str = "python -m ddp_lesson.train") -> TrainConfig:
    """Parse ``argv`` (default ``sys.argv[1:]``) into a checked :class:`TrainConfig`.

    Raises:
        SystemExit: an unknown flag or invalid value: one line ``prog: error: <message>`` on
            stderr naming the flags as typed (``-b/--batch-size must be >= 1, got 0``), status 2.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    try:
        return TrainConfig(**vars(args))
    except ValueError as exc:
        parser.error(flag_words(str(exc), argv, parser))


def flag_words(message: str, argv: list[str], parser: argparse.ArgumentParser) -> str:
    """``message`` (a :class:`TrainConfig` check) with its field names written as flags: as the
    user typed them (``-b/--batch-size`` for a short spelling), else the long flag. Names with an
    underscore are replaced anywhere, one-word names (``epochs``, ``lr``) only at the start.
    """
    shown = {}
    for action in parser._actions:
        longs = [o for o in action.option_strings if o.startswith("--")]
        if not longs or action.dest == "help":
            continue
        typed = [t.split("=", 1)[0] for t in argv if t.startswith("-")]
        said = next((t for t in typed if t in action.option_strings
                     or (t.startswith("--") and len(t) > 2 and longs[-1].startswith(t))), None)
        if said is None or said.startswith("--"):
            shown[action.dest] = said if said in action.option_strings else longs[-1]
        else:
            shown[action.dest] = f"{said}/{longs[-1]}"
    for dest in sorted(shown, key=len, reverse=True):
        pattern = rf"\b{dest}\b" if "_" in dest else rf"^{dest}\b"
        message = re.sub(pattern, lambda _m, d=dest: shown[d], message)
    return message


# --------------------------------------------------------------------------- derived values

def derived_values(cfg: TrainConfig, world_size: int, num_train: int | None = None,
                   layout: DataLayout | None = None) -> dict:
    """The numbers that follow from the config at ``world_size`` ranks (no process group needed).

    With ``drop_last=False`` the sampler pads the dataset to a multiple of R by repeating
    samples: every rank gets ``ceil(N / R)`` and takes the same number of steps (a rank with
    fewer would leave its peers in an all_reduce), its last micro-batch maybe short. With
    ``drop_last=True`` the sampler cuts the tail (``N // R`` each) and the loader each rank's
    last short batch. A step is ``grad_accum_steps`` micro-batches, the epoch's last maybe fewer.
    A run resumed at another world size keeps ``layout``, the micro-batches of the run that
    started it (:mod:`ddp_lesson.layout`): same steps and global batch, K' = K x R / R'
    micro-batches per rank and step. ``num_train`` defaults to ``cfg.num_train`` (a real folder
    may hold fewer files), ``layout`` to a run starting at ``world_size``.

    Returns:
        dict with world_size, batch_size (per micro-batch), global_batch (``B x R x K``),
        samples_per_rank (the most any rank reads), samples_per_epoch (all ranks, padding
        included), steps_per_epoch, grad_accum_steps (per rank, at this world size),
        micro_batches_per_epoch (per rank) and effective_lr.

    Raises:
        ValueError: ``world_size < 1``, or ``layout`` cannot be dealt to ``world_size`` ranks.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    n = cfg.num_train if num_train is None else num_train
    if layout is None:
        layout = layout_for(cfg, n, world_size, cfg.grad_accum_steps)
    k = layout.accumulation_at(world_size)  # K' (= K when world_size is the layout's)
    micro = layout.micro_batches_per_rank * layout.world_size // world_size
    samples_per_epoch = layout.samples_per_rank * layout.world_size
    if world_size == layout.world_size:
        samples_per_rank = layout.samples_per_rank
    else:  # rank 0 reads the most: the fewest of the epoch's short last micro-batches
        samples_per_rank = sum(len(g) for s in range(layout.steps_per_epoch)
                               for g in layout.step_groups(_sizes_only(layout), s)[::world_size])
    return {
        "world_size": world_size,
        "batch_size": cfg.batch_size,
        "global_batch": layout.global_batch,
        "samples_per_rank": samples_per_rank,
        "samples_per_epoch": samples_per_epoch,
        "steps_per_epoch": layout.steps_per_epoch,
        "grad_accum_steps": k,
        "micro_batches_per_epoch": micro,
        "effective_lr": scale_lr(cfg.lr, cfg.base_batch, layout.global_batch, cfg.lr_scaling),
    }


def _sizes_only(layout: DataLayout) -> list[list[int]]:
    """Shards of placeholder indices: the micro-batches' sizes without drawing a permutation."""
    return [[0] * layout.samples_per_rank for _ in range(layout.world_size)]


def layout_for(cfg: TrainConfig, num_train: int, world_size: int,
               grad_accum_steps: int) -> DataLayout:
    """The :class:`~ddp_lesson.layout.DataLayout` of a run of ``cfg`` started at ``world_size``
    ranks with ``grad_accum_steps`` (N = ``num_train``, the sampler's seed and drop_last)."""
    return DataLayout(num_samples=num_train, world_size=world_size,
                      grad_accum_steps=grad_accum_steps, batch_size=cfg.batch_size,
                      drop_last=cfg.drop_last, seed=cfg.seed, shuffle=True)


def check_steps(cfg: TrainConfig, derived: dict, n: int) -> None:
    """Raise TrainInputError when an epoch would have no step at all."""
    if derived["steps_per_epoch"] >= 1:
        return
    r, spr, b = derived["world_size"], derived["samples_per_rank"], cfg.batch_size
    if cfg.drop_last and n < r:
        raise TrainInputError(
            f"no training steps: {n} training samples on {r} ranks with --drop-last give each "
            f"rank 0 samples; use at most {n} ranks or no --drop-last")
    raise TrainInputError(
        f"no training steps: {n} training samples on {r} ranks give {spr} per rank, fewer than "
        f"one batch of {b} with --drop-last; use a batch size <= {spr} or no --drop-last")
