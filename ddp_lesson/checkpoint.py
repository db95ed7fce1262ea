"""Checkpoints that survive interruptions: atomic save, safe multi-rank load, exact resume.

Three things go wrong with checkpoints under data parallelism:

* **A half-written file.** :func:`atomic_write` writes a temporary file in the same folder,
  fsyncs it, then ``os.replace`` s it over the old one (atomic on POSIX): the path always
  holds a complete checkpoint, old or new. :func:`sweep_temporaries` removes what killed
  writers left.
* **A race between ranks** (docs/pitfalls.md B14). :func:`save_checkpoint` has rank 0 write
  while the others wait, then tells every rank whether it worked; decisions such as "is there
  a checkpoint?" are taken on rank 0 and shared (:func:`decide_on_rank0`), never by each rank
  alone (ranks that disagree deadlock in different collectives).
* **Keys with a ``module.`` prefix** (docs/pitfalls.md B12): save the unwrapped model
  (:func:`unwrap`); :func:`strip_module_prefix` removes the prefix from a file that has it.

Loading maps tensors to the rank's own device, never all to the one that saved them, with
``torch.load(weights_only=True)`` (a checkpoint is data; loading it should run no code);
:func:`capture_rng_state` / :func:`restore_rng_state` carry the random generators across a
restart as plain tensors and lists. :func:`resume_plan` says whether a run may resume.

Sources: POSIX ``rename(2)``; PyTorch's "Saving and loading models" tutorial and
``torch.nn.modules.utils.consume_prefix_in_state_dict_if_present`` (pytorch/pytorch PR #53224).
"""
from __future__ import annotations

import contextlib
import os
import random
import re
import tempfile
import zipfile
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import asdict
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .env import barrier, group_active
from .layout import regroup_problem
from .procs import alive

__all__ = [
    "CHECKPOINT_FORMAT",
    "CHECKPOINT_VERSION",
    "REQUIRED_KEYS",
    "CheckpointError",
    "strip_module_prefix",
    "unwrap",
    "save_atomic",
    "sweep_temporaries",
    "save_checkpoint",
    "Rank0Error",
    "run_on_rank0",
    "decide_on_rank0",
    "load_checkpoint",
    "default_map_location",
    "first_state_mismatch",
    "first_config_mismatch",
    "capture_rng_state",
    "restore_rng_state",
    "resume_plan",
]

#: Value of the ``"format"`` entry that marks a file as this package's checkpoint.
CHECKPOINT_FORMAT = "ddp_lesson.checkpoint"
#: Layout version; bumped when the entries change meaning.
CHECKPOINT_VERSION = 1
#: Entries every checkpoint holds (``ddp_lesson.train.Trainer.checkpoint_state`` says what
#: each means).
REQUIRED_KEYS = ("format", "version", "model", "optimizer", "scheduler", "epoch",
                 "step_in_epoch", "global_step", "sampler", "rng", "config", "world_size")


class CheckpointError(ValueError):
    """A file that cannot be resumed from (unreadable, truncated, not a checkpoint, another
    model or configuration); the message names the file and the first problem.
    """


class Rank0Error(RuntimeError):
    """Raised on the other ranks when rank 0's part of :func:`run_on_rank0` raised; names the
    step and rank 0's exception (rank 0 raises its own). ``is_consequence``: the launcher never
    names a rank that failed with it as the cause of a failed run (:mod:`ddp_lesson._worker`).
    """

    is_consequence = True


# --------------------------------------------------------------------------- prefixes (B12)

def strip_module_prefix(state_dict: Mapping[str, Any], prefix: str = "module.") -> OrderedDict:
    """A copy of ``state_dict`` with ``prefix`` removed once from the start of every key.

    ``'module.module.weight'`` becomes ``'module.weight'``, ``'submodule.weight'`` stays (the
    prefix must start the key); the ``_metadata`` that ``load_state_dict`` reads is renamed the
    same way. Like torch's ``consume_prefix_in_state_dict_if_present``, but returns a new
    ``OrderedDict`` in the same order.
    """
    out = OrderedDict((k[len(prefix):] if k.startswith(prefix) else k, v)
                      for k, v in state_dict.items())
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        bare = prefix[:-1] if prefix.endswith(".") else prefix
        renamed = OrderedDict()
        for key, value in metadata.items():
            if key == bare:
                renamed[""] = value
            elif key.startswith(prefix):
                renamed[key[len(prefix):]] = value
            else:
                renamed[key] = value
        out._metadata = renamed
    return out


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The bare model inside data-parallel wrappers (anything with a ``.module``), else itself:
    ``unwrap(model).state_dict()`` has no ``module.`` prefix.
    """
    while isinstance(getattr(model, "module", None), torch.nn.Module):
        model = model.module
    return model


# --------------------------------------------------------------------------- saving

def _fsync_dir(folder: str) -> None:
    """Make the rename itself durable (best effort: not every file system allows it)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder or ".", os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_write(path: str, write: Callable[[Any], None], *, binary: bool = True,
                 before_replace: Callable[[str], None] | None = None) -> str:
    """Write ``path`` so that it is never seen half-written: temporary file, fsync, rename.

    ``write(fh)`` fills ``path.tmp.<pid>`` in the same folder (``"wb"``, or ``"w"`` with
    ``binary=False``), which is then fsync'ed and ``os.replace`` d over ``path``, and the folder
    synced. ``before_replace(tmp)`` runs just before the rename, the window in which a crash
    leaves the old file in place. Local: no synchronisation. Returns ``path``.

    Raises:
        OSError: the folder is not writable, the disk is full, ...; or whatever ``write``
            raises. Either way the temporary file is removed and ``path`` is untouched.
    """
    folder = os.path.dirname(os.path.abspath(path))
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb" if binary else "w") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())  # the bytes are on disk before the name points at them
        if before_replace is not None:
            before_replace(tmp)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(folder)
    return path


def sweep_temporaries(path: str, *, only_dead: bool = True) -> list[str]:
    """Remove the ``{basename(path)}.tmp.<pid>`` files that killed writers left next to ``path``.

    A process killed between creating the temporary file and the rename leaves it for good. This
    process's own is kept; with ``only_dead=True`` (safe at any time) so is every one whose
    writer is alive (:func:`ddp_lesson.procs.alive`). ``only_dead=False`` removes the others too:
    for the job's only writer before it writes, since the pid check cannot see a writer on
    another machine of a shared file system. A file that cannot be removed is skipped. Local.
    Returns the removed names, sorted.
    """
    folder = os.path.dirname(os.path.abspath(path))
    prefix = f"{os.path.basename(path)}.tmp."  # what atomic_write makes: {base}.tmp.<pid>
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    removed = []
    for name in sorted(names):
        pid = name[len(prefix):]
        if (not name.startswith(prefix) or not pid.isdigit() or int(pid) == os.getpid()
                or (only_dead and alive(int(pid)))):
            continue
        with contextlib.suppress(OSError):
            os.remove(os.path.join(folder, name))
            removed.append(name)
    return removed


def save_atomic(obj: Any, path: str, before_replace: Callable[[str], None] | None = None) -> str:
    """``torch.save(obj)`` to ``path`` with :func:`atomic_write`, then sweep the temporary files
    of dead writers (:func:`sweep_temporaries`). Local (:func:`save_checkpoint` is the multi-rank
    protocol); ``before_replace`` as in :func:`atomic_write` (``--simulate-failure-during-save``
    kills the process there). Returns ``path``.

    Raises:
        OSError: the folder is not writable, the disk is full, ... (``path`` untouched).
    """
    atomic_write(path, lambda fh: torch.save(obj, fh), before_replace=before_replace)
    sweep_temporaries(path)  # what killed writers left; a live writer's file stays
    return path


def _distributed() -> bool:
    return group_active() and dist.get_world_size() > 1


#: How long the other ranks wait for rank 0's answer or write (seconds): a checkpoint save or
#: check may take far longer than the process group's timeout (minutes for a large model on a
#: shared file system), so that wait does not go through a collective.
RANK0_WAIT_S = 1800.0
_answers = 0  # how many rank-0 answers this process took part in: the store key's number


def _from_rank0(compute: Callable[[], Any], what: str, timeout_s: float) -> Any:
    """``compute()`` on rank 0, its (picklable) result on every rank, through the store.

    The other ranks wait in ``store.wait`` for ``timeout_s``, not in a collective whose timeout
    (the group's, seconds in the lessons) would fire while rank 0 is busy: gloo then fails with
    "Timed out waiting ... for recv" and "Connection closed by peer", naming neither the save nor
    the timeout (mosaicml/llm-foundry PR #733; meta-pytorch/torchtune#2093). An exception on rank
    0 is answered too, so the others raise at once. Every rank calls it the same number of times.

    Raises:
        TimeoutError: rank 0 did not answer within ``timeout_s`` (on the waiting ranks).
        Rank0Error: ``compute()`` raised on rank 0 (on the others; rank 0 raises its own).
    """
    import datetime
    import pickle

    from torch.distributed.distributed_c10d import _get_default_store

    global _answers
    _answers += 1
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    key = f"ddp_lesson/rank0/{attempt}/{_answers}"
    store = _get_default_store()
    if dist.get_rank() == 0:
        try:
            value = compute()
            answer = pickle.dumps((True, value))
        except BaseException as exc:  # every rank hears of it, then rank 0 raises it
            try:
                store.set(key, pickle.dumps((False, f"{type(exc).__name__}: {_first_line(exc)}")))
            except Exception:  # the store is gone too: rank 0's own error is what matters
                pass
            raise
        store.set(key, answer)
        return value
    try:
        store.wait([key], datetime.timedelta(seconds=timeout_s))
    except Exception as exc:  # the store's timeout error (a RuntimeError subclass, by version)
        if "timeout" not in str(exc).lower() and "timed out" not in str(exc).lower():
            raise
        raise TimeoutError(f"rank {dist.get_rank()} waited {timeout_s:g} s for rank 0 to "
                           f"{what}; it has not finished (raise the wait: "
                           f"timeout_s=..., now {timeout_s:g} s)") from None
    ok, value = pickle.loads(store.get(key))
    if not ok:
        raise Rank0Error(f"rank 0 failed to {what}: {value} (raised on rank "
                         f"{dist.get_rank()} too, so that no rank waits for it)")
    return value


def run_on_rank0(compute: Callable[[], Any], what: str,
                 timeout_s: float = RANK0_WAIT_S) -> Any:
    """Run ``compute()`` on rank 0 only; every rank returns its result, or raises if it raised.

    For rank-0-only work the others must wait for (write a file, check a folder): they wait up
    to ``timeout_s`` through the store (:func:`_from_rank0`), and an exception on rank 0 reaches
    them at once. Without a group of more than one rank it is ``compute()``. Synchronises; call
    it on every rank, the same number of times. ``what`` names the step in messages.

    Raises:
        Whatever ``compute()`` raised (on rank 0); :class:`Rank0Error` naming it and
        TimeoutError after ``timeout_s`` (on the others).
    """
    if not _distributed():
        return compute()
    return _from_rank0(compute, what, timeout_s)


def decide_on_rank0(decide: Callable[[], Any], timeout_s: float = RANK0_WAIT_S) -> Any:
    """:func:`run_on_rank0` for a question whose answer must be the same on every rank ("does the
    checkpoint exist?"): a slow shared file system could answer each rank differently, and ranks
    on different paths deadlock in mismatched collectives (KempnerInstitute/KempnerForge#49).

    ``decide``: no arguments, returns a picklable value. Returns rank 0's result on every rank.
    Synchronises: the others wait up to ``timeout_s`` seconds through the store, not in a
    collective (reading a large checkpoint may outlast the group's timeout); call it on every
    rank. Without a group of more than one rank it is ``decide()``.

    Raises:
        Whatever ``decide()`` raised (on rank 0); :class:`Rank0Error` naming it and
        TimeoutError after ``timeout_s`` (on the others).
    """
    return run_on_rank0(decide, "check the checkpoint", timeout_s)


def save_checkpoint(obj: Any, path: str,
                    before_replace: Callable[[str], None] | None = None,
                    timeout_s: float = RANK0_WAIT_S, *,
                    build: Callable[[], Any] | None = None) -> str:
    """Rank 0 writes ``obj`` atomically to ``path``; every rank returns once the file is complete.

    The B14 protocol: rank 0 runs :func:`save_atomic` (``before_replace`` there) while the others
    wait up to ``timeout_s`` through the store (a write slower than the group's timeout is waited
    for); then every rank meets at a barrier, after which any may ``torch.load(path)``. Call it
    on every rank with the same ``path``; ``obj`` matters on rank 0 only, or pass ``build`` (no
    arguments, returns what to save) to build it on rank 0 inside the protocol. Without a process
    group it is :func:`save_atomic`. Whatever fails, the previous file stays complete.
    Synchronises all ranks.

    Raises:
        OSError: rank 0 could not write (on every rank, with rank 0's message).
        Rank0Error: anything else failed on rank 0 (on the others; rank 0 raises its own).
        TimeoutError: rank 0's write took longer than ``timeout_s`` (on the others).
    """
    if not _distributed():
        return save_atomic(obj if build is None else build(), path, before_replace)

    def write() -> str | None:
        try:
            save_atomic(obj if build is None else build(), path, before_replace)
        except OSError as exc:
            return f"rank 0 could not write checkpoint {path}: {exc}"
        return None

    error = _from_rank0(write, f"write checkpoint {path}", timeout_s)
    # Every rank leaves together (a quick barrier: no rank is busy any more), so rank 0 does not
    # start its next write while the others still look at this one.
    barrier()  # env.barrier: names this rank's GPU on NCCL
    if error is not None:
        raise OSError(error)
    return path


# --------------------------------------------------------------------------- loading

def _first_line(exc: BaseException, limit: int = 160) -> str:
    text = str(exc).strip().splitlines()
    line = text[0] if text else type(exc).__name__
    return line if len(line) <= limit else line[:limit - 3] + "..."


def default_map_location(environ=None) -> str:
    """This rank's device for a checkpoint's tensors: ``cuda:LOCAL_RANK`` or cpu (local).

    ``"cuda:{LOCAL_RANK}"`` when CUDA is available, ``LOCAL_RANK`` (from ``environ``, default
    ``os.environ``) is set and that GPU exists, else ``"cpu"``. ``map_location=None`` would put
    every rank's copy of a file saved from ``cuda:0`` on GPU 0.
    """
    environ = os.environ if environ is None else environ
    local_rank = str(environ.get("LOCAL_RANK", "")).strip()
    if local_rank.isdigit() and torch.cuda.is_available() \
            and int(local_rank) < torch.cuda.device_count():
        return f"cuda:{int(local_rank)}"
    return "cpu"


def load_checkpoint(path: str, map_location=None) -> dict:
    """Read and check a checkpoint written by :func:`save_checkpoint` (local: each rank reads it).

    ``map_location``: anything ``torch.load`` accepts; None means :func:`default_map_location`
(``cuda:LOCAL_RANK`` or cpu: ``torch.load`` is never given None, which would put every
rank's copy of a file saved on GPU 0 on GPU 0). No synchronisation.
    Returns the checkpoint dict, holding every key of :data:`REQUIRED_KEYS`.

    Raises:
        FileNotFoundError: no file at ``path``.
        CheckpointError: truncated, not a torch file, or not one of this package's checkpoints
            (one line naming the file and the problem).
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no checkpoint at {path}")
    size = os.path.getsize(path)
    # torch.save writes a zip archive whose directory sits at the end: a file cut short, or
    # one that torch.save did not write, has none.
    if not zipfile.is_zipfile(path):
        raise CheckpointError(f"{path} ({size} bytes) is not a readable checkpoint (no zip "
                              "archive: truncated, or not written by torch.save)")
    try:
        ckpt = torch.load(path, map_location=default_map_location() if map_location is None
                          else map_location, weights_only=True)
    except Exception as exc:  # torch raises RuntimeError, UnpicklingError, EOFError, ...
        text = str(exc)
        detail = re.search(r"WeightsUnpickler error: ([^\n]*)", text)
        reason = detail.group(1).strip() if detail else _first_line(exc)
        raise CheckpointError(f"{path} ({size} bytes) is not a readable checkpoint "
                              f"({type(exc).__name__}: {reason})") from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != CHECKPOINT_FORMAT:
        what = (f"a dict with keys {sorted(map(str, ckpt))[:6]}" if isinstance(ckpt, dict)
                else f"a {type(ckpt).__name__}")
        raise CheckpointError(f"{path} is not a ddp_lesson checkpoint: it holds {what}, "
                              f"without format={CHECKPOINT_FORMAT!r}")
    if ckpt.get("version") != CHECKPOINT_VERSION:
        raise CheckpointError(f"{path} has checkpoint version {ckpt.get('version')!r}; this "
                              f"package reads version {CHECKPOINT_VERSION}")
    missing = [k for k in REQUIRED_KEYS if k not in ckpt]
    if missing:
        raise CheckpointError(f"{path} is an incomplete checkpoint: missing {missing}")
    return ckpt


def first_state_mismatch(expected: Mapping[str, torch.Tensor],
                         saved: Mapping[str, torch.Tensor]) -> str | None:
    """The first difference between a model's ``state_dict`` and a saved one, or None.

    In the model's key order: a key the file lacks, a shape that differs; then a key the model
    does not have (keys compared as given), e.g. ``"'backbone.0.0.weight' has shape
    (16, 3, 3, 3) in the checkpoint but (8, 3, 3, 3) in the model"``.
    """
    for key, tensor in expected.items():
        if key not in saved:
            return f"the checkpoint lacks {key!r}"
        got = saved[key]
        if tuple(got.shape) != tuple(tensor.shape):
            return (f"{key!r} has shape {tuple(got.shape)} in the checkpoint but "
                    f"{tuple(tensor.shape)} in the model")
    for key in saved:
        if key not in expected:
            return f"the checkpoint has {key!r}, which the model does not"
    return None


def first_config_mismatch(saved: Mapping[str, Any], current: Mapping[str, Any],
                          keys) -> str | None:
    """The first of ``keys`` whose value differs between two configs, as a phrase, or None:
    ``"batch_size=4 in the checkpoint but batch_size=8 in this run"``. Lists equal tuples with
    the same items (a JSON round trip turns one into the other).
    """
    def norm(v):
        return list(v) if isinstance(v, (list, tuple)) else v

    for key in keys:
        a, b = saved.get(key), current.get(key)
        if norm(a) != norm(b):
            return f"{key}={a!r} in the checkpoint but {key}={b!r} in this run"
    return None


# --------------------------------------------------------------------------- the resume plan

#: File name of the trainer's checkpoint inside its ``--out`` folder.
CHECKPOINT_FILE = "checkpoint.pt"
#: Config fields a run must share with the checkpoint it resumes from: they decide the
#: trajectory (data order, batch composition, model shape, optimiser). Others (``--out``,
#: ``--workers``, ``--max-steps``, ``--ddp``, ``--backend``, ...) may change between runs.
RESUME_MUST_MATCH = ("model", "width", "size", "seed", "num_train", "batch_size",
                     "grad_accum_steps", "drop_last", "sync_bn", "lr", "momentum",
                     "weight_decay", "lr_scaling", "base_batch", "lr_schedule", "epochs",
                     "amp", "clip_grad_norm")


def checkpoint_layout(ckpt: dict) -> tuple[int, int]:
    """``(R, K)`` of the run whose micro-batches a checkpoint continues: its ``cursor``, else
    (older files) the world size that wrote it and its ``grad_accum_steps``.
    """
    cursor = ckpt.get("cursor")
    if cursor:
        return int(cursor["world_size"]), int(cursor["grad_accum_steps"])
    return int(ckpt["world_size"]), int(ckpt["config"]["grad_accum_steps"])


def world_size_problem(path: str, cfg, layout: tuple[int, int], world_size: int) -> str | None:
    """Why a checkpoint of the run ``layout = (R, K)`` cannot continue at ``world_size``
    processes, or None (the same R, or R' dividing K x R without ``cfg.sync_bn``)."""
    r, k = layout
    if world_size == r:
        return None
    where = f"checkpoint {path} cannot resume at {world_size} processes"
    hint = "or pass --no-resume to start over"
    if cfg.sync_bn:
        return (f"{where}: with --sync-bn BatchNorm's statistics span the micro-batches of "
                f"the R={r} ranks at the same moment, which {world_size} processes would group "
                f"differently; resume with {r} processes, {hint}")
    problem = regroup_problem(r, k, world_size)
    return f"{where}: {problem}, {hint}" if problem else None


def inspect_resume(path: str, cfg, world_size: int,
                   model_state) -> tuple[str | None, tuple[int, int] | None]:
    """``(problem, (R, K))``: why the run of ``cfg`` cannot resume the checkpoint at ``path`` (None
    when it can), and the layout of the run it continues (None when unreadable).

    Checks, in order: readable and a ddp_lesson checkpoint; tensor names and shapes against
    ``model_state``; the fields of :data:`RESUME_MUST_MATCH`; the world size
    (:func:`world_size_problem`). The first problem is named. Local: reads the file.
    """
    try:
        ckpt = load_checkpoint(path, map_location="cpu")
    except (CheckpointError, OSError) as exc:
        return f"{exc}; move it away or pass --no-resume to start over", None
    hint = "resume with the same settings, or pass --no-resume to start over"
    layout = checkpoint_layout(ckpt)
    mismatch = first_state_mismatch(model_state, strip_module_prefix(ckpt["model"]))
    if mismatch:
        return f"checkpoint {path} does not fit this model: {mismatch}; {hint}", layout
    mismatch = first_config_mismatch(ckpt["config"], asdict(cfg), RESUME_MUST_MATCH)
    if mismatch:
        return f"checkpoint {path} does not match this run: {mismatch}; {hint}", layout
    return world_size_problem(path, cfg, layout, world_size), layout


def resume_plan(cfg, world_size: int,
                model_state: Callable[[], Mapping]) -> tuple[str | None, tuple[int, int] | None]:
    """``(problem, (R, K))``: why ``cfg.out`` or the checkpoint there stops the run of ``cfg``
    at ``world_size`` (None when nothing does), and the layout of the run the checkpoint
    continues (None without one).

    ``--out`` must be creatable and writable; unless ``cfg.no_resume``, a checkpoint there
    must pass :func:`inspect_resume` against ``model_state()`` (a fresh bare model's
    ``state_dict``, built only when there is a file). Local: reads and writes the disk.
    """
    try:
        os.makedirs(cfg.out, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=cfg.out, prefix=".write-test-"):
            pass
    except OSError as exc:
        return f"--out {cfg.out!r} cannot be written: {exc.strerror or exc}", None
    path = os.path.join(cfg.out, CHECKPOINT_FILE)
    if cfg.no_resume or not os.path.exists(path):
        return None, None
    return inspect_resume(path, cfg, world_size, model_state())


def layout_problem(path: str, layout, world_size: int) -> str | None:
    """Why ``world_size`` processes cannot take the steps of the checkpoint's ``layout`` (a
    :class:`~ddp_lesson.layout.DataLayout`: its steps' micro-batches, the epoch's short last
    step included), or None."""
    problem = layout.problem_at(world_size)
    if problem is None:
        return None
    return (f"checkpoint {path} cannot resume at {world_size} processes: {problem}, or pass "
            "--no-resume to start over")


# --------------------------------------------------------------------------- random state

def capture_rng_state() -> dict:
    """This process's generators (torch CPU, every CUDA device, numpy, Python) as tensors, lists
    and numbers, which ``torch.load(weights_only=True)`` reads. Local.
    """
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {"kind": str(kind), "keys": torch.from_numpy(keys.astype(np.int64)),
                  "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)},
        "python": {"version": int(version), "internal": list(internal),
                   "gauss_next": gauss_next},
        "cuda": [],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [s.cpu() for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Set the generators back to a :func:`capture_rng_state` result (local, no sync)."""
    torch.set_rng_state(state["torch"].cpu().to(torch.uint8))
    npy = state["numpy"]
    np.random.set_state((npy["kind"], npy["keys"].cpu().numpy().astype(np.uint32),
                         npy["pos"], npy["has_gauss"], npy["cached"]))
    py = state["python"]
    random.setstate((py["version"], tuple(py["internal"]), py["gauss_next"]))
    cuda = state.get("cuda") or []
    if cuda and torch.cuda.is_available():
        for device, s in enumerate(cuda[:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s.cpu().to(torch.uint8), device)
