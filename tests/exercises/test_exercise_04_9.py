"""Exercise 04.9 (the exposed share read off a profiler trace): the reference passes, and each
plausible shortcut gets a NOT YET that names it."""
from ddp_lesson.exercises import check
from ddp_lesson.exercises.catalog import ex_04_9_exposed_share as ex
from ddp_lesson.labs.ddp_profile import exposed_share, timeline


def _merged(spans):
    return ex.merge_spans(spans)


def test_the_reference_passes():
    assert str(check("04.9", exposed_share)).startswith("PASSED 04.9")


def test_a_hand_computed_case():
    # backward 10-30 and 50-80; all-reduces 25-45 and 80-85; forward from 0: the step spans
    # 0-85; exposed: 30-45 (15) and 80-85 (5) = 20, the share 20/85
    trace = ex._trace([(10, 30), (50, 80)], [(25, 45), (80, 85)])
    assert exposed_share(trace) == 20 / 85
    assert timeline(trace)["step"] == [(0.0, 85.0)]


def _verdict(fn) -> str:
    return str(check("04.9", fn))


def test_counting_all_communication_is_refused():
    def total(trace):
        t = timeline(trace)
        return sum(e - s for s, e in _merged(t["all_reduce"])) / t["step"][0][1]
    assert "backward hid part of it" in _verdict(total)


def test_two_buckets_in_flight_counted_twice_is_refused():
    def per_bucket(trace):
        t = timeline(trace)
        back = _merged(t["backward"])
        return sum(ex._outside(c, back) for c in t["all_reduce"]) / t["step"][0][1]
    assert "two buckets in flight at once count once" in _verdict(per_bucket)


def test_the_tail_only_is_refused():
    def tail(trace):
        t = timeline(trace)
        end = max(e for _, e in t["all_reduce"]) - max(e for _, e in t["backward"])
        return max(0.0, end) / t["step"][0][1]
    assert "gap between backward's ops" in _verdict(tail)


def test_the_launch_events_are_refused():
    def launch(trace):
        return 0.0
    assert "c10d::allreduce_, the launch" in _verdict(launch)


def test_a_share_of_the_communication_time_is_refused():
    def of_comm(trace):
        t = timeline(trace)
        return exposed_share(trace) * t["step"][0][1] / sum(
            e - s for s, e in _merged(t["all_reduce"]))
    assert "the share is of the step's span" in _verdict(of_comm)


def test_a_trace_without_all_reduce_is_named():
    import pytest

    with pytest.raises(ValueError, match="no all-reduce events in this trace"):
        timeline({"traceEvents": [{"ph": "X", "name": ex.BACKWARD + "X", "ts": 0, "dur": 1}]})
