"""Shared fixtures: paths to the examples and test models, and small profiles measured once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
MODELS = Path(__file__).resolve().parent / "models"


@pytest.fixture(scope="session")
def gpt_profile(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """A quick profile of examples/gpt.py (1 repeat), saved and loaded back."""
    from autopp.measure import profile_model
    from autopp.profile import load_profile
    out = tmp_path_factory.mktemp("profiles") / "gpt"
    profile_model(EXAMPLES / "gpt.py", microbatch_sizes=(1, 2), warmup=1, repeats=1).save(out)
    return load_profile(out)
