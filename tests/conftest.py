"""Shared fixtures: paths to the examples and test models, the shipped profiles, and small profiles measured once per
session (a test using one of those is in the integration tier: measuring takes seconds)."""

from __future__ import annotations

import importlib.util
import multiprocessing.process
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from autopp.data.profile import Profile

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
MODELS = Path(__file__).resolve().parent / "models"
SHIPPED = ROOT / "profiles"



def load_script(name: str) -> ModuleType:
    """scripts/NAME.py imported as a module (registered in sys.modules while it runs: dataclasses look their module
    up while being defined)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[name]
    return module


#: Fixtures that measure a model: every test using one is marked `integration` (the unit tier stays under a minute).
MEASURING_FIXTURES = frozenset({"gpt_profile"})


#: Set in a pytest-xdist worker (scripts/test.sh runs two): each worker collects every test, the controller hands
#: them out in collection order.
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests that use a measuring fixture are marked `integration`; under xdist, tests/test_typing.py goes first (its
    mypy, ~30 s of one core, then runs beside the other worker's tests, as the serial early start does below)."""
    for item in items:
        if MEASURING_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.integration)
    if XDIST_WORKER:
        items.sort(key=lambda item: not item.nodeid.startswith("tests/test_typing.py::"))  # stable: the rest keep order


#: The command tests/test_typing.py checks, run from the root (mypy reads pyproject.toml, caches in .mypy_cache/).
MYPY = (sys.executable, "-m", "mypy", "autopp")
#: The mypy started when the session's tests were chosen, and the file it writes to (tests/test_typing.py waits).
MYPY_RUN = pytest.StashKey[tuple[subprocess.Popen[bytes], Path]]()


@pytest.hookimpl(trylast=True)  # after `-m` and `-k` have deselected
def pytest_collection_finish(session: pytest.Session) -> None:
    """Start mypy as soon as the session's tests are known, if tests/test_typing.py is among them: a cold run takes
    about 30 s of one core, which it then spends beside the single-threaded tests before it instead of after. Not
    in an xdist worker (each collects every test; the test starts its own, first in its worker's order)."""
    if not XDIST_WORKER and any(item.nodeid.startswith("tests/test_typing.py::") for item in session.items):
        start_mypy(session.config)


def start_mypy(config: pytest.Config) -> tuple[subprocess.Popen[bytes], Path]:
    """mypy started in the background, its output going to a temporary file; kept in the session's stash."""
    with tempfile.NamedTemporaryFile(prefix="autopp-mypy-", suffix=".out", delete=False) as f:
        proc = subprocess.Popen(MYPY, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    config.stash[MYPY_RUN] = (proc, Path(f.name))
    return proc, Path(f.name)


def pytest_unconfigure(config: pytest.Config) -> None:
    """A mypy the session started and did not wait for (stopped early by -x, interrupted) does not outlive it, nor
    does its output."""
    run = config.stash.get(MYPY_RUN, None)
    if run is None:
        return
    if run[0].poll() is None:
        run[0].kill()
        run[0].wait()
    run[1].unlink(missing_ok=True)


def seeds(count: int, unit: tuple[int, ...] = (0, 1, 2, 3)) -> list[Any]:
    """`range(count)` for a seeded property test's parametrization: the `unit` seeds run in the unit tier, the others
    are marked `integration` (the whole suite still runs every seed)."""
    return [s if s in unit else pytest.param(s, marks=pytest.mark.integration) for s in range(count)]


def _starts_python(args: Any) -> bool:
    program = str(args if isinstance(args, (str, bytes, Path)) else args[0]).split()[0]
    return program == sys.executable or Path(program).name.startswith(("python", "torchrun"))


@pytest.fixture(autouse=True)
def _unit_tests_start_no_ranks(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A test outside the integration tier that starts a Python process (a rank, a co-runner, the CLI, torchrun) or a
    multiprocessing child fails here, so the unit tier stays in-process."""
    if request.node.get_closest_marker("integration") is not None:
        return

    def refuse(what: str) -> None:
        raise RuntimeError(f"{request.node.nodeid} starts {what}; mark it @pytest.mark.integration")

    class Popen(subprocess.Popen):  # type: ignore[type-arg]
        def __init__(self, args: Any, *rest: Any, **kw: Any) -> None:
            if _starts_python(args):
                refuse(f"a process ({args!r})")
            super().__init__(args, *rest, **kw)

    monkeypatch.setattr(subprocess, "Popen", Popen)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", lambda _self: refuse("a multiprocessing child"))


@pytest.fixture(scope="session")
def shipped_gpt() -> Profile:
    """profiles/gpt, the shipped profile of examples/gpt.py (microbatch sizes 1 and 4): for tests that plan from a
    real profile but need no fresh measurement (unit tier)."""
    from autopp.data.profile import load_profile
    return load_profile(SHIPPED / "gpt")


@pytest.fixture(scope="session")
def gpt_profile(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """A quick profile of examples/gpt.py (1 repeat), saved and loaded back."""
    from autopp.measure import MeasureOptions, ProfileOptions, profile_model
    from autopp.data.profile import load_profile
    out = tmp_path_factory.mktemp("profiles") / "gpt"
    profile_model(EXAMPLES / "gpt.py", ProfileOptions(microbatch_sizes=(1, 2)),
                  MeasureOptions(warmup=1, repeats=1)).save(out)
    return load_profile(out)


#: `autopp plan`'s defaults before issue 26 (one 1F1B pipeline, no data or tensor parallelism, ZeRO 0, no
#: recomputation), which search every free choice now: a CLI test about something else pins them, so that it stays
#: fast and keeps testing what it tested. The old default global batch was 8.
ONE_PIPELINE = ("--schedule", "1F1B", "--dp", "1", "--tp", "1", "--zero", "0", "--recompute", "none")
