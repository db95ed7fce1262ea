"""Deliberately broken sampler pieces from the seed script (notebook 02's deep dive on edge
cases), each reproducing one defect for a cell and a test to show:

* :class:`NestedLenSampler`: ``__len__`` written inside ``__iter__``, after its ``return``;
  the class has no ``__len__``, and ``len(sampler)`` / ``len(loader)`` raise ``TypeError``.
* :func:`one_shot_padding`: the old ``indices += indices[:pad]``, short when the padding is
  longer than the dataset (N < R/2, docs/pitfalls.md A7).

Run it to see both: ``python -m ddp_lesson.labs.sampler_pitfalls``.
"""
from __future__ import annotations

import math


class NestedLenSampler:
    """A padded, strided sampler whose ``__len__`` is indented one level too deep.

    It yields the right indices (``DistributedSampler(shuffle=False)``'s), so a loop over the
    loader hides the bug until something asks for a length (``len(loader)``, a progress bar's
    total, a scheduler's ``steps_per_epoch``): ``TypeError: object of type 'NestedLenSampler'
    has no len()`` (tqdm swallows it and shows no total).
    """

    def __init__(self, n: int, num_replicas: int, rank: int):
        self.n, self.num_replicas, self.rank = n, num_replicas, rank
        self.num_samples = math.ceil(n / num_replicas)
        self.total_size = self.num_samples * num_replicas

    def __iter__(self):
        indices = list(range(self.n))
        indices += indices[: self.total_size - len(indices)]
        return iter(indices[self.rank:self.total_size:self.num_replicas])

        # The defect: this def sits inside __iter__, after the return. It is a local
        # function that is never even created, so the class has no __len__ at all.
        def __len__(self):  # noqa: F811 (unreachable on purpose)
            return self.num_samples


def one_shot_padding(n: int, num_replicas: int) -> list[int]:
    """The old padding: append ``indices[:pad]`` once. Too short when ``pad > n``.

    Args:
        n: dataset length N, ``>= 1``.
        num_replicas: world size R.

    Returns:
        The padded list, ``total_size = R * ceil(N / R)`` long only when ``pad <= N``: N=3, R=7
        pads 4 with ``[0, 1, 2][:4]``, 6 entries, not 7 (the old ``assert`` fails).
    """
    total_size = math.ceil(n / num_replicas) * num_replicas
    indices = list(range(n))
    indices += indices[: total_size - len(indices)]
    return indices


if __name__ == "__main__":
    s = NestedLenSampler(10, 3, 1)
    print("rank 1 iterates fine:", list(s))
    try:
        len(s)
    except TypeError as err:
        print("len(sampler) ->", f"TypeError: {err}")
    print("one-shot padding, N=3, R=7:", one_shot_padding(3, 7), "(7 needed)")
