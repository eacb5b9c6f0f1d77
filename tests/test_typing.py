"""The package type-checks: mypy with pyproject's [tool.mypy] settings reports no error.

Integration tier: a cold run takes about 30 s (under 2 s warm from .mypy_cache/ at the repository root); tests/conftest.py
starts it when the session's tests are chosen, so that it runs beside the tests before this one. Alone:
`.venv/bin/python -m mypy autopp`, or `./scripts/test.sh tests/test_typing.py`.
"""

from __future__ import annotations

import pytest

from .conftest import MYPY, MYPY_RUN


@pytest.mark.integration
def test_mypy_reports_no_error(request: pytest.FixtureRequest) -> None:
    proc, out = request.config.stash[MYPY_RUN]  # started by conftest's pytest_collection_finish
    code = proc.wait(timeout=600)
    if code != 0:  # mypy's report alone, without a traceback
        pytest.fail(f"{' '.join(MYPY[2:])} failed (exit {code}):\n{out.read_text(errors='replace')}", pytrace=False)
