"""The measuring side (torch): unit timing and memory (profile_model, asked by ProfileOptions and MeasureOptions),
co-runner processes, the link between ranks and its calibration fit, and the allocator setting that makes the
profiler and the runner time the same thing.

Names are imported on first use, as in the autopp package: loading a links file (autopp.measure.links, for
`autopp plan --links`) must not import torch, and `python -m autopp.measure.corun` must not find its own module
already imported by this package.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["profile_model", "ProfileOptions", "MeasureOptions", "Clock", "OPTIMIZER_STATES", "DTYPES", "co_running",
           "keep_freed_memory", "LinkProfile", "measure_links", "load_links", "load_link", "CalibrationRow",
           "fit_calibration"]

_WHERE = {
    "profile_model": "autopp.measure.profiler", "Clock": "autopp.measure.timing",
    "ProfileOptions": "autopp.measure.options", "MeasureOptions": "autopp.measure.options",
    "OPTIMIZER_STATES": "autopp.measure.options", "DTYPES": "autopp.measure.options",
    "co_running": "autopp.measure.corun", "keep_freed_memory": "autopp.measure.allocator",
    "LinkProfile": "autopp.measure.links", "measure_links": "autopp.measure.links",
    "load_links": "autopp.measure.links", "load_link": "autopp.measure.links",
    "CalibrationRow": "autopp.measure.calibration", "fit_calibration": "autopp.measure.calibration",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'autopp.measure' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
