"""Processes that train the profiled model beside the profiler, as the other pipeline ranks on one host would.

On a CPU host the ranks of a pipeline share the memory bus and the last-level cache, so a unit runs slower beside
them than alone: on a 2-core machine, examples/mlp.py's (memory-bound) forwards took 9-23 % longer and gpt.py's
3 % longer with one such process running (docs/accuracy.md), about what a 2-rank run's actions showed against a
profile made alone. `profile_model` with `MeasureOptions(co_runners=N)` keeps N of these running while it times the
units.

    python -m autopp.measure.corun MODEL.py MICROBATCH_SIZE DTYPE     # prints "ready", then trains until killed
"""

from __future__ import annotations

import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

from ..errors import AutoppError
from ..model.contract import load_model_file
from .allocator import keep_freed_memory
from .options import DTYPES

__all__ = ["co_running"]


@contextmanager
def co_running(model_path: str | Path, microbatch_size: int, dtype: str, count: int) -> Iterator[None]:
    """Run `count` co-runner processes while inside; each has run a step before this yields, and all are killed
    (and reaped) on the way out, also on errors."""
    procs: list[subprocess.Popen[str]] = []
    try:
        for _ in range(count):
            procs.append(subprocess.Popen([sys.executable, "-m", "autopp.measure.corun", str(model_path),
                                           str(microbatch_size), dtype],
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        for p in procs:
            line = p.stdout.readline() if p.stdout else ""
            if line.strip() != "ready":  # it closed its output: it is exiting with an error
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
                err = (p.stderr.read() if p.stderr else "").strip()
                raise AutoppError(f"{model_path}: co-runner process failed to start"
                                  f"{': ' + err.splitlines()[-1] if err else ''}")
        yield
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def _train_forever(path: str, microbatch_size: int, dtype: str) -> None:
    torch.set_num_threads(1)
    keep_freed_memory()
    mf = load_model_file(path)
    model = mf.build().to(DTYPES[dtype])
    inputs, target = mf.sample_batch(microbatch_size)
    inputs = tuple(x.to(DTYPES[dtype]) if x.is_floating_point() else x for x in inputs)
    first = True
    while True:
        mf.loss_fn(model(*inputs), target).backward()
        model.zero_grad(set_to_none=True)
        if first:
            print("ready", flush=True)
            first = False


if __name__ == "__main__":
    _train_forever(sys.argv[1], int(sys.argv[2]), sys.argv[3])
