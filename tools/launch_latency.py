"""How long a ``%%torchrun``-sized launch takes: 2 ranks that print their rank, 6 launches in one
process (the first starts the fork server), the median of the last 5.

    python tools/launch_latency.py                              # agents from the fork server
    DDP_LESSON_FORKSERVER=0 python tools/launch_latency.py      # a fresh agent per launch
"""
import statistics
import time

from ddp_lesson.launch import run_torchrun

times = []
for _ in range(6):
    start = time.perf_counter()
    result = run_torchrun(code="import os\nprint(os.environ['RANK'])", nproc_per_node=2,
                          timeout=120, live=False)
    times.append(time.perf_counter() - start)
    assert result.rank_lines(1) == ["1"], result.rank_lines(1)
print(f"first {times[0]:.2f} s, median of the next 5 {statistics.median(times[1:]):.2f} s")
