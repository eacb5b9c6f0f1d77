"""autopp: automatic pipeline-parallelism planning for PyTorch (profile → plan → run and validate).

The public API. Names are imported on first use, so that `import autopp` and the planning core stay torch-free.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "profile_model", "ProfileOptions", "MeasureOptions", "load_profile", "Profile",
    "PlanRequest", "make_plan", "Plan", "load_plan", "simulate_plan",
    "Layout", "LayoutPins", "ZERO", "Activation",
    "Cluster", "Link",
    "run_plan", "RunOptions", "RunReport",
    "AutoppError",
]

_WHERE = {
    "profile_model": "autopp.measure.profiler", "ProfileOptions": "autopp.measure.options",
    "MeasureOptions": "autopp.measure.options", "load_profile": "autopp.data.profile", "Profile": "autopp.data.profile",
    "PlanRequest": "autopp.solve", "make_plan": "autopp.solve", "Plan": "autopp.data.plan",
    "load_plan": "autopp.data.plan",
    "simulate_plan": "autopp.predict",
    "Layout": "autopp.data.layout", "LayoutPins": "autopp.data.layout", "ZERO": "autopp.data.zero",
    "Activation": "autopp.schedule", "Cluster": "autopp.data.cluster", "Link": "autopp.data.cluster",
    "run_plan": "autopp.run", "RunOptions": "autopp.run", "RunReport": "autopp.run", "AutoppError": "autopp.errors",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'autopp' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
