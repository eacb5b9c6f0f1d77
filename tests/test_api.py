"""The public API: every name resolves, and importing the planning core loads no torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

import autopp


def test_every_public_name_resolves() -> None:
    for name in autopp.__all__:
        assert getattr(autopp, name) is not None


@pytest.mark.integration
def test_planning_core_imports_no_torch() -> None:
    code = ("import sys, autopp; from autopp import make_plan, load_plan, simulate_plan, load_profile; "
            "import autopp.schedule, autopp.costmodel, autopp.data.cluster; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
