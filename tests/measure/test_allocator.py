"""The C allocator keeps freed memory (glibc mallopt), once per process."""

from __future__ import annotations

import statistics
import subprocess
import sys

import pytest

from autopp.measure.allocator import keep_freed_memory

from ..conftest import EXAMPLES


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt is Linux only")
def test_glibc_settings_applied_once() -> None:
    assert keep_freed_memory() == "glibc: no mmap, no trim"
    assert keep_freed_memory() == "glibc: no mmap, no trim"


_FAULTS = """
import resource, sys, torch
from autopp.measure.allocator import keep_freed_memory
from autopp.model import discover_units, load_model_file, split_model
torch.set_num_threads(1)
if sys.argv[1] == "keep":
    keep_freed_memory()
mf = load_model_file(sys.argv[2])
model = mf.build()
inputs, target = mf.sample_batch(2)
split_model(model, inputs, [u.split_point for u in discover_units(mf, model)[1:]])
for _ in range(3):
    mf.loss_fn(model(*inputs), target).backward()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    mf.loss_fn(model(*inputs), target).backward()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt is Linux only")
@pytest.mark.integration
def test_steps_after_a_split_take_far_fewer_page_faults() -> None:
    """examples/mlp.py's forward and backward once the model has been split (as in the profiler and the runner):
    glibc's default took 1,760-2,850 minor page faults per step on the development machine, the settings ~200.
    The median of three processes each: one default process in a few took ~200 too (glibc's dynamic mmap threshold
    had risen before the timed steps), which decides nothing about the settings. The six processes run at once
    (page faults are counted per process; the cores are shared, the counts are not)."""
    modes = ("keep",) * 3 + ("default",) * 3
    procs = [subprocess.Popen([sys.executable, "-c", _FAULTS, mode, str(EXAMPLES / "mlp.py")], text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for mode in modes]
    outs = [(mode, *p.communicate(), p.returncode) for mode, p in zip(modes, procs)]
    assert all(rc == 0 for *_, rc in outs), [err for _, _, err, rc in outs if rc]

    def faults(mode: str) -> float:
        return statistics.median(float(out.split()[-1]) for m, out, _, _ in outs if m == mode)
    kept, default = faults("keep"), faults("default")
    assert kept < default / 3, (kept, default)
