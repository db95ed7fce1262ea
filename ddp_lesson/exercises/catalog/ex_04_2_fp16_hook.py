"""Exercise 04.2: a float16-compressing comm hook for torch's DistributedDataParallel, run at
3 and 2 ranks over the whole group and over a group of one rank each, against one process on
the global batch within float16 rounding; the judge reads what the hook all-reduced and returned.
"""
from __future__ import annotations

import torch

from .. import solutions as S
from ..registry import Exercise, register
from ..values import close, divided_by, fmt_list
from ._shared import dist_patched, spy

_BUCKET_MB = 40 / 2 ** 20  # a few parameters per bucket: several buckets after the rebuild


def _describe_value(v) -> str:
    if isinstance(v, (list, tuple)):
        inner = type(v[0]).__name__ if v else "nothing"
        return f"a {type(v).__name__} of {len(v)} ({inner})"
    if isinstance(v, torch.Tensor):
        return f"a tensor of shape {tuple(v.shape)}"
    return f"a {type(v).__name__}"


def _checked_hook(fn, log: dict):
    """Wrap the learner's hook: note what it all-reduces and returns, keep DDP running."""
    def note(tensor, *args, **kwargs):
        log["dtypes"].add(str(tensor.dtype).replace("torch.", ""))

    def hook(state, bucket):  # the parameter must be named `bucket`: torch checks it by name
        with dist_patched({"all_reduce": spy("all_reduce", note)}):
            result = fn(state, bucket)
        buffer = bucket.buffer()
        if not isinstance(result, torch._C.Future):  # torch.futures.Future and the raw one
            log["returned"].add(type(result).__name__)
            if hasattr(result, "wait"):
                result.wait()
            done = torch.futures.Future()
            done.set_result(buffer)
            return done

        def check_value(fut):
            value = fut.value()
            if not isinstance(value, torch.Tensor) or value.shape != buffer.shape:
                log["values"].add(_describe_value(value) + f" for a bucket of shape "
                                  f"{tuple(buffer.shape)}")
                return buffer
            return value

        return result.then(check_value)

    return hook


def _grads(fn, rank, world_size, process_group, log) -> list[float]:
    """Two backward passes of the toy MLP under torch's DDP with the hook; the second's grads."""
    from torch.nn.parallel import DistributedDataParallel

    from ...gradients import make_toy_batch, make_toy_model, split_batch

    model = make_toy_model(0)
    x, y = make_toy_batch(4 * world_size)  # 4 samples per rank at every world size
    xs, ys = split_batch(x, y, world_size)[rank]
    ddp = DistributedDataParallel(model, process_group=process_group,
                                  bucket_cap_mb=_BUCKET_MB)
    ddp.register_comm_hook(process_group, _checked_hook(fn, log))
    for _ in range(2):  # torch rebuilds its buckets after the first pass: several buckets
        model.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(ddp(xs), ys).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()]).tolist()


def _rank(fn, rank, world_size):
    import torch.distributed as dist

    log = {"dtypes": set(), "returned": set(), "values": set()}
    world = _grads(fn, rank, world_size, None, log)
    alone, _ = dist.new_subgroups(group_size=1)  # every rank in a process group of its own
    one = _grads(fn, rank, world_size, alone, log)
    return {"world": world, "one": one, **{k: sorted(v) for k, v in log.items()}}


def _judge(results) -> list[str]:
    from ...gradients import batch_gradient, make_toy_batch, make_toy_model, shard_gradients

    R = len(results)
    x, y = make_toy_batch(4 * R)
    want = batch_gradient(make_toy_model(0), x, y).tolist()
    local = [g.tolist() for g in shard_gradients(make_toy_model(0), x, y, R)]
    tol = {"rtol": 2e-3, "atol": 1e-4}  # float16 rounding
    for r in range(R):
        res = results[r]
        if res["returned"]:
            what = " and ".join(res["returned"])
            return [f"your hook returned a {what} on rank {r}; torch's DDP needs a "
                    "torch.futures.Future that completes with the averaged bucket: "
                    "fut = dist.all_reduce(t, group=..., async_op=True).get_future(), then "
                    "return fut.then(decompress). (The Reducer waits on that future at the end "
                    "of backward; a handle with .wait() is our BucketedDDP's contract, not "
                    "torch's.)"]
        if res["values"]:
            return [f"your hook's future completed with {res['values'][0]} on rank {r}; it "
                    "must complete with one tensor shaped like bucket.buffer(). "
                    "dist.all_reduce(...).get_future() completes with a list of tensors: "
                    "chain .then(lambda fut: fut.value()[0]) (and cast back to float32 "
                    "there)."]
    if any(results[r]["world"] != results[0]["world"] for r in range(R)):
        q = next(r for r in range(R) if results[r]["world"] != results[0]["world"])
        return [f"at world size {R}, rank 0 and rank {q} hold different gradients after "
                "backward: torch's DDP writes into the gradients what the hook's future "
                "completes with, so that value differed between the ranks. Return a future "
                "whose value is the reduced (decompressed) bucket."]
    got = results[0]["world"]
    if close(got, [R * v for v in want], **tol):
        return [f"at world size {R} the gradients are {R}x the average (gradients {R}x too "
                "large): with a hook registered, torch's DDP does not divide by the world size "
                "-- the hook must. Divide by the process group's size before the SUM, like "
                "torch's own hooks: group = state if state is not None else dist.group.WORLD; "
                "half.div_(group.size())."]
    if close(got, [v / R for v in want], **tol):
        return [f"at world size {R} the gradients are 1/{R} of the average: they were divided "
                "twice. torch's DDP leaves the division to the hook; divide once."]
    k = divided_by(got, want, R, range(2, 9), **tol)
    if k is not None:
        return [f"at world size {R} the gradients are {R}/{k} of the average: your hook divided "
                f"the sum over the {R} ranks by {k}. Divide by the size of the group the hook "
                "serves, state.size() (dist.group.WORLD when state is None), not a constant."]
    if not close(got, want, **tol):
        return [f"at world size {R} the gradients {fmt_list(got)} are not the global-batch "
                f"gradient {fmt_list(want)} within float16 rounding (rtol 2e-3)."]
    for r in range(R):
        got1 = results[r]["one"]
        if close(got1, local[r], **tol):
            continue
        where = f"in a process group of 1 rank (state = that group; rank {r} alone), "
        if close(got1, [v / R for v in local[r]], **tol):
            return [where + f"your gradients are 1/{R} of the right ones: the hook divided by "
                    f"{R} whatever the group. Divide by the size of the group the hook serves, "
                    "state.size() (dist.group.WORLD when state is None), not by a constant or "
                    "dist.get_world_size()."]
        total = [sum(vs) for vs in zip(*local)]
        if any(close(got1, [v / k for v in total], **tol) for k in (1, R)):
            return [where + "your gradients mix every rank's: the hook all-reduced over the "
                    "default group. Pass group=state (dist.group.WORLD when state is None) to "
                    "dist.all_reduce."]
        return [where + f"rank {r}'s gradients {fmt_list(got1)} are not its own gradient "
                f"{fmt_list(local[r])}."]
    dtypes = set().union(*(results[r]["dtypes"] for r in range(R)))
    if dtypes and "float16" not in dtypes:
        return [f"the gradients are right but not compressed: your hook all-reduced "
                f"{', '.join(sorted(dtypes))} (4 bytes a number). Cast the bucket to "
                "torch.float16 before the all_reduce (half the bytes) and back afterwards."]
    if not dtypes:  # all_reduce reached by another name: judge by the values
        sums = torch.tensor(got, dtype=torch.float32)
        if not torch.equal(sums.half().float(), sums):
            return ["the gradients are right but are not float16 numbers, so the bucket "
                    "travelled as float32. Cast it to torch.float16 before the all_reduce."]
    return []


register(Exercise(
    "04.2", "a float16-compressing comm hook for torch's DDP",
    task="Write hook(state, bucket) -> torch.futures.Future[Tensor] for torch's "
         "ddp.register_comm_hook(state, hook), where state is the process group (None: the "
         "default group) and bucket a dist.GradBucket: send bucket.buffer() as float16 (half "
         "the bytes), divided by the group's size (torch's DDP does not divide when a hook is "
         "registered; dividing first keeps the float16 sum from overflowing), SUM-all-reduce "
         "it asynchronously, and return a future that completes with the float32 average "
         "shaped like bucket.buffer(). Name the second parameter `bucket`: torch checks it.",
    signature="fn(state: ProcessGroup | None, bucket: dist.GradBucket) -> "
              "torch.futures.Future[Tensor]",
    reference=S.fp16_compress_hook, kind="distributed", world_sizes=(3, 2),
    run_rank=_rank, judge=_judge,
    checked="3 and 2 processes (torchrun, gloo), torch's DistributedDataParallel on the toy "
            "MLP with several buckets, over the whole group and over a group of 1 rank each, "
            "against one process on the global batch within float16 rounding"))
