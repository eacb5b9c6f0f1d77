"""The package type-checks: mypy with pyproject's [tool.mypy] settings reports no error.

Integration tier: a cold run takes about 30 s (under 2 s warm from .mypy_cache/ at the repository root);
tests/conftest.py starts it when the session's tests are chosen, so that it runs beside the tests before this one
(under xdist, this test runs first in its worker and starts it, beside the other worker's tests). Alone:
`.venv/bin/python -m mypy autopp`, or `./scripts/test.sh tests/test_typing.py`.
"""

from __future__ import annotations

import pytest

from .conftest import MYPY, MYPY_RUN, start_mypy


@pytest.mark.integration
def test_mypy_reports_no_error(request: pytest.FixtureRequest) -> None:
    # started by conftest's pytest_collection_finish, or here in an xdist worker
    proc, out = request.config.stash.get(MYPY_RUN, None) or start_mypy(request.config)
    code = proc.wait(timeout=600)
    if code != 0:  # mypy's report alone, without a traceback
        pytest.fail(f"{' '.join(MYPY[2:])} failed (exit {code}):\n{out.read_text(errors='replace')}", pytrace=False)
