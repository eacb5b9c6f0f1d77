"""Where examples/gpt.py's head unit spends its time, part by part, next to what the profile says (issue 29, item 1).

The profile times the last unit (final LayerNorm, LM head) with the loss in its forward (autopp.measure.timing,
`Piece.finish`), while torch's schedules compute the loss after `forward_one_chunk` returns, and by default keep
each microbatch's logits on the last stage and concatenate them after its last backward (`return_outputs=True`).
This times, in one process with one thread, interleaved in every repeat: the head's forward (LayerNorm + matmul), the
loss's forward (cross-entropy over the vocabulary), their backward, and the concatenation of m microbatches' logits
that torch's default did; then prints each part's median and min-max, and the profile's forward and backward of the
head unit at the same microbatch size (profiles/gpt).

    .venv/bin/python scripts/bench_head_parts.py                 # microbatch 4, m 2, 50 repeats: ~10 s quiet
    .venv/bin/python scripts/bench_head_parts.py --cpu-time      # on a loaded machine
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from autopp.data.profile import load_profile
from autopp.measure.corun import co_running

ROOT = Path(__file__).resolve().parents[1]


def _gpt() -> object:
    spec = importlib.util.spec_from_file_location("gpt_example", ROOT / "examples" / "gpt.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def time_parts(b: int, m: int, repeats: int, clock: Callable[[], float]) -> dict[str, list[float]]:
    """Seconds per repeat of each part on `clock` (after 5 untimed repeats)."""
    gpt = _gpt()
    model = gpt.build_model()  # type: ignore[attr-defined]
    _, target = gpt.sample_batch(b)  # type: ignore[attr-defined]
    head = torch.nn.Sequential(model.ln_f, model.head)
    x = torch.randn(b, gpt.CONTEXT, gpt.WIDTH, requires_grad=True)  # type: ignore[attr-defined]
    block = model.h[0]  # type: ignore[attr-defined]
    parts: dict[str, list[float]] = {"head forward": [], "loss forward": [], "backward (loss + head)": [],
                                     f"concatenate {m} outputs": [], "block forward": [], "block backward": []}
    for i in range(repeats + 5):
        t0 = clock()
        out = head(x)
        t1 = clock()
        loss = gpt.loss_fn(out, target)  # type: ignore[attr-defined]
        t2 = clock()
        loss.backward()
        t3 = clock()
        merged = torch.cat([out.detach()] * m)
        t4 = clock()
        del merged
        y = block(x)
        t5 = clock()
        y.backward(torch.ones_like(y))
        t6 = clock()
        head.zero_grad(set_to_none=True)
        block.zero_grad(set_to_none=True)
        x.grad = None
        if i >= 5:
            for name, t in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5)):
                parts[name].append(t)
    return parts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--microbatch-size", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=2, help="outputs concatenated (default 2)")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--co-runners", type=int, default=0,
                    help="processes training gpt beside the timing, as the profiler's --co-runners (default 0)")
    ap.add_argument("--cpu-time", action="store_true",
                    help="time on this thread's CPU clock (time.thread_time): on a loaded machine, the time the parts "
                         "computed without the time other processes held the core")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    load = os.getloadavg()[0]
    clock = time.thread_time if args.cpu_time else time.perf_counter
    with co_running(ROOT / "examples" / "gpt.py", args.microbatch_size, "float32", args.co_runners):
        parts = time_parts(args.microbatch_size, args.microbatches, args.repeats, clock)
    units = load_profile(ROOT / "profiles" / "gpt").units
    row = units[(units.unit == units.unit.max()) & (units.microbatch_size == args.microbatch_size)]
    print(f"gpt head unit, microbatch {args.microbatch_size}, {args.repeats} repeats, {args.co_runners} co-runners, "
          f"load average {load:.2f}, "
          f"{'CPU' if args.cpu_time else 'wall'} clock")
    print("| part | median ms | min-max ms |\n|---|---|---|")
    for name, values in parts.items():
        print(f"| {name} | {1e3 * statistics.median(values):.2f} | {1e3 * min(values):.2f}-{1e3 * max(values):.2f} |")
    med = {k: statistics.median(v) for k, v in parts.items()}
    print(f"\nthe loss is {100 * med['loss forward'] / (med['head forward'] + med['loss forward']):.0f} % of the "
          "head unit's forward as profiled")
    head_fb = med["head forward"] + med["loss forward"] + med["backward (loss + head)"]
    print(f"head unit F + B / block F + B: {head_fb / (med['block forward'] + med['block backward']):.2f} here", end="")
    blocks = units[(units.unit > units.unit.min()) & (units.unit < units.unit.max())
                   & (units.microbatch_size == args.microbatch_size)]
    if not row.empty and not blocks.empty:
        prof_head = float(row.forward_s.iloc[0] + row.backward_s.iloc[0])
        prof_block = float((blocks.forward_s + blocks.backward_s).median())
        print(f", {prof_head / prof_block:.2f} in profiles/gpt (head {1e3 * prof_head:.2f} ms, median block "
              f"{1e3 * prof_block:.2f} ms)", end="")
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
