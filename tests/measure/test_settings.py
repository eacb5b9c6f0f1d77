"""The profiles' one progress line (issue 26: the bar restarted at every unit, size and TP degree and gave no time
left): measured and counted, it never goes back (autopp.progress: its shares and time left)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from autopp.measure import MeasureOptions, ProfileOptions, profile_model
from autopp.measure.analytic import analytic_profile

from ..conftest import MODELS
from ..models.fakeclock import CLOCK


@pytest.mark.parametrize("limit", [None, 0])  # the model's pieces in one window; one piece per window
def test_a_profile_reports_one_rising_line_to_the_end(limit: int | None) -> None:
    said: list[str] = []
    profile_model(MODELS / "ticking.py", ProfileOptions(microbatch_sizes=(1, 2)),
                  MeasureOptions(warmup=1, repeats=2, compare_whole=False, clock=CLOCK, memory_limit_bytes=limit),
                  progress=said.append)
    shares = [int(re.search(r"\] (\d+)%", m).group(1)) for m in said]  # type: ignore[union-attr]
    assert shares == sorted(shares) and shares[-1] > 50  # a line says where the step it begins starts
    assert all(m.startswith("[") for m in said) and any("microbatch 2: " in m for m in said)
    assert any(re.search(r"sizes of unit 0 of 0-\d+ \(", m) for m in said)  # units numbered as the table numbers them


#: Five units (input, three blocks, output) with a TP plan, on plain layers (tpticks.py's custom `tick` op can lose its
#: schema late in a long session of other tests).
TP_BLOCKS = """
import torch
from torch import nn

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 32), nn.Linear(32, 8)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.blocks, self.out = nn.Linear(8, 8), nn.ModuleList(Block() for _ in range(3)), nn.Linear(8, 8)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)

TP_PLAN = {"blocks.*.fc1": "colwise", "blocks.*.fc2": "rowwise"}

def build_model():
    return Model()

def sample_batch(b):
    return torch.randn(b, 8), torch.randn(b, 8)
"""


@pytest.mark.integration  # about a second or more: the unit tier stays under a minute
def test_an_analytic_profile_reports_one_line_over_sizes_and_tp_degrees(tmp_path: Path) -> None:
    """Issue 26: the counting bar restarted for each microbatch size and TP degree; now one line rises over all of
    them (2 sizes x (the model + its tp 2 shard) = 4 walks of 5 units: the shard's walks start at half)."""
    (tmp_path / "tpblocks.py").write_text(TP_BLOCKS)
    said: list[str] = []
    analytic_profile(tmp_path / "tpblocks.py", "h100-sxm",
                     ProfileOptions(microbatch_sizes=(1, 2), tp_degrees=(2,)), progress=said.append)
    shares = [int(re.search(r"\] (\d+)%", m).group(1)) for m in said]  # type: ignore[union-attr]
    assert len(said) == 4 * 5 and shares == sorted(shares) and shares[-1] == 95
    first_tp = next(i for i, m in enumerate(said) if "(tp 2)" in m)
    assert first_tp == 10 and shares[first_tp] == 50
    assert said[first_tp].endswith("microbatch 1 (tp 2): unit 1/5 counting")
