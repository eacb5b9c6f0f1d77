"""The package type-checks: mypy with pyproject's [tool.mypy] settings reports no error.

Integration tier: a cold run takes about 40 s (under 2 s warm from .mypy_cache/ at the repository root). Alone:
`.venv/bin/python -m mypy autopp`, or `./scripts/test.sh tests/test_typing.py`.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.integration
def test_mypy_reports_no_error() -> None:
    # cwd: the root, so that mypy reads pyproject.toml and keeps its cache in .mypy_cache/ (gitignored)
    done = subprocess.run([sys.executable, "-m", "mypy", "autopp"], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    if done.returncode != 0:  # mypy's report alone, without a traceback
        pytest.fail(f"mypy autopp failed (exit {done.returncode}):\n{done.stdout}{done.stderr}", pytrace=False)
