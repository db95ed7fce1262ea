"""The seed program re-created with its defects, then repaired one defect at a time.

``seed_v0.py`` is the series' seed (docs/seed.md) written again, small enough to run in seconds
on a CPU, every defect kept; ``seed_v1`` ... ``seed_v10`` each repair one more, in the order a
run meets them (:data:`STEPS`). ``seed_v0.py`` and the repaired program ``seed_v10.py`` are
files; ``seed_v1`` ... ``seed_v9`` are ``seed_v0`` with the first repairs of :data:`REPAIRS`
applied (:func:`source`), imported and run like the files (``python -m
ddp_lesson.seedfix.seed_v5``, tracebacks with their lines). A step's diff is computed from its
two versions (:func:`step_diff`), so the deep dive that shows the diffs
(``notebooks/deep/06_the_seed_repaired.ipynb``) cannot drift from the code. :mod:`.run` runs a
version under torchrun and says in one line how it ended. The versions are plain torch: they
import only the package's synthetic data and model (``data``, ``models``).

Example::

    print(step_diff(8))            # seed_v7.py -> seed_v8.py: the set_epoch call
    print(STEPS[7].title)          # the same step's defect
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import re
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

from .. import convert

HERE = Path(__file__).resolve().parent
#: The number of repairs; ``seed_v{FINAL}`` is the repaired program.
FINAL = 10
VERSIONS = tuple(f"seed_v{k}" for k in range(FINAL + 1))


@dataclass(frozen=True)
class Step:
    """One repair, ``seed_v{number - 1}`` -> ``seed_v{number}``.

    Attributes:
        number: 1 .. :data:`FINAL`.
        title: the defect, in a few words (Markdown).
        touches: a regular expression that every line the step removes or adds matches.
        present: a regular expression (multi-line mode) found in a version's code, docstring
            left out, while the defect is there; None where ``repaired`` says it.
        repaired: one found once the defect is repaired; None where ``present`` says it.
        pitfall: the defect's row in docs/pitfalls.md, or "".
    """

    number: int
    title: str
    touches: str
    present: str | None = None
    repaired: str | None = None
    pitfall: str = ""

    def __post_init__(self):
        if self.present is None and self.repaired is None:
            raise ValueError(f"step {self.number}: give present, repaired or both")

    def defect_in(self, version: str) -> bool:
        """Whether ``version`` still has this step's defect, by :attr:`present` and
        :attr:`repaired`.

        Raises:
            AssertionError: the two expressions disagree about ``version``.
        """
        code = "".join(code_lines(version)[1])
        found = [re.search(self.present, code, re.M) is not None] if self.present else []
        if self.repaired:
            found.append(re.search(self.repaired, code, re.M) is None)
        assert len(set(found)) == 1, (self.number, version, found)
        return found[0]


STEPS = (
    Step(1, "`Sampler` is never imported", r"Sampler",
         repaired=r"^from torch\.utils\.data import Sampler$"),
    Step(2, "`warnings.filterwarnings(\"ignore\")` hides Python's warnings", r"warnings",
         present=r'^warnings\.filterwarnings\("ignore"\)$'),
    Step(3, "NCCL and CUDA only, no timeout",
         r"device|cuda|GPU|gpus|gloo|nccl|timedelta|import os|else:|ids|pin_memory",
         present=r'backend="nccl"|\.cuda\(', repaired=r"timeout=timedelta"),
    Step(4, "`--lr`, `--momentum` and `--weight-decay` read but never declared",
         r'"--(lr|momentum|weight-decay)"', repaired=r'add_argument\("--lr"'),
    Step(5, "`__len__` indented into `__iter__`", r"__len__|return self\.num_samples",
         present=r"^        def __len__", repaired=r"^    def __len__"),
    Step(6, "`CrossEntropyLoss()` without `ignore_index=255`", r"CrossEntropyLoss",
         repaired=r"CrossEntropyLoss\(ignore_index=255\)"),
    Step(7, "the legacy `--local_rank` flag", r"local_rank",
         present=r'"--local_rank"', repaired=r'os\.environ\["LOCAL_RANK"\]', pitfall="C1"),
    Step(8, "no `set_epoch`", r"set_epoch", repaired=r"train_sampler\.set_epoch\(epoch\)",
         pitfall="A1"),
    Step(9, "`find_unused_parameters=True` with every parameter used",
         r"find_unused_parameters|DistributedDataParallel\(model",
         present=r"find_unused_parameters=True", pitfall="B2"),
    Step(10, "padding done once", r"pad",
         present=r"indices \+= indices\[:\(self\.total_size - len\(indices\)\)\]",
         repaired=r"math\.ceil\(padding / len\(indices\)\)", pitfall="A7"),
)


#: Steps 1 to 9 as a unified diff writes them, each under ``@@ seed_vN`` and its further
#: hunks under ``@@``: context lines (`` ``; an empty line is a blank one), removed (``-``),
#: added (``+``); each hunk's old lines occur once in the version before. Step 10 is
#: ``seed_v9`` -> the file ``seed_v10.py``.
REPAIRS = """\
@@ seed_v1
 from torch.nn.parallel import DistributedDataParallel
+from torch.utils.data import Sampler
@@ seed_v2
 import math
-import warnings
@@
 from ddp_lesson.models import build_model
-
-warnings.filterwarnings("ignore")
@@ seed_v3
 import math
+import os
+from datetime import timedelta
@@

-    dist.init_process_group(backend="nccl")
-    print(f"Use GPU: {args.local_rank} for training")
+    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
+    if gpus >= int(os.environ["LOCAL_WORLD_SIZE"]):  # a GPU for every process on this machine
+        device = torch.device("cuda", args.local_rank)
+        torch.cuda.set_device(device)
+        dist.init_process_group("nccl", timeout=timedelta(seconds=60), device_id=device)
+    else:
+        device = torch.device("cpu")
+        dist.init_process_group("gloo", timeout=timedelta(seconds=60))
+    print(f"local rank {args.local_rank}, device {device}")
@@
     model = build_model("deeplab", width=8)
-    torch.cuda.set_device(args.local_rank)
-    model = model.cuda()
-    model = DistributedDataParallel(model, device_ids=[args.local_rank],
+    model = model.to(device)
+    ids = [args.local_rank] if device.type == "cuda" else None
+    model = DistributedDataParallel(model, device_ids=ids,
@@
                                     find_unused_parameters=True)
-    criterion = nn.CrossEntropyLoss().cuda()
+    criterion = nn.CrossEntropyLoss().to(device)
@@
         train_dataset, batch_size=args.batch_size, shuffle=False, num_workers=args.workers,
-        pin_memory=True, sampler=train_sampler)
+        pin_memory=device.type == "cuda", sampler=train_sampler)
@@
         for images, targets in train_loader:
-            images = images.cuda(non_blocking=True)
-            targets = targets.cuda(non_blocking=True)
+            images = images.to(device, non_blocking=True)
+            targets = targets.to(device, non_blocking=True)
@@ seed_v4
                         help="samples per process and step")
+    parser.add_argument("--lr", default=0.05, type=float, help="learning rate")
+    parser.add_argument("--momentum", default=0.9, type=float, help="SGD momentum")
+    parser.add_argument("--weight-decay", default=1e-4, type=float, help="L2 penalty")
@@ seed_v5

-        def __len__(self):
-            return self.num_samples
+    def __len__(self):
+        return self.num_samples
@@ seed_v6
                                     find_unused_parameters=True)
-    criterion = nn.CrossEntropyLoss().to(device)
+    criterion = nn.CrossEntropyLoss(ignore_index=255).to(device)
@@ seed_v7
     parser.add_argument("--weight-decay", default=1e-4, type=float, help="L2 penalty")
-    parser.add_argument("--local_rank", default=0, type=int, help="this process's GPU")
@@
     args = parser.parse_args(argv)
+    local_rank = int(os.environ["LOCAL_RANK"])  # torchrun sets it for every process
@@
     if gpus >= int(os.environ["LOCAL_WORLD_SIZE"]):  # a GPU for every process on this machine
-        device = torch.device("cuda", args.local_rank)
+        device = torch.device("cuda", local_rank)
@@
         dist.init_process_group("gloo", timeout=timedelta(seconds=60))
-    print(f"local rank {args.local_rank}, device {device}")
+    print(f"local rank {local_rank}, device {device}")
@@
     model = model.to(device)
-    ids = [args.local_rank] if device.type == "cuda" else None
+    ids = [local_rank] if device.type == "cuda" else None
@@ seed_v8
     for epoch in range(args.start_epoch, args.epochs):
+        train_sampler.set_epoch(epoch)  # this epoch's order: seed + epoch
@@ seed_v9
     ids = [local_rank] if device.type == "cuda" else None
-    model = DistributedDataParallel(model, device_ids=ids,
-                                    find_unused_parameters=True)
+    model = DistributedDataParallel(model, device_ids=ids)
"""
#: How each version's docstring ends its sentence "``seed_v{N-1}`` with ...".
_WITH = {1: " ``Sampler`` imported.", 2: '\n``warnings.filterwarnings("ignore")`` removed.',
         3: " the backend and device chosen per\nmachine (gloo on CPU, NCCL with a GPU per "
            "process), with a timeout.",
         4: " ``--lr``, ``--momentum`` and\n``--weight-decay`` declared.",
         5: " ``__len__`` moved out of\n``__iter__``.", 6: " ``ignore_index=255`` in the loss.",
         7: " the local rank read from torchrun's\n``LOCAL_RANK``.",
         8: " ``set_epoch`` called every epoch.", 9: " ``find_unused_parameters=True``\nremoved."}


def path(version: str) -> Path:
    """The file of ``version`` (``"seed_v0"`` ... ``"seed_v10"``): where its code says it is
    (tracebacks, ``__file__``), a real file for ``seed_v0`` and ``seed_v10``.

    Raises:
        ValueError: ``version`` is not one of :data:`VERSIONS`.
    """
    if version not in VERSIONS:
        raise ValueError(f"unknown version {version!r}: one of {VERSIONS[0]} ... {VERSIONS[-1]}")
    return HERE / f"{version}.py"


def source(version: str) -> str:
    """The whole text of ``version``: its file, or ``seed_v0``'s code with the repairs of
    :data:`REPAIRS` up to its own applied, under a docstring of its own.

    Raises:
        ValueError: ``version`` is unknown.
    """
    if path(version).is_file():
        return path(version).read_text()
    number = VERSIONS.index(version)
    code = "".join(code_lines(VERSIONS[number - 1])[1])
    step = REPAIRS.split(f"@@ {version}\n")[1].split("\n@@ seed_v")[0].rstrip("\n")
    for hunk in step.split("\n@@\n"):
        lines = hunk.split("\n")
        old = "".join(line[1:] + "\n" for line in lines if line[:1] in " -" or not line)
        new = "".join(line[1:] + "\n" for line in lines if line[:1] in " +" or not line)
        assert code.count(old) == 1, (version, old)
        code = code.replace(old, new)
    return (f'"""torchrun --standalone --nproc-per-node 2 -m {__name__}.{version}\n\n'
            f"The seed program after {number} of its {FINAL} repairs: ``{VERSIONS[number - 1]}`` "
            f"with{_WITH[number]}\n\n``ddp_lesson.seedfix.step_diff({number})`` prints the "
            "change; ``ddp_lesson.seedfix.STEPS`` lists the\nrepairs in the order a run meets "
            f'the defects.\n"""\n{code}')


def code_lines(version: str) -> tuple[int, list[str]]:
    """``(offset, lines)``: ``version``'s lines after its module docstring, ``lines[0]`` being
    line ``offset + 1`` of the file (:func:`ddp_lesson.convert.code_lines`). The docstring is
    left out of the diffs: it describes each version and differs throughout."""
    return convert.code_lines(path(version), source(version))


class _Versions(importlib.abc.MetaPathFinder):
    """Imports ``seed_v1`` ... ``seed_v9`` from :func:`source` (after the files are looked
    for): the ``import`` statement, ``python -m`` and :mod:`runpy` find them, and tracebacks
    read their lines through the loader's ``get_source``."""

    def find_spec(self, fullname, target_path=None, target=None):
        package, _, version = fullname.rpartition(".")
        if package == __name__ and version in VERSIONS:
            return importlib.util.spec_from_file_location(fullname, path(version),
                                                          loader=_Loader(version))
        return None


class _Loader(importlib.abc.SourceLoader):
    def __init__(self, version: str):
        self.version = version

    def get_filename(self, fullname):
        return str(path(self.version))

    def get_data(self, filename):
        return source(self.version).encode()


sys.meta_path.append(_Versions())


def step_diff(number: int, context: int = 1) -> str:
    """The unified diff of step ``number``: ``seed_v{number - 1}.py`` -> ``seed_v{number}.py``,
    the module docstrings left out, with the files' real line numbers and ``context`` lines
    around each change (:func:`ddp_lesson.convert.script_diff`, as notebook 05's conversion).

    Raises:
        ValueError: ``number`` is not in ``1 .. FINAL``.
    """
    if not 1 <= number <= FINAL:
        raise ValueError(f"step {number} does not exist: the steps are 1 ... {FINAL}")
    a, b = VERSIONS[number - 1], VERSIONS[number]
    return convert.script_diff(path(a), path(b), context, source(a), source(b))


def changed_lines(number: int) -> list[str]:
    """The lines step ``number`` removes (``-...``) and adds (``+...``), in diff order."""
    return [line.rstrip("\n") for line in step_diff(number, context=0).splitlines(True)
            if line[:1] in "+-" and not line.startswith(("---", "+++"))]


_NESTED_LEN = "        def __len__(self):\n            return self.num_samples\n"


def as_printed() -> str:
    """``seed_v0``'s text as the seed was printed: ``return self.num_samples`` at the
    indentation of the nested ``def __len__`` above it, not inside it."""
    text = source("seed_v0")
    assert text.count(_NESTED_LEN) == 1
    return text.replace(_NESTED_LEN, _NESTED_LEN.replace("            return", "        return"))


def as_printed_error() -> str:
    """What compiling :func:`as_printed` raises, in one line.

    Raises:
        AssertionError: it compiled (``seed_v0`` no longer has the nested ``__len__``).
    """
    try:
        compile(as_printed(), "seed_v0.py", "exec")
    except IndentationError as exc:
        return f"{type(exc).__name__}: {exc.msg} (line {exc.lineno})"
    raise AssertionError("the seed as printed compiles")


def last_own_frame(exc: BaseException, file: Path) -> traceback.FrameSummary | None:
    """The innermost frame of ``exc``'s traceback that runs code of ``file``, or None."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if Path(f.filename).resolve() == file.resolve()]
    return frames[-1] if frames else None


def print_shard(version: str, num_samples: int) -> None:
    """Print this rank's share of ``range(num_samples)`` as ``version``'s sampler deals it,
    world size and rank taken from the process group, as the seed's
    ``DistributedSampler(train_dataset)`` takes them; or the assertion that stops it. No
    collective: each rank computes its own share. Needs a process group (and ``version``
    from ``seed_v1`` on: ``seed_v0`` does not import).
    """
    module = importlib.import_module(f"{__name__}.{version}")
    sampler = module.DistributedSampler(range(num_samples))
    try:
        print(f"{version}: samples {list(sampler)}")
    except AssertionError as exc:
        frame = last_own_frame(exc, path(version))
        print(f"{version}: AssertionError at {path(version).name}:{frame.lineno}: {frame.line}")
