"""Exercise 05.1: convert a single-process training loop to DistributedDataParallel.

The candidate runs on 3 and 2 ranks with the toy MLP, a dataset noting every index it reads, a
hook noting each batch's size, and ``torch.save`` recording who saved what (no file). The judge
compares with one process on the global batch (:func:`train_single`) and names the first
missing piece: the sampler, set_epoch, the per-rank batch, averaging, the learning rate, the
loss reduction, the checkpoint.
"""
from __future__ import annotations

import torch

from .. import solutions as S
from ..registry import Exercise, register
from ..values import close, divided_by, fmt_list, fmt_num, ranks_text

#: BATCH: per rank; the global batch is BATCH x R. N = 24 gives every rank whole batches at 2
#: and 3 ranks (12 or 8 samples each).
N, EPOCHS, BATCH, LR = 24, 2, 4, 0.2
PATH = "checkpoint.pt"  # the checker records the save; nothing is written there


def train_single(model, dataset, epochs, batch_size, lr, checkpoint_path):
    """The loop to convert: one process, the whole dataset, shuffled with seed ``epoch``."""
    from torch.utils.data import DataLoader, RandomSampler

    g = torch.Generator()
    loader = DataLoader(dataset, batch_size=batch_size,
                        sampler=RandomSampler(dataset, generator=g))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for epoch in range(epochs):
        g.manual_seed(epoch)  # the order DistributedSampler(seed=0) draws in this epoch
        total, steps = 0.0, 0
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total, steps = total + loss.item(), steps + 1
        losses.append(total / steps)  # the epoch's mean loss, as logged
    torch.save(model.state_dict(), checkpoint_path)
    return losses


class Recorded(torch.utils.data.Dataset):
    """The toy regression set (``x: (N, 4)``, ``y: (N, 1)``), noting each index read."""

    def __init__(self):
        from ...gradients import make_toy_batch

        self.x, self.y = make_toy_batch(N, seed=2)
        self.seen: list[int] = []

    def __len__(self):
        return N

    def __getitem__(self, i):
        self.seen.append(int(i))
        return self.x[i], self.y[i]


def _model():
    from ...gradients import make_toy_model

    return make_toy_model(seed=0, hidden=8)


def _flat(state) -> list[float]:
    return torch.cat([v.detach().reshape(-1).double().cpu() for v in state]).tolist()


def _floats(value):
    """The candidate's returned losses as floats, or None when they are not a list of numbers."""
    try:
        return [float(v) for v in value]
    except (TypeError, ValueError, RuntimeError):
        return None


def _rank(fn, rank, world_size):
    from unittest import mock

    saves = []

    def recording_save(obj, f, *args, **kwargs):
        if isinstance(obj, dict) and all(isinstance(v, torch.Tensor) for v in obj.values()):
            saves.append({"keys": list(obj), "weights": _flat(obj.values())})
        else:
            saves.append({"keys": None, "weights": None})

    model, data, batches = _model(), Recorded(), []
    model.register_forward_pre_hook(
        lambda _m, args: batches.append(int(args[0].shape[0]) if args and hasattr(
            args[0], "shape") and args[0].dim() else -1))
    with mock.patch.object(torch, "save", recording_save):
        returned = fn(model, data, EPOCHS, BATCH, LR, PATH)
    return {"losses": _floats(returned) if returned is not None else None,
            "returned": type(returned).__name__, "seen": data.seen, "batches": batches,
            "weights": _flat(model.parameters()), "saves": saves}


def reference_run(world_size: int, lr: float = LR) -> dict:
    """One process on the global batch (``BATCH x world_size``), the order torch's
    DistributedSampler draws (``randperm`` seeded with ``epoch``): the epoch losses, the final
    weights, each rank's index order per epoch and each rank's own shard losses per epoch.
    ``lr``: another learning rate (the judge's replays of lr x R and lr / R)."""
    R, G = world_size, BATCH * world_size
    model, data = _model(), Recorded()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    out = {"losses": [], "local": {r: [] for r in range(R)}, "order": {r: [] for r in range(R)}}
    for epoch in range(EPOCHS):
        perm = torch.randperm(N, generator=torch.Generator().manual_seed(epoch))
        total, local, steps = 0.0, [0.0] * R, 0
        for r in range(R):
            out["order"][r].append(perm[r::R].tolist())
        for k in range(0, N, G):
            idx = perm[k:k + G]
            with torch.no_grad():
                for r in range(R):
                    part = idx[r::R]  # rank r's batch: its interleaved share of this chunk
                    local[r] += torch.nn.functional.mse_loss(model(data.x[part]),
                                                             data.y[part]).item()
            loss = torch.nn.functional.mse_loss(model(data.x[idx]), data.y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            total, steps = total + loss.item(), steps + 1
        out["losses"].append(total / steps)
        for r in range(R):
            out["local"][r].append(local[r] / steps)
    out["weights"] = _flat(model.parameters())
    return out


def _data_problem(results, ref) -> str | None:
    R = len(results)
    per_epoch = {r: len(results[r]["seen"]) // EPOCHS for r in range(R)}
    epochs = {r: [results[r]["seen"][e * per_epoch[r]:(e + 1) * per_epoch[r]]
                  for e in range(EPOCHS)] for r in range(R)}
    first = [set(epochs[r][0]) for r in range(R)]
    if not any(results[r]["seen"] for r in range(R)):
        return ("no rank read a sample in its own process: keep the DataLoader's num_workers=0 "
                "(the checker's dataset notes the indices each rank reads, and workers are other "
                "processes).")
    if all(s == first[0] for s in first) and len(first[0]) == N:
        return (f"ranks {ranks_text(range(R))} each read all {N} samples in epoch 0: every rank "
                "trained on the whole dataset, the same data. Give the DataLoader a "
                "DistributedSampler(dataset) (no shuffle=True with it), so each rank reads 1/"
                f"{R} of the samples, and batch_size the per-rank batch.")
    overlap = set.intersection(*first)
    if overlap or len(set.union(*first)) != N:
        return (f"in epoch 0 the ranks' samples overlap in {len(overlap)} and cover "
                f"{len(set.union(*first))} of {N}: a DistributedSampler gives each rank a "
                "disjoint share of all of them.")
    if epochs[0][0] == list(range(0, N, R)):
        return ("rank 0 read its samples in index order, unshuffled (shuffle=False on the "
                "sampler?): the loop shuffles every epoch, so keep DistributedSampler's default "
                "shuffle=True and call set_epoch(epoch).")
    if EPOCHS > 1 and epochs[0][0] == epochs[0][1]:
        return ("rank 0 read its samples in the same order in epochs 0 and 1: call "
                "sampler.set_epoch(epoch) at the start of every epoch, on every rank (pitfall "
                "A1), or each epoch repeats the first one's shuffle.")
    for r in range(R):
        for e in range(EPOCHS):
            if epochs[r][e] != ref["order"][r][e]:
                return (f"rank {r} read its samples in epoch {e} in another order than "
                        f"DistributedSampler(dataset) with set_epoch({e}) gives (seed 0, "
                        "shuffle=True, the defaults): the checker compares with one process "
                        "that shuffles the same way, so keep the sampler's defaults.")
    return None


def _batch_problem(results, ref) -> str | None:
    """Each forward's batch size against ``BATCH`` (the per-rank batch the task gives)."""
    for r, res in sorted(results.items()):
        sizes = [b for b in res["batches"] if b != BATCH]
        if sizes and sizes[0] > 0 and res["batches"]:
            R = len(results)
            text = (f"rank {r}'s model saw batches of {sizes[0]} samples; batch_size = {BATCH} "
                    "is the per-rank batch already (the global batch is batch_size x R = "
                    f"{BATCH * R}), so pass it to the DataLoader as it is")
            if sizes[0] == BATCH // R:
                text += f": dividing it by the world size ({R}) makes R times as many steps"
            return text + "."
    return None


def _weights_problem(results, ref) -> str | None:
    R = len(results)
    w0 = results[0]["weights"]
    for r in range(1, R):
        if not close(results[r]["weights"], w0):
            gap = max(abs(a - b) for a, b in zip(results[r]["weights"], w0))
            return (f"ranks 0 and {r} end with different weights (max |Δ| = {fmt_num(gap, 2)}): "
                    "their gradients were not averaged. Wrap the model in "
                    "DistributedDataParallel(model) (device_ids=None on CPU) and train the "
                    "wrapper: its backward() averages the gradients over the ranks.")
    if not close(w0, ref["weights"]):
        gap = max(abs(a - b) for a, b in zip(w0, ref["weights"]))
        text = (f"every rank ends with the same weights, but not those of one process on the "
                f"global batch of {BATCH * R} (max |Δ| = {fmt_num(gap, 2)})")
        if close(w0, reference_run(R, LR * R)["weights"]):
            return text + (f": they are those of learning rate {fmt_num(LR * R)} = lr x {R}. "
                           f"Keep the learning rate given ({fmt_num(LR)}): the checker's "
                           "reference is the loop's own run on the global batch, and DDP's "
                           "averaged gradient is already that batch's (no linear scaling "
                           "here).")
        if close(w0, reference_run(R, LR / R)["weights"]):
            return text + (f": they are those of learning rate {fmt_num(LR / R)} = lr / {R}, "
                           f"gradients {R} times too small. DDP already averages the "
                           "gradients over the ranks: backpropagate this rank's own mean "
                           "loss, not a loss divided by the world size (an all-reduced loss "
                           "divided by R is that). Reduce the loss for logging only, "
                           "detached, after backward().")
        return text + (". Keep the loss a mean, the learning rate as given and one optimizer "
                       "step per batch.")
    return None


def _loss_problem(results, ref) -> str | None:
    for r, res in sorted(results.items()):
        got = res["losses"]
        if got is None:
            return (f"rank {r} returned {res['returned']}, not the list of {EPOCHS} epoch "
                    "losses: return the logged losses on every rank.")
        if close(got, ref["losses"], rtol=1e-4, atol=1e-6):
            continue
        msg = (f"rank {r} returned epoch losses {fmt_list(got)}; the global mean over the "
               f"{len(results)} ranks is {fmt_list(ref['losses'])}")
        R = len(results)
        by = divided_by(got, ref["losses"], R, rtol=1e-4, atol=1e-6)
        if close(got, ref["local"][r], rtol=1e-4, atol=1e-6):
            msg += (f": that is rank {r}'s own shard only, a loss logged from one rank, not "
                    "reduced. Sum the loss over the epoch, all_reduce the sum and the step "
                    "count (on every rank), then divide")
        elif by is not None:
            msg += (f": that is the sum over the {R} ranks divided by {by}. Divide by "
                    "dist.get_world_size() (or the all-reduced step count), not a constant")
        return msg + "."
    return None


def _checkpoint_problem(results, ref) -> str | None:
    savers = [r for r, res in sorted(results.items()) if res["saves"]]
    if not savers:
        return "no rank called torch.save: save the model's weights to checkpoint_path."
    if len(savers) > 1:
        return (f"ranks {ranks_text(savers)} each wrote the checkpoint: on a shared disk they "
                "write one file at once. Save on rank 0 only (if dist.get_rank() == 0) and "
                "let every rank wait with dist.barrier() after it (pitfall B14).")
    r = savers[0]
    save = results[r]["saves"][-1]
    if r != 0:
        return f"rank {r} wrote the checkpoint; by convention rank 0 does (rank {r} may not exist)."
    if save["keys"] is None:
        return "rank 0 saved something other than a state_dict: torch.save(state_dict, path)."
    if any(k.startswith("module.") for k in save["keys"]):
        return ("the checkpoint's keys start with 'module.' (the DDP wrapper's state_dict): "
                "save ddp_model.module.state_dict(), which loads into the plain model "
                "(pitfall B12).")
    if not close(save["weights"], ref["weights"]):
        return "rank 0 saved other weights than the trained ones: save after the last epoch."
    return None


def _judge(results) -> list[str]:
    ref = reference_run(len(results))
    for check in (_data_problem, _batch_problem, _weights_problem, _loss_problem,
                  _checkpoint_problem):
        problem = check(results, ref)
        if problem:
            return [problem]
    return []


register(Exercise(
    "05.1", "convert a training loop to DDP",
    task="Write train_ddp(model, dataset, epochs, batch_size, lr, checkpoint_path) -> list, the "
         "DDP version of train_single (printed in notebook 05): called on every rank of a "
         "process group already started (gloo, CPU), batch_size per rank; train with "
         "DistributedDataParallel and a DistributedSampler, return each epoch's mean loss over "
         "all ranks (the same list on every rank) and save model.state_dict() to "
         "checkpoint_path from rank 0 only. Keep the DataLoader's num_workers=0.",
    signature="fn(model, dataset, epochs, batch_size, lr, checkpoint_path) -> list[float]",
    reference=S.train_ddp, kind="distributed", world_sizes=(3, 2),
    run_rank=_rank, judge=_judge,
    checked=f"3 and 2 processes (torchrun, gloo), the toy MLP, {N} samples, {EPOCHS} epochs "
            f"of {BATCH} per rank, against one process on the global batch of {3 * BATCH} "
            f"({2 * BATCH})"))
