"""Time schedule construction and simulation for a few sizes; prints a markdown table (median and spread)."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from autopp.schedule import ScheduleName, StageCost, build_schedule, simulate, stage_to_rank

__all__ = ["main"]

SIZES: list[tuple[ScheduleName, int, int, int]] = [
    (ScheduleName.ONE_F_ONE_B, 8, 32, 1),
    (ScheduleName.INTERLEAVED_1F1B, 16, 64, 2),
    (ScheduleName.ZBV_ZERO_BUBBLE, 32, 128, 2),
    (ScheduleName.INTERLEAVED_ZERO_BUBBLE, 64, 256, 4),
    (ScheduleName.INTERLEAVED_1F1B, 64, 256, 4),
]


def _times(fn: Callable[[], object], repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def _row(name: ScheduleName, p: int, m: int, v: int, repeats: int) -> str:
    n = p * v
    costs = [StageCost(forward_s=1e-3 / v, backward_input_s=1e-3 / v, backward_weight_s=1e-3 / v,
                       static_bytes=1 << 30, activation_bytes=1 << 24, input_bytes=1 << 20)] * n
    owner, comm = stage_to_rank(name, p, v), [1e-5] * (n - 1)
    order = build_schedule(name, p, m, v)
    actions = sum(len(a) for a in order.values())
    build = _times(lambda: build_schedule(name, p, m, v), repeats)
    sim = _times(lambda: simulate(order, costs, owner, comm), repeats)
    fmt = lambda xs: f"{statistics.median(xs) * 1e3:8.1f} ({min(xs) * 1e3:.1f}-{max(xs) * 1e3:.1f})"  # noqa: E731
    return f"| {name.value:<21} | {p:>5} | {m:>4} | {v} | {actions:>7} | {fmt(build)} | {fmt(sim)} |"


def main() -> None:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print("| schedule              | ranks |   mb | v | actions | build ms median (min-max) | simulate ms median (min-max) |")
    print("|---|---|---|---|---|---|---|")
    for name, p, m, v in SIZES:
        print(_row(name, p, m, v, args.repeats))


if __name__ == "__main__":
    main()
