"""scripts/bench_head_parts.py (issue 29, item 1): every part of gpt's head unit is timed once per repeat, in order,
on the clock it is given (a fake one here: each reading advances it by one second)."""

from __future__ import annotations

from itertools import count

from .conftest import load_script


def test_each_part_is_timed_once_per_repeat_on_the_given_clock() -> None:
    bench = load_script("bench_head_parts")
    ticks = count()
    parts = bench.time_parts(1, 3, 2, lambda: float(next(ticks)))
    assert list(parts) == ["head forward", "loss forward", "backward (loss + head)", "concatenate 3 outputs",
                           "block forward", "block backward"]
    assert all(v == [1.0, 1.0] for v in parts.values())
    assert next(ticks) == 7 * 7  # 5 warm-up and 2 timed repeats, 7 readings each
