"""Exercise 09.1 (compute-bound batch): the reference passes, the usual slips are named."""
from __future__ import annotations

import pytest

from ddp_lesson.exercises import reference
from ddp_lesson.exercises.core import run_candidates


def test_09_1_reference_is_the_scaling_books_arithmetic():
    # 1B parameters, 8 GPUs, 989 TFLOP/s, 3600 Gbit/s = 450 GB/s: 1.75 * 2P / 450e9 * 989e12 / 4P
    assert reference("09.1")(1e9, 8, 989, 3600) == pytest.approx(1.75 * 2 * 989e12 / (4 * 450e9))


def test_09_1_refuses_the_plausible_wrong_answers():
    ref = reference("09.1")

    def no_ring(P, R, t, g):
        return ref(P, R, t, g) * R / (2 * (R - 1))

    def factor_two(P, R, t, g):
        return 2 * 2 * P / (g * 1e9 / 8) * t * 1e12 / (4 * P)

    def bits_as_bytes(P, R, t, g):
        return 2 * (R - 1) / R * 2 * P / (g * 1e9) * t * 1e12 / (4 * P)

    def fp32(P, R, t, g):
        return 2 * ref(P, R, t, g)

    def six_p(P, R, t, g):
        return ref(P, R, t, g) * 4 / 6

    verdicts = run_candidates("09.1", [ref, no_ring, factor_two, bits_as_bytes, fp32, six_p,
                                       lambda P, R, t, g: 2200])
    good, *bad = verdicts
    assert good.passed
    words = ["without the ring's 2(R-1)/R", "with 2 instead of 2(R-1)/R: at R=8 the ring sends "
             "1.75 times", "Gbit/s read as GB/s", "4 bytes per gradient", "6P FLOPs per token",
             "got 2200, expected"]
    for verdict, w in zip(bad, words):
        assert not verdict.passed and w in verdict.problems[0], verdict.problems
