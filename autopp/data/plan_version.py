"""Versions of plan.json, and the upgrade of an older readable version to the current one (docs/plan-format.md)."""

from __future__ import annotations

from typing import Any

from ..errors import PlanError
from ..schedule.activation import Activation
from .fields import Fields

__all__ = ["PLAN_VERSION", "READABLE_VERSIONS", "upgraded"]

#: Version 2: each stage's `activation` policy (a name) replaces version 1's `recompute` flag; the layout's fields
#: are those of version 1 (`cp` and `ep` written only when above 1). Version 1 plans still load (`upgraded`).
PLAN_VERSION = 2
READABLE_VERSIONS = (1, 2)


def upgraded(data: Any, f: Fields = Fields("plan", PlanError)) -> dict[str, Any]:
    """Plan JSON of a readable version as the current version writes it: version 1's per-stage `recompute` flag
    becomes the `activation` policy's name. Fields are checked afterwards, by `Plan.from_json`; a file that is no
    plan (a run report, a trainer's config) or of a version it cannot read fails here, saying so."""
    if not isinstance(data, dict) or "stages" not in data:
        report = isinstance(data, dict) and "measured_step_time_s" in data
        f.fail("not a plan (" + ("a run report, which `autopp run` writes" if report else "no field 'stages'")
               + "): give the plan JSON that `autopp plan` wrote")
    if data.get("version") not in READABLE_VERSIONS:
        f.fail(f"plan version {data.get('version')!r} is not supported (expected one of {list(READABLE_VERSIONS)})")
    if data.get("version") == PLAN_VERSION:
        return data
    stages = data.get("stages")
    if isinstance(stages, list):
        stages = [_upgraded_stage(s, f.at(f"stage {i}")) for i, s in enumerate(stages)]
    return {**data, "version": PLAN_VERSION, "stages": stages}


def _upgraded_stage(s: Any, f: Fields) -> Any:
    if isinstance(s, dict) and "activation" in s:
        f.fail("field 'activation' is version 2's; a version-1 stage has field 'recompute' (true or false)")
    if not isinstance(s, dict) or "recompute" not in s:
        return s
    flag = f.flag(s["recompute"], "recompute")
    rest = {k: v for k, v in s.items() if k != "recompute"}
    return {**rest, "activation": (Activation.RECOMPUTE if flag else Activation.KEEP).value}
