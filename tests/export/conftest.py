"""Plans to export: examples/gpt.py from the shipped profile, and a tiny HF Llama from its profile in data/."""

from __future__ import annotations

from pathlib import Path

import pytest

from autopp.data.cluster import Cluster
from autopp.data.layout import LayoutPins
from autopp.data.plan import Plan
from autopp.data.profile import Profile, load_profile
from autopp.schedule import Activation, ScheduleName
from autopp.solve import PlanRequest, make_plan

ROOT = Path(__file__).resolve().parents[2]
LLAMA = Path(__file__).parent / "data" / "hf_llama"


def unit_modules(profile: Profile) -> list[list[str]]:
    return profile.unit_modules()


def plan_for(profile: Profile, devices: int = 2, **kw: object) -> Plan:
    request = PlanRequest(cluster=Cluster(num_devices=devices, memory_bytes=4 << 30), global_batch=8, **kw)
    return make_plan(profile, request)


@pytest.fixture(scope="session")
def llama() -> Profile:
    return load_profile(LLAMA)


@pytest.fixture(scope="session")
def gpt() -> Profile:
    return load_profile(ROOT / "profiles" / "gpt")


@pytest.fixture(scope="session")
def llama_plans(llama: Profile) -> dict[str, Plan]:
    """1F1B on 2 ranks, Interleaved1F1B (v 2) on 2 ranks, ZBV on 2 ranks, and 1F1B recomputing every unit (the
    trainers' full recomputation) on 2 x dp 2."""
    return {"1f1b": plan_for(llama),
            "interleaved": plan_for(llama, schedule=ScheduleName.INTERLEAVED_1F1B, pins=LayoutPins(v=2)),
            "zbv": plan_for(llama, schedule=ScheduleName.ZBV_ZERO_BUBBLE),
            "dp": plan_for(llama, devices=4, pins=LayoutPins(pp=2, dp=2),
                           activations=(Activation.BLOCKS,))}
