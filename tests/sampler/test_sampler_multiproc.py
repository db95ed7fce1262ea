"""DistributedSampler across real processes (gloo), and the labs notebook 02 launches.

Every expectation is computed here from torch's own ``DistributedSampler`` or from
``torch.randperm`` seeded as the docs say (``seed + epoch``), or is a literal value of
pitfalls.md §A; the processes run the package's sampler through a real ``DataLoader``.
Notebook 02's set_epoch cell (2 processes, read from its stored output: one job, one launch,
docs/architecture.md) and one launch of 3 processes here cover everything.
"""
from __future__ import annotations

import json
import math
import re
import textwrap
from collections import Counter

import pytest
import torch
from notebook_cells import StoredRun
from sampler_reference import torch_shards
from torch.utils.data import DataLoader
from torch.utils.data import DistributedSampler as TorchSampler

from ddp_lesson.labs.sampler_pitfalls import NestedLenSampler, one_shot_padding
from ddp_lesson.labs.sampler_shards import partition_facts
from ddp_lesson.launch import run_torchrun

pytestmark = pytest.mark.timeout(150)


def torch_order(n, shuffle, seed, epoch):
    """The global order from the definition: randperm from a generator seeded seed + epoch."""
    if not shuffle:
        return list(range(n))
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return torch.randperm(n, generator=g).tolist()


# ------------------------------------------------------------ notebook 02's set_epoch run

@pytest.fixture(scope="module")
def set_epoch_run():
    """Notebook 02's set_epoch cell as stored: one job, one launch (docs/architecture.md);
    nbval's replay reruns the cell and fails unless it prints exactly this."""
    return StoredRun("02_sampler_sharding.ipynb", "from ddp_lesson.labs.sampler_set_epoch import",
                     "%%torchrun --nproc-per-node 2\n"
                     "from ddp_lesson.labs.sampler_set_epoch import main\n\n"
                     "main(n=8, epochs=3, seed=0)")


def _table(lines, epochs, world):
    """{epoch: (without, with)} with each side a list of per-rank lists, from rank 0's table."""
    rows = {}
    for line in lines:
        m = re.match(r"\s*(\d+) \| (.*)\| (.*)$", line)
        if m:
            sides = []
            for side in m.group(2, 3):
                lists = re.findall(r"r(\d) \[([\d,]*)\]", side)
                assert [int(r) for r, _ in lists] == list(range(world))
                sides.append([[int(x) for x in body.split(",")] for _, body in lists])
            rows[int(m.group(1))] = tuple(sides)
    assert sorted(rows) == list(range(epochs))
    return rows


def test_a1_set_epoch_lab_every_rank_three_epochs(set_epoch_run):
    rows = _table(set_epoch_run.rank_lines(0), epochs=3, world=2)
    for e in range(3):
        without, with_ = rows[e]
        # without set_epoch the sampler stays at epoch 0; with it, epoch e
        assert without == torch_shards(8, 2, True, seed=0, epoch=0)
        assert with_ == torch_shards(8, 2, True, seed=0, epoch=e)
    assert len({tuple(map(tuple, rows[e][1])) for e in range(3)}) == 3
    lines = set_epoch_run.rank_lines(0)
    for fact in ("without set_epoch, every epoch repeats epoch 0: True",
                 "with set_epoch, the 3 epochs are all different: True",
                 "with set_epoch, each epoch still covers 0..7 exactly once: True"):
        assert fact in lines
    for rank in (0, 1):
        assert set_epoch_run.rank_lines(rank)[0] == (
            "my epochs are all the same without set_epoch: True; all different with it: True")


# --------------------------------------------------------------------------- launch 1: 3 ranks

CONFIGS = [dict(n=n, shuffle=shuffle, seed=seed, epoch=epoch, drop_last=drop_last)
           for n in (12, 9, 10, 11, 2, 1)
           for shuffle, seed in ((False, 0), (True, 0), (True, 17))
           for epoch in (0, 1, 2)
           for drop_last in (False, True)]

SHARDS_WORKER = textwrap.dedent("""
    import json, sys, warnings
    import torch.distributed as dist
    from torch.utils.data import DataLoader
    from ddp_lesson.core.sampler import DistributedSampler as CoreSampler
    from ddp_lesson.env import init_distributed
    from ddp_lesson.labs import sampler_shards

    def core_shards(n, shuffle, seed, epoch, drop_last):
        # the teaching core alone, world read from the process group, through a DataLoader
        sampler = CoreSampler(range(n), shuffle=shuffle, seed=seed, drop_last=drop_last)
        sampler.set_epoch(epoch)
        mine = [i for b in DataLoader(range(n), batch_size=2, sampler=sampler) for i in b.tolist()]
        shards = [None] * dist.get_world_size()
        dist.all_gather_object(shards, mine)
        return shards

    warnings.simplefilter("ignore")   # drop_last with N < R warns; expected here
    env = init_distributed(timeout=60)
    configs = json.loads(sys.argv[1])
    got = [sampler_shards.gather_shards(**c) for c in configs]
    core = [core_shards(**c) for c in configs]
    if env.rank == 0:
        print("JSON " + json.dumps(got))
        print("CORE " + json.dumps(core))
    if sys.argv[2:] == ["--lab"]:
        sampler_shards.main()          # the notebook's cell; tears the group down at the end
    else:
        dist.destroy_process_group()
""")


def _launch(tmp_path_factory, nproc: int, extra: list[str]):
    script = tmp_path_factory.mktemp("lab") / "shards_worker.py"
    script.write_text(SHARDS_WORKER)
    return run_torchrun(str(script), [json.dumps(CONFIGS)] + extra, nproc_per_node=nproc,
                        timeout=120, live=False, backend="gloo")


@pytest.fixture(scope="module")
def shards_run(tmp_path_factory):
    return _launch(tmp_path_factory, 3, ["--lab"])


@pytest.fixture(scope="module")
def shards_run_world2(tmp_path_factory):
    return _launch(tmp_path_factory, 2, [])


def _gathered(run, prefix: str = "JSON "):
    line = next(l for l in run.rank_lines(0) if l.startswith(prefix))
    return json.loads(line[len(prefix):])


@pytest.mark.slow
def test_every_rank_gets_torchs_shard_through_a_real_dataloader(shards_run):
    for c, shards in zip(CONFIGS, _gathered(shards_run)):
        assert shards == torch_shards(r=3, **c), c


@pytest.mark.slow
@pytest.mark.parametrize("prefix", ["CORE ", "JSON "], ids=["core", "hardened"])
@pytest.mark.parametrize("world", [2, 3])
def test_core_and_hardened_equal_torch_on_two_and_three_ranks(request, prefix, world):
    run = request.getfixturevalue("shards_run" if world == 3 else "shards_run_world2")
    for c, shards in zip(CONFIGS, _gathered(run, prefix)):
        assert shards == torch_shards(r=world, **c), (world, c)


@pytest.mark.slow
def test_one_epoch_touches_each_index_once_or_exactly_the_padding(shards_run):
    R = 3
    checked_even = checked_pad = checked_drop = 0
    for c, shards in zip(CONFIGS, _gathered(shards_run)):
        n = c["n"]
        counts = Counter(i for s in shards for i in s)
        order = torch_order(n, c["shuffle"], c["seed"], c["epoch"])
        if n % R == 0:
            # divisible (drop_last irrelevant): each index exactly once
            assert counts == Counter(range(n)), c
            checked_even += 1
        elif not c["drop_last"]:
            # padded by wrapping round: the extra occurrences are exactly the first `pad`
            # entries of the (repeated) order
            pad = R * math.ceil(n / R) - n
            extra = (order * math.ceil(pad / n))[:pad]
            assert counts == Counter(range(n)) + Counter(extra), c
            checked_pad += 1
        else:
            # cut: every index at most once, and the missing ones are the order's tail
            total = R * (n // R)
            assert counts == Counter(order[:total]), c
            assert sorted(set(range(n)) - set(counts)) == sorted(order[total:]), c
            checked_drop += 1
    assert checked_even and checked_pad and checked_drop


@pytest.mark.slow
def test_a2_same_seed_and_epoch_partition_on_every_rank(shards_run):
    for c, shards in zip(CONFIGS, _gathered(shards_run)):
        if c["n"] % 3 == 0:
            f = partition_facts(shards, c["n"])
            assert f["disjoint"] and f["covers"], c


def _blocks(lines):
    """rank 0's report: title -> (shards, facts line)."""
    blocks, title = {}, None
    for line in lines:
        if not line.startswith("  "):
            title = line
            blocks[title] = ([], None)
        elif line.startswith("  rank "):
            blocks[title][0].append(json.loads(line.split(": ", 1)[1]))
        elif line.startswith("  disjoint"):
            blocks[title] = (blocks[title][0], line.strip())
    return blocks


@pytest.mark.slow
def test_shards_lab_report_as_the_notebook_shows_it(shards_run):
    lines = [l for l in shards_run.rank_lines(0) if not l.startswith(("JSON ", "CORE "))]
    blocks = _blocks(lines)
    assert list(blocks) == [
        "N=12, shuffle=True, seed=0, set_epoch(0) on every rank:",
        "N=10 (not divisible by 3), drop_last=False: padded by wrapping round",
        "N=10, drop_last=True: the tail is cut",
        "N=12, each rank seeds with its own rank number (the A2 bug):",
    ]
    (s1, f1), (s2, f2), (s3, f3), (s4, f4) = blocks.values()
    assert s1 == torch_shards(12, 3, True)
    assert f1 == "disjoint: True | covers all: True"
    assert s2 == torch_shards(10, 3, True)
    order10 = torch_order(10, True, 0, 0)
    assert f2 == f"disjoint: False | covers all: True | repeated: {sorted(order10[:2])}"
    assert s3 == torch_shards(10, 3, True, drop_last=True)
    assert f3 == f"disjoint: True | covers all: False | never seen: {order10[9:]}"
    # A2: rank r used seed r
    assert s4 == [torch_shards(12, 3, True, seed=r)[r] for r in range(3)]
    counts = Counter(i for s in s4 for i in s)
    repeated = sorted(i for i, k in counts.items() for _ in range(k - 1))
    missing = [i for i in range(12) if i not in counts]
    assert repeated and missing  # the overlap the case warns about
    assert f4 == (f"disjoint: False | covers all: False | repeated: {repeated} "
                  f"| never seen: {missing}")
    for rank in (1, 2):
        assert shards_run.rank_lines(rank) == []


# --------------------------------------------------------------------------- pure lab helpers

def test_partition_facts():
    assert partition_facts([[0, 2], [1, 3]], 4) == {
        "disjoint": True, "covers": True, "repeated": [], "missing": [], "total": 4}
    f = partition_facts([[0, 3, 6, 9], [1, 4, 7, 0], [2, 5, 8, 1]], 10)  # A3's shards
    assert (f["disjoint"], f["covers"], f["repeated"], f["missing"]) == (False, True, [0, 1], [])
    f = partition_facts([[0], [1], [2], [0], [1], [2], [0], [1]], 3)    # A7, R=8
    assert f["repeated"] == [0, 0, 1, 1, 2]


def test_seed_style_nested_len_breaks_every_length():
    s = NestedLenSampler(10, num_replicas=3, rank=1)
    ref = TorchSampler(range(10), num_replicas=3, rank=1, shuffle=False)
    assert list(s) == list(ref) == [1, 4, 7, 0]   # iteration is fine (A3's rank 1)
    assert not hasattr(NestedLenSampler, "__len__")
    with pytest.raises(TypeError, match=r"object of type 'NestedLenSampler' has no len\(\)"):
        len(s)
    loader = DataLoader(range(10), batch_size=2, sampler=s)
    assert [b.tolist() for b in loader] == [[1, 4], [7, 0]]
    with pytest.raises(TypeError, match=r"object of type 'NestedLenSampler' has no len\(\)"):
        len(loader)
    import io

    from tqdm import tqdm
    bar = tqdm(loader, file=io.StringIO())
    assert bar.total is None
    bar.close()


def test_dataloader_refuses_shuffle_with_a_sampler():
    from ddp_lesson.sampler import DistributedSampler

    with pytest.raises(ValueError, match="sampler option is mutually exclusive with shuffle"):
        DataLoader(range(10), sampler=DistributedSampler(range(10), 3, 0), shuffle=True)


def test_a7_one_shot_padding_comes_up_short():
    # N=3, R=7: 7 entries needed, indices[:4] of a 3-list gives only 3 more
    assert one_shot_padding(3, 7) == [0, 1, 2, 0, 1, 2]
    assert len(one_shot_padding(3, 7)) == 6 != 7
    # fine whenever pad <= N (here N=10, R=3, pad 2)
    assert one_shot_padding(10, 3) == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1]
