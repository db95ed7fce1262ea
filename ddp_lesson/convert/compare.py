"""``ddp-lesson compare SINGLE.py DDP.py``: does a conversion to DDP train the same weights?

Runs the one-process script (``python SINGLE.py ARGS``) and the DDP script under torchrun
(:func:`ddp_lesson.launch.run_torchrun`) on the same arguments, then compares the two final sets
of weights tensor by tensor. The contract, what to pin and the tolerance: :data:`EPILOG`
(``ddp-lesson compare --help``). Where the single script draws the ``DistributedSampler``'s
permutation, it is ``torch.randperm(n, generator=g)`` with ``g.manual_seed(seed + epoch)``
(torch's ``DistributedSampler.__iter__``); a dropout mask drawn on R ranks is not the one drawn
on one, and DDP's float32 sums differ from one process's in the last bits, growing with the
steps, while a wrong conversion (a forgotten ``set_epoch``, a loss divided by R again) differs
by far more. Keys' leading ``module.`` or ``_orig_mod.`` are ignored.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

OUT_VAR = "DDP_LESSON_OUT"
DEFAULT_TOL = 1e-5
DEFAULT_TIMEOUT_S = 600.0


class CompareError(Exception):
    """Bad input or a run that failed: the message says which run and why (exit status 2)."""


@dataclass
class Comparison:
    """Two runs' weights compared: ``rows`` ``(name, max |Δ|, max |w_single|, same)`` in the
    single run's order; names only in the single run's (``missing``), only in the DDP run's
    (``extra``), or whose ``shapes`` differ."""

    tol: float
    rows: list = field(default_factory=list)
    missing: list = field(default_factory=list)
    extra: list = field(default_factory=list)
    shapes: list = field(default_factory=list)

    @property
    def same(self) -> bool:
        return not (self.missing or self.extra or self.shapes) and all(r[3] for r in self.rows)

    def lines(self) -> list[str]:
        """One short line per fact: each tensor, the names that do not match, the verdict."""
        out = [f"{name}: max |diff| {d:.1e}, largest |w| {w:.3g}: "
               + ("same" if ok else "DIFFERENT") for name, d, w, ok in self.rows]
        out += [f"{name}: only in the single run's weights" for name in self.missing]
        out += [f"{name}: only in the DDP run's weights" for name in self.extra]
        out += [f"{name}: shapes differ" for name in self.shapes]
        bad = sum(not r[3] for r in self.rows) + len(self.missing + self.extra + self.shapes)
        if self.same:
            out.append(f"verdict: the same weights, {len(self.rows)} tensors within --tol "
                       f"{self.tol:g}")
        else:
            out.append(f"verdict: DIFFERENT, {bad} of {len(self.rows) + len(self.extra)} "
                       f"tensors beyond --tol {self.tol:g}")
            out += HINTS
        return out


#: Printed under a DIFFERENT verdict: what a wrong conversion usually is, and what to pin.
HINTS = [
    "check: a DistributedSampler, and sampler.set_epoch(epoch) before every epoch",
    "check: per-rank batch = the single script's batch / R; the loss a mean, not divided by R",
    "check: the single script draws the sampler's permutation (seed + epoch) or no shuffle",
    "check: the same initial weights; dropout p=0 and augmentation off for the comparison",
]


def _strip(name: str) -> str:
    for prefix in ("module.", "_orig_mod."):
        while name.startswith(prefix):
            name = name[len(prefix):]
    return name


def load_weights(path: Path, run: str) -> dict:
    """The floating-point tensors of the state_dict saved at ``path`` (or of its ``"model"``).

    Raises:
        CompareError: no file (the script did not follow the contract), or no tensors in it.
    """
    import torch

    if not path.is_file():
        raise CompareError(f"the {run} run wrote no {path.name} into ${OUT_VAR} (see the "
                           "contract: ddp-lesson compare --help)")
    state = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(state, dict) and isinstance(state.get("model"), dict):
        state = state["model"]
    tensors = {_strip(k): v for k, v in state.items()
               if isinstance(v, torch.Tensor) and v.is_floating_point()} \
        if isinstance(state, dict) else {}
    if not tensors:
        raise CompareError(f"{path.name} of the {run} run holds no floating-point tensors")
    return tensors


def compare_weights(single: dict, ddp: dict, tol: float = DEFAULT_TOL) -> Comparison:
    """Compare two ``{name: tensor}`` dicts (see :class:`Comparison`). Local; no processes."""
    result = Comparison(tol=tol)
    for name, a in single.items():
        if name not in ddp:
            result.missing.append(name)
        elif ddp[name].shape != a.shape:
            result.shapes.append(name)
        else:
            a64, b64 = a.double(), ddp[name].double()
            diff = (a64 - b64).abs().max().item() if a.numel() else 0.0
            largest = a64.abs().max().item() if a.numel() else 0.0
            result.rows.append((name, diff, largest, diff <= tol * (1 + largest)))
    result.extra = [name for name in ddp if name not in single]
    return result


def _with_out(args: list[str], out: Path) -> list[str]:
    return [a.replace("{out}", str(out)) for a in args]


def run_single(script: Path, args: list[str], out: Path, timeout: float) -> None:
    """``python script args`` with ``$DDP_LESSON_OUT`` = ``out``. Raises CompareError."""
    env = {**os.environ, OUT_VAR: str(out)}
    try:
        proc = subprocess.run([sys.executable, str(script), *_with_out(args, out)], env=env,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise CompareError(f"the single run of {script.name} outlived --timeout "
                           f"{timeout:g} s") from None
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
        raise CompareError(f"the single run of {script.name} failed (exit code "
                           f"{proc.returncode}):\n{tail}")


def run_ddp(script: Path, args: list[str], out: Path, nproc_per_node: int,
            timeout: float) -> None:
    """``torchrun --nproc-per-node N script args`` through the package's launcher, with
    ``$DDP_LESSON_OUT`` = ``out`` on every rank. Raises CompareError."""
    from ..launch import TorchrunError, TorchrunTimeout, run_torchrun

    env = {**os.environ, OUT_VAR: str(out)}
    try:
        run_torchrun(str(script), _with_out(args, out), nproc_per_node=nproc_per_node,
                     timeout=timeout, env=env, live=False)
    except TorchrunTimeout:
        raise CompareError(f"the DDP run of {script.name} outlived --timeout "
                           f"{timeout:g} s") from None
    except TorchrunError as exc:
        raise CompareError(f"the DDP run of {script.name} failed: {exc}") from None


def compare_scripts(single: Path, ddp: Path, args=(), *, nproc_per_node: int = 2,
                    weights: str = "weights.pt", tol: float = DEFAULT_TOL,
                    timeout: float = DEFAULT_TIMEOUT_S) -> Comparison:
    """Run ``single`` on one process, then ``ddp`` on ``nproc_per_node`` (torchrun), each in a
    folder of its own (:data:`EPILOG`), removed after, and compare the weights they wrote.

    Raises:
        CompareError: a missing script, a bad count or tolerance, a run that failed or
            outlived ``timeout`` seconds, or weights not written.
    """
    for path in (single, ddp):
        if not Path(path).is_file():
            raise CompareError(f"no script {path}")
    if nproc_per_node < 1:
        raise CompareError(f"--nproc-per-node must be >= 1, got {nproc_per_node}")
    if not tol >= 0:
        raise CompareError(f"--tol must be >= 0, got {tol:g}")
    args = [str(a) for a in args]
    with tempfile.TemporaryDirectory(prefix="ddp_lesson_compare_") as tmp:
        out_single, out_ddp = Path(tmp, "single"), Path(tmp, "ddp")
        out_single.mkdir(), out_ddp.mkdir()
        run_single(Path(single), args, out_single, timeout)
        run_ddp(Path(ddp), args, out_ddp, nproc_per_node, timeout)
        return compare_weights(load_weights(out_single / weights, "single"),
                               load_weights(out_ddp / weights, "DDP"), tol)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``ddp-lesson compare``'s flags."""
    p.add_argument("single", help="the one-process script (run as python SINGLE)")
    p.add_argument("ddp", help="its DDP version (run under torchrun); after -- come the "
                               "arguments of both scripts, {out} there being the run's folder")
    p.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=2,
                   help="processes of the DDP run (default 2)")
    p.add_argument("--weights", default="weights.pt",
                   help="the file each script writes into its folder (default weights.pt)")
    p.add_argument("--tol", type=float, default=DEFAULT_TOL,
                   help=f"same when max |diff| <= tol x (1 + max |w|) (default {DEFAULT_TOL:g})")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                   help=f"seconds for each run (default {DEFAULT_TIMEOUT_S:g})")


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """``(compare's own arguments, the scripts' arguments)``: split at the first ``--``."""
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []


def main(argv: list[str] | None = None, prog: str = "ddp-lesson compare") -> int:
    """Parse, run both scripts, print one line per tensor and a verdict; the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    own, script_args = split_argv(argv)
    p = argparse.ArgumentParser(prog=prog, description=DESCRIPTION, epilog=EPILOG,
                                usage=USAGE.format(prog=prog),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    opts = p.parse_args(own)
    print(f"single: python {Path(opts.single).name} (1 process)")
    print(f"ddp: torchrun --nproc-per-node {opts.nproc_per_node} {Path(opts.ddp).name}",
          flush=True)
    try:
        result = compare_scripts(Path(opts.single), Path(opts.ddp), script_args,
                                 nproc_per_node=opts.nproc_per_node, weights=opts.weights,
                                 tol=opts.tol, timeout=opts.timeout)
    except CompareError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    for line in result.lines():
        print(line)
    return 0 if result.same else 1


USAGE = "{prog} [options] SINGLE DDP [-- ARGS ...]"
DESCRIPTION = ("Run a one-process training script and its DDP version on the same data and "
               "compare the final weights, tensor by tensor.")
EPILOG = """\
contract: each run gets a fresh folder, in $DDP_LESSON_OUT and as {out} in ARGS; by its end
  the script saves its final weights there, in the file --weights names:
  torch.save(model.state_dict(), path) (the DDP script on rank 0, model.module's), or a
  checkpoint dict with the state_dict under "model".
pin for the comparison: the same global batches in the same order (no shuffle, or the single
  script draws the DistributedSampler's permutation, seed + epoch), single batch = per-rank
  batch x R, a dataset size R divides, the same initial weights, dropout p=0.
tolerance: DDP adds the gradients in another order, so float32 weights differ in the last
  bits; a tensor is the same when max |diff| <= tol x (1 + max |w_single|).
example (the package's own pair, which writes --out/checkpoint.pt):
  ddp-lesson compare ddp_lesson/convert/single.py ddp_lesson/convert/ddp.py \\
      --weights checkpoint.pt -- --out {out}
exit status: 0 the same weights, 1 different, 2 bad input or a failed run."""
