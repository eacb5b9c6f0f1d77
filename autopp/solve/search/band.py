"""The band of a predicted step from the profile's spreads, and the tie rule it sets for comparing candidates.

A measured profile keeps, per unit and kind (F, B, I, W, recompute), the median of its timed repeats and their
spread, max - min (autopp.measure.timing). It keeps no extremes, so the band takes the spread as centred on the
median: the candidate is simulated once with every unit's times at median - spread / 2 (at least 0) and once at
median + spread / 2, all units together (a slow or fast machine moves every unit the same way). Tensor-parallel rows
(tp.csv) carry no spreads, and a profile counted analytically has spreads of 0: its band is the step itself, said as
such, not invented. Candidates whose steps lie within the fastest's band are ties (`choose`): profiling the same
model again moves their order by about as much as the band, so the one kept is chosen by a stated rule instead
(fewer microbatches, then less peak memory, then the faster step), and the plan says when its margin is that small.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ...data.profile import Profile
from .judge import Verdict, judge
from .request import PlanRequest
from .views import Views

__all__ = ["SPREAD_KINDS", "Band", "shifted", "has_spread", "band", "choose"]

#: The time columns of units.csv whose `KIND_spread_s` the band reads.
SPREAD_KINDS = ("forward", "backward", "backward_input", "backward_weight", "recompute")


@dataclass(frozen=True)
class Band:
    """A predicted step's band: the step simulated with every unit at the low and at the high end of its spread."""

    low_s: float
    high_s: float

    @property
    def width_s(self) -> float:
        return self.high_s - self.low_s


def shifted(profile: Profile, sign: float, end: int | None = None) -> Profile:
    """`profile` with each unit's times moved by `sign` x half its spread (at least 0); itself when it has no
    spread columns. With `end`, a profiled size nearest an extrapolated one, every size's times move by the same
    fraction of themselves as at `end` (spread / time there): both ends of a line moved by their own spreads can
    tilt it so far that past the profiled sizes `sign` moves the step the other way, or not at all."""
    cols = [k for k in SPREAD_KINDS if f"{k}_s" in profile.units and f"{k}_spread_s" in profile.units]
    if not cols:
        return profile
    units = profile.units.copy()
    for k in cols:
        spread = units[f"{k}_spread_s"]
        if end is not None:
            at = units[units.microbatch_size == end].set_index("unit")
            ratio = (at[f"{k}_spread_s"] / at[f"{k}_s"].where(at[f"{k}_s"] > 0)).fillna(0.0)
            spread = units[f"{k}_s"] * units["unit"].map(ratio).fillna(0.0)
        units[f"{k}_s"] = (units[f"{k}_s"] + sign * spread / 2).clip(lower=0.0)
    return replace(profile, units=units)


def has_spread(profile: Profile) -> bool:
    """Whether any unit's time has a spread above 0 (an analytic profile has none)."""
    return any(f"{k}_spread_s" in profile.units and float(profile.units[f"{k}_spread_s"].max()) > 0
               for k in SPREAD_KINDS)


def band(profile: Profile, req: PlanRequest, v: Verdict) -> Band:
    """The band of `v`'s step (module docstring): its candidate judged on the profile shifted down and up (at a
    microbatch size outside the profiled ones, by the nearest profiled size's spreads as fractions: `shifted`); the
    step itself when the profile has no spread."""
    if not has_spread(profile):
        return Band(v.step_s, v.step_s)
    c = v.candidate
    sizes = profile.meta.microbatch_sizes
    end = min(sizes) if c.microbatch_size < min(sizes) else max(sizes) if c.microbatch_size > max(sizes) else None
    steps = [v.step_s]
    for sign in (-1.0, 1.0):
        views = Views(shifted(profile, sign, end), req)
        steps.append(judge(views.arrays(c.microbatch_size, c.layout), views.request(c.layout).cluster, c).step_s)
    return Band(min(steps), max(steps))


def _tie_key(v: Verdict) -> tuple[int, int, float]:
    """The tie rule: fewer microbatches, then less peak memory, then the faster step."""
    return (v.candidate.microbatches, max(v.peak_memory), v.step_s)


def choose(fitting: list[Verdict], high_s: float, ties: bool = True) -> tuple[Verdict, list[Verdict]]:
    """The verdict kept among `fitting` (not empty) and the others whose step lies within the fastest's band (at most
    `high_s`, its top): with `ties`, the kept one is chosen among them by `_tie_key`; without, or when none is
    inside the band, the fastest (then least memory, `Verdict.key`)."""
    fastest = min(fitting, key=lambda v: v.key)
    inside = [v for v in fitting if v.step_s <= high_s]
    kept = min(inside, key=_tie_key) if ties and inside else fastest
    return kept, [v for v in inside if v is not kept]
