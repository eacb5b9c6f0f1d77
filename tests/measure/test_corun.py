"""Co-runner processes: started and running before timing, always killed afterwards, failures named."""

from __future__ import annotations

import pytest

from autopp.errors import AutoppError
from autopp.measure.corun import co_running

from ..conftest import MODELS

pytestmark = pytest.mark.integration


def test_co_runners_run_inside_and_are_gone_after(monkeypatch: pytest.MonkeyPatch) -> None:
    import subprocess
    started: list[subprocess.Popen[str]] = []
    real = subprocess.Popen

    def recording(*args, **kwargs):  # type: ignore[no-untyped-def]
        p = real(*args, **kwargs)
        started.append(p)
        return p

    monkeypatch.setattr(subprocess, "Popen", recording)
    with co_running(MODELS / "linrelu.py", 2, "float32", 2):
        assert len(started) == 2 and all(p.poll() is None for p in started)  # ready and still training
    assert all(p.returncode is not None for p in started)
    with co_running(MODELS / "linrelu.py", 2, "float32", 0):
        pass


def test_a_co_runner_that_cannot_start_is_an_error(tmp_path) -> None:  # type: ignore[no-untyped-def]
    bad = tmp_path / "bad.py"
    bad.write_text("raise RuntimeError('no model here')\n")
    with pytest.raises(AutoppError, match="co-runner process failed to start: .*no model here"):
        with co_running(bad, 2, "float32", 1):
            pass


def test_profile_records_its_co_runners() -> None:
    from autopp.measure import MeasureOptions, ProfileOptions, profile_model
    profile = profile_model(MODELS / "linrelu.py", ProfileOptions(microbatch_sizes=(2,)),
                            MeasureOptions(warmup=0, repeats=1, compare_whole=False, co_runners=1))
    assert profile.meta.co_runners == 1
    with pytest.raises(ValueError, match="co_runners must be >= 0"):
        MeasureOptions(co_runners=-1)
