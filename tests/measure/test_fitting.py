"""`autopp calibrate`'s fit (autopp.measure.fitting) on a GPU: attention counted as the GPU runs it and its ratio to
the compute efficiency held. The CPU's fits: tests/measure/test_analytic.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from autopp.costmodel.roofline import Calibration, Efficiency
from autopp.measure.analytic import analytic_profile
from autopp.measure.fitting import calibrate
from autopp.measure.options import ProfileOptions
from tests.conftest import MODELS


@pytest.mark.integration  # two counts of a small LM: a few seconds
def test_a_gpu_calibration_counts_attention_as_the_gpu_runs_it_and_keeps_its_ratio(tmp_path: Path) -> None:
    """An analytic H100 profile made with e_c 0.5 and e_a 0.25 (the default ratio, 2), read as if measured,
    calibrates back to both: calibrate counts the causal attention in the GPU's blocks (0.5625 of the pairs at 1,024
    tokens), not the CPU kernel's (0.75), whose count would fit e_c 0.67. At this width only attention is
    compute-bound, so e_c comes from it alone."""
    source = (MODELS / "plainlm.py").read_text()
    assert "LAYERS, SEQ = 32, 16, 4, 2, 8" in source
    (tmp_path / "lm.py").write_text(source.replace("LAYERS, SEQ = 32, 16, 4, 2, 8", "LAYERS, SEQ = 32, 16, 4, 2, 1024"))
    eff = Efficiency(compute=0.5, memory=0.7, op_overhead_s=5e-6, attention=0.25)
    options = ProfileOptions(microbatch_sizes=(1, 2), dtype="bfloat16")
    profile = analytic_profile(tmp_path / "lm.py", "h100-sxm", options,
                               calibration=Calibration("h100-sxm", "bfloat16", eff))
    cal = calibrate(profile, "h100-sxm")
    assert cal.efficiency.compute == pytest.approx(0.5, rel=1e-6)
    assert cal.efficiency.attention == pytest.approx(0.25, rel=1e-6)
    assert cal.efficiency.memory == pytest.approx(0.7, rel=1e-6)
    assert cal.worst_error == pytest.approx(0.0, abs=1e-9)
