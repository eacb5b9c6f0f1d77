"""Helpers for the runner tests: two-stage plans built in code, a tiny model file that fails on demand, /proc scans."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterator

import pytest

from autopp.model import discover_units, fingerprint, load_model_file
from autopp.data.layout import Layout
from autopp.data.plan import Plan, Prediction, StagePlan

ROOT = Path(__file__).resolve().parents[2]
GPT = ROOT / "examples" / "gpt.py"

#: A Sequential MLP whose loss_fn misbehaves on rank $AUTOPP_TEST_FAIL_RANK ($AUTOPP_TEST_FAIL_MODE: raise or die).
FAULTY_MODEL = '''
import os
import signal

import torch
from torch import nn
from torch.nn import functional as F


def build_model():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def sample_batch(batch_size):
    return torch.randn(batch_size, 8), torch.randn(batch_size, 4)


def loss_fn(output, target):
    fail = os.environ.get("AUTOPP_TEST_FAIL_RANK")
    if fail is not None and os.environ.get("RANK") == fail:
        if os.environ.get("AUTOPP_TEST_FAIL_MODE") == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        raise ValueError("injected failure in loss_fn")
    return F.mse_loss(output, target)
'''

MakePlan = Callable[..., Plan]
LINRELU = ROOT / "tests" / "models" / "linrelu.py"


def pipeline_plan(model_path: Path, split_points: list[str], schedule: str = "1F1B", layout: Layout = Layout(pp=2),
                  num_microbatches: int = 2, microbatch_size: int = 2, predicted_s: float = 0.1,
                  ranks: list[int] | None = None, **extra: object) -> Plan:
    """A plan cut at `split_points` (len = pp * v - 1), stages placed by the named schedule's placement (or `ranks`);
    with `layout.tp` > 1 each stage is a group of tp ranks (pass `tp_plan`, or get the model's own by default)."""
    from autopp.schedule import ScheduleName, stage_to_rank

    mf = load_model_file(model_path)
    model = mf.build(0)
    units = discover_units(mf, model)
    cuts = [0] + [next(u.index for u in units if u.split_point == p) for p in split_points] + [len(units)]
    name = ScheduleName(schedule)
    if ranks is None:
        ranks = stage_to_rank(name, layout.pp, layout.v)
    stages = tuple(
        StagePlan(index=i, rank=ranks[i], units=(a, b), unit_names=tuple(u.name for u in units[a:b]),
                  split_point=None if i == 0 else split_points[i - 1], forward_s=0.01, backward_s=0.02,
                  memory_bytes=1000)
        for i, (a, b) in enumerate(zip(cuts, cuts[1:]))
    )
    if layout.tp > 1 and "tp_plan" not in extra:
        from autopp.model.tp import find_tp_plan
        found = find_tp_plan(mf, model)
        extra["tp_plan"] = dict(found.patterns) if found else {}
    return Plan(model_path=str(model_path), fingerprint=fingerprint(model, units), schedule=name, layout=layout,
                num_microbatches=num_microbatches,
                microbatch_size=microbatch_size, memory_limit_bytes=2**30, stages=stages,
                predicted=Prediction(step_time_s=predicted_s, peak_memory_bytes=(1000,) * layout.pp,
                                     bubble_fraction=0.0),
                **extra)  # type: ignore[arg-type]


def two_stage_plan(model_path: Path, split_point: str, schedule: str = "1F1B", num_microbatches: int = 2,
                   microbatch_size: int = 2, predicted_s: float = 0.1) -> Plan:
    """A plan with stage 0 on rank 0 up to `split_point` and stage 1 on rank 1, fingerprinted from the model file."""
    mf = load_model_file(model_path)
    model = mf.build(0)
    units = discover_units(mf, model)
    cut = next(u.index for u in units if u.split_point == split_point)
    stages = tuple(
        StagePlan(index=i, rank=i, units=span, unit_names=tuple(u.name for u in units[span[0]:span[1]]),
                  split_point=None if i == 0 else split_point, forward_s=0.0, backward_s=0.0, memory_bytes=0)
        for i, span in enumerate([(0, cut), (cut, len(units))])
    )
    from autopp.schedule import ScheduleName

    return Plan(model_path=str(model_path), fingerprint=fingerprint(model, units), schedule=ScheduleName(schedule),
                layout=Layout(pp=2),
                num_microbatches=num_microbatches, microbatch_size=microbatch_size, memory_limit_bytes=2**30,
                stages=stages, predicted=Prediction(step_time_s=predicted_s, peak_memory_bytes=(0, 0),
                                                    bubble_fraction=0.0))


@pytest.fixture
def faulty_model(tmp_path: Path) -> Path:
    path = tmp_path / "faulty.py"
    path.write_text(FAULTY_MODEL)
    return path


def processes_mentioning(text: str) -> list[int]:
    """Pids of live processes whose command line contains `text` (zombies have an empty command line)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            pids.append(int(entry.name))
    return pids


def children_of(pid: int) -> set[int]:
    """Pids (zombies included) whose parent is `pid`, from /proc/*/stat."""
    kids = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid:
            kids.add(int(entry.name))
    return kids


def rank_servers(pid: int) -> set[int]:
    """`pid`'s children that multiprocessing keeps for the rest of the process: the rank server
    (autopp.spawn.rank_context's forkserver) and its resource tracker."""
    kept = set()
    for child in children_of(pid):
        try:
            cmdline = (Path("/proc") / str(child) / "cmdline").read_bytes()
        except OSError:
            continue
        if b"multiprocessing.forkserver" in cmdline or b"multiprocessing.resource_tracker" in cmdline:
            kept.add(child)
    return kept


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    """A one-process gloo group, for stages built and run in the test process."""
    import torch.distributed as dist
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def fake_world() -> Iterator[Callable[[int], None]]:
    """Start a one-process "fake" process group of the given world size (this process is rank 0; its collectives
    return their input: shapes and counts only), destroyed after the test."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def start(world_size: int) -> None:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)

    yield start
    if dist.is_initialized():
        dist.destroy_process_group()
